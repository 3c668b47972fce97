"""FrozenLake: the multi-turn, stochastic RAGEN game, with Gymnasium FrozenLake-v1's transition law.

Maps use Gymnasium's letters (``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal). A random map has
each tile frozen with probability ``p_frozen``, a random start and goal, and is regenerated until a
path exists. The board the agent sees uses RAGEN's symbols (see ``LEGEND``). Slippery moves go in the
intended direction with ``success_rate`` (1/3), else in one of the two perpendicular directions
with equal probability; a move into the edge leaves the player in place. This is exactly the table
``P`` Gymnasium builds for the same map (a test compares them).
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from ragen_tasks.envs._common import (
    DIAGONALS,
    GameConfig,
    action_space,
    direction_words,
    load_config,
    step_info,
    text_space,
)
from ragen_tasks.envs.base import TextGame, canonical_action

#: Action names in Gymnasium's order (0 Left, 1 Down, 2 Right, 3 Up).
ACTIONS: tuple[str, ...] = ("Left", "Down", "Right", "Up")
#: (row, col) step of each action, in ACTIONS' order.
ACTION_DELTAS: tuple[tuple[int, int], ...] = ((0, -1), (1, 0), (0, 1), (-1, 0))

LEGEND: Mapping[str, str] = {
    "P": "player",
    "_": "frozen tile",
    "O": "hole",
    "G": "goal",
    "X": "player fell into a hole",
    "√": "player on the goal",
}
_TILE_SYMBOL = {"S": "_", "F": "_", "H": "O", "G": "G"}
_PLAYER_SYMBOL = {"S": "P", "F": "P", "H": "X", "G": "√"}
_TILE_WORD = {"S": "frozen", "F": "frozen", "H": "hole", "G": "goal"}  # the legend's words, the start as it shows
MAX_SIZE = 32


class FrozenLakeConfig(GameConfig):
    """FrozenLake options: a random ``size`` x ``size`` map, or a fixed map ``desc``."""

    size: int = Field(4, ge=2, le=MAX_SIZE, description="side of a random map (ignored when desc is given)")
    p_frozen: float = Field(0.8, gt=0, le=1, description="probability that a tile of a random map is frozen")
    desc: tuple[str, ...] | None = Field(
        None, description="fixed map: rows of S/F/H/G letters (Gymnasium's format), one S and one G"
    )
    is_slippery: bool = Field(True, description="slippery dynamics (False: every move goes where intended)")
    success_rate: float = Field(
        1.0 / 3.0, gt=0, le=1, description="probability of the intended direction when slippery (Gymnasium's)"
    )
    generation_tries: int = Field(1000, ge=1, description="random maps drawn before giving up (path must exist)")
    position_hint: Literal["none", "coordinates", "directions"] = Field(
        "none",
        description="a line under the board for small models, which cannot read positions from the grid's "
        "tokens: 'coordinates' gives the player's and the goal's row and column, 'directions' where the goal "
        "lies from the player in action names (e.g. 'The goal is Down 2 and Left 1 from you.'); holes are "
        "only on the board",
    )

    @field_validator("desc")
    @classmethod
    def _desc_ok(cls, desc: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if desc is None:
            return None
        if not desc or not desc[0]:
            raise ValueError("must have at least one row with at least one tile")
        if len(desc) > MAX_SIZE or len(desc[0]) > MAX_SIZE:
            raise ValueError(f"must be at most {MAX_SIZE}x{MAX_SIZE}")
        if any(len(row) != len(desc[0]) for row in desc):
            raise ValueError("rows must all have the same length")
        bad = sorted({ch for row in desc for ch in row} - set("SFHG"))
        if bad:
            raise ValueError(f"unknown letters {bad}; allowed letters: S (start), F (frozen), H (hole), G (goal)")
        for letter in "SG":
            count = sum(row.count(letter) for row in desc)
            if count != 1:
                raise ValueError(f"needs exactly one {letter!r}, found {count}")
        if shortest_path(desc) is None:
            raise ValueError("no path from S to G avoiding holes")
        return desc


def _find(desc: Sequence[str], letter: str) -> tuple[int, int]:
    for r, row in enumerate(desc):
        c = row.find(letter)
        if c >= 0:
            return (r, c)
    raise ValueError(f"map has no {letter!r}")


def _move(r: int, c: int, action: int, nrow: int, ncol: int) -> tuple[int, int]:
    dr, dc = ACTION_DELTAS[action]
    return (min(max(r + dr, 0), nrow - 1), min(max(c + dc, 0), ncol - 1))


def shortest_path(
    desc: Sequence[str], start: tuple[int, int] | None = None, goal: tuple[int, int] | None = None
) -> list[str] | None:
    """Fewest actions from ``start`` to ``goal`` avoiding holes, ignoring slip (for demonstrations).

    ``start``/``goal`` are (row, col) and default to the map's ``S``/``G``. Returns action names, or
    None when no path exists.
    """
    start = _find(desc, "S") if start is None else start
    goal = _find(desc, "G") if goal is None else goal
    nrow, ncol = len(desc), len(desc[0])
    parent: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            path: list[str] = []
            step = parent[cell]
            while step is not None:
                cell, action = step
                path.append(ACTIONS[action])
                step = parent[cell]
            return path[::-1]
        for action in range(4):
            nxt = _move(cell[0], cell[1], action, nrow, ncol)
            if nxt not in parent and desc[nxt[0]][nxt[1]] != "H":
                parent[nxt] = (cell, action)
                queue.append(nxt)
    return None


def generate_map(rng: np.random.Generator, size: int, p_frozen: float, tries: int) -> tuple[str, ...]:
    """A random ``size`` x ``size`` map with a random start and goal and a path between them."""
    for _ in range(tries):
        frozen = rng.random((size, size)) < p_frozen
        start, goal = rng.choice(size * size, size=2, replace=False).tolist()
        rows = [["F" if f else "H" for f in row] for row in frozen.tolist()]
        rows[start // size][start % size] = "S"
        rows[goal // size][goal % size] = "G"
        desc = tuple("".join(row) for row in rows)
        if shortest_path(desc) is not None:
            return desc
    raise RuntimeError(
        f"frozen_lake: no {size}x{size} map with a path from start to goal in {tries} tries at "
        f"p_frozen={p_frozen}; raise p_frozen or generation_tries"
    )


def position_hint(position: tuple[int, int], goal: tuple[int, int], kind: str) -> str:
    """The text of ``FrozenLakeConfig.position_hint`` for a player at ``position`` ((row, col))."""
    if kind == "none":
        return ""
    (row, col), (goal_row, goal_col) = position, goal
    if kind == "coordinates":
        return f"You are at row {row + 1}, column {col + 1}. The goal is at row {goal_row + 1}, column {goal_col + 1}."
    words = direction_words(position, goal)
    return f"The goal is {words} from you." if words else "You are on the goal."


# table[s][a] = ((probability, next_state), ...): immutable, so one table can serve many envs
TransitionTable = tuple[tuple[tuple[tuple[float, int], ...], ...], ...]


def transition_table(
    desc: Sequence[str], *, is_slippery: bool = True, success_rate: float = 1.0 / 3.0
) -> TransitionTable:
    """``table[s][a]`` = ((probability, next_state), ...) from a non-terminal state ``s`` (row * ncol + col).

    The law is Gymnasium's: the intended direction ``a`` with ``success_rate`` and ``(a - 1) % 4``,
    ``(a + 1) % 4`` with ``(1 - success_rate) / 2`` each when slippery. Holes and the goal are
    terminal: their rows are empty. Cached per map: the rollouts of a group share their map, and
    building a table is pure Python, paid at every reset without the cache.
    """
    return _transition_table(tuple(desc), is_slippery, float(success_rate))


@functools.lru_cache(maxsize=256)
def _transition_table(desc: tuple[str, ...], is_slippery: bool, success_rate: float) -> TransitionTable:
    nrow, ncol = len(desc), len(desc[0])
    fail_rate = (1.0 - success_rate) / 2.0
    table: list[tuple[tuple[tuple[float, int], ...], ...]] = []
    for s in range(nrow * ncol):
        r, c = divmod(s, ncol)
        if desc[r][c] in "GH":
            table.append(((), (), (), ()))
            continue
        per_action = []
        for a in range(4):
            outcomes = [(a - 1) % 4, a, (a + 1) % 4] if is_slippery else [a]
            entries = []
            for b in outcomes:
                p = (success_rate if b == a else fail_rate) if is_slippery else 1.0
                nr, nc = _move(r, c, b, nrow, ncol)
                entries.append((p, nr * ncol + nc))
            per_action.append(tuple(entries))
        table.append(tuple(per_action))
    return tuple(table)


@dataclass(frozen=True)
class TurnPlanner:
    """The best play of one map under the agent's rules, by dynamic programming over turns.

    The agent acts in turns: each turn it names up to ``max_actions_per_turn`` actions, which run
    in order WITHOUT seeing the board in between (the episode may end midway), then it sees the
    board again. ``value[k, m, s]`` is the highest probability of reaching the goal from cell ``s``
    with ``k`` turns and ``m`` actions left; ``choice[k, m, s]`` indexes ``sequences``, the action
    sequence of the current turn that achieves it. Among sequences of equal value it takes the one
    that reaches the goal in the fewest turns (expected turns on the successful paths; on ice that
    does not slip: the shortest path, as many actions a turn as allowed), then the shortest. This
    is the ceiling of the game at that budget and the slip-aware demonstrator of the warm start.
    """

    sequences: tuple[tuple[str, ...], ...]  # every action sequence of 1 .. max_actions_per_turn actions
    value: np.ndarray  # (turns + 1, actions + 1, cells) float64 success probability
    choice: np.ndarray  # (turns + 1, actions + 1, cells) int64 index into sequences; -1 = no turn left

    def best(self, cell: int, turns_left: int, actions_left: int) -> tuple[str, ...]:
        """The best actions for this turn (empty when no turn or action is left)."""
        k = min(turns_left, self.value.shape[0] - 1)
        m = min(actions_left, self.value.shape[1] - 1)
        index = int(self.choice[k, m, cell]) if k > 0 and m > 0 else -1
        return self.sequences[index] if index >= 0 else ()


#: The planner searches 4^k sequences per turn: beyond 5 actions a turn the search is slow and the
#: ceiling no higher (4x4, 5 turns, 10 actions: 0.504 at 3, 0.508 at 5).
PLANNED_ACTIONS_PER_TURN = 5


def turn_planner(
    desc: Sequence[str],
    *,
    turns: int,
    actions: int,
    max_actions_per_turn: int,
    is_slippery: bool = True,
    success_rate: float = 1.0 / 3.0,
) -> TurnPlanner:
    """``TurnPlanner`` for map ``desc`` and this budget (cached: a group's rollouts share a map)."""
    if turns < 1 or actions < 1 or not 1 <= max_actions_per_turn <= 6:
        raise ValueError(
            f"turns={turns} and actions={actions} must be >= 1 and max_actions_per_turn={max_actions_per_turn} "
            "in 1..6 (4^k sequences are searched per turn)"
        )
    return _turn_planner(tuple(desc), turns, actions, max_actions_per_turn, is_slippery, float(success_rate))


def _step_matrix(table: TransitionTable) -> np.ndarray:
    """(action, from, to) one-step probabilities of ``table``; a hole or the goal absorbs (the episode
    is over there: no further move)."""
    cells = len(table)
    step = np.zeros((4, cells, cells))
    for s, per_action in enumerate(table):
        for a, entries in enumerate(per_action):
            if not entries:
                step[a, s, s] = 1.0
            for p, s2 in entries:
                step[a, s, s2] += p
    return step


@functools.lru_cache(maxsize=256)
def _turn_planner(
    desc: tuple[str, ...], turns: int, actions: int, per_turn: int, is_slippery: bool, success_rate: float
) -> TurnPlanner:
    step = _step_matrix(_transition_table(desc, is_slippery, success_rate))  # (4, cells, cells)
    cells = step.shape[1]
    flat = "".join(desc)
    goal = np.array([ch == "G" for ch in flat], dtype=np.float64)  # (cells,)
    terminal = np.array([ch in "GH" for ch in flat])  # (cells,)
    sequences = tuple(q for n in range(1, per_turn + 1) for q in itertools.product(range(4), repeat=n))
    lengths = np.array([len(q) for q in sequences])  # (Q,)
    # (Q, from, to): where a whole turn's sequence ends. itertools.product lists the sequences of
    # length n as prefix-major, so they are every length-(n-1) prefix followed by each action.
    by_length = [step]
    for _ in range(per_turn - 1):
        by_length.append((by_length[-1][:, None] @ step[None]).reshape(-1, cells, cells))
    reach = np.concatenate(by_length)
    value = np.zeros((turns + 1, actions + 1, cells))
    # turns_to_goal[k, m, s]: expected turns used on the paths that reach the goal (the tie-break)
    turns_to_goal = np.zeros((turns + 1, actions + 1, cells))
    choice = np.full((turns + 1, actions + 1, cells), -1, dtype=np.int64)
    value[0, :] = goal
    value[:, 0] = goal
    rows, every_cell = np.arange(len(sequences)), np.arange(cells)
    flat_reach = reach.reshape(-1, cells)  # (Q * cells, cells)
    for k in range(1, turns + 1):
        after = np.where(terminal, goal, value[k - 1])  # (actions + 1, cells): value once the turn ends
        later = np.where(terminal, 0.0, turns_to_goal[k - 1])  # (actions + 1, cells)
        # ends[q, s, r]: success if the turn plays q from cell s and r actions are left after it;
        # turns_used[q, s, r]: this turn and the later ones, counted on the successful paths
        ends = (flat_reach @ after.T).reshape(len(sequences), cells, actions + 1)
        turns_used = (flat_reach @ (after + later).T).reshape(len(sequences), cells, actions + 1)
        for m in range(1, actions + 1):
            left = m - lengths  # (Q,) actions left after each sequence; < 0: it does not fit
            fits = (left >= 0)[:, None]
            scores = np.where(fits, ends[rows, :, np.maximum(left, 0)], -1.0)  # (Q, cells)
            best = scores.max(axis=0)  # (cells,)
            tied = scores >= best - 1e-12  # (Q, cells) sequences of the best value, within rounding
            used = np.where(tied, turns_used[rows, :, np.maximum(left, 0)], np.inf)  # (Q, cells)
            fewest = tied & (used <= used.min(axis=0) + 1e-12)
            choice[k, m] = np.argmax(fewest, axis=0)  # the first, i.e. shortest, of the fewest-turn ones
            value[k, m] = np.where(terminal, goal, best)
            turns_to_goal[k, m] = np.where(terminal, 0.0, used[choice[k, m], every_cell])
    names = tuple(tuple(ACTIONS[a] for a in q) for q in sequences)
    return TurnPlanner(sequences=names, value=value, choice=choice)


class FrozenLakeEnv(TextGame):
    """Walk from the start to the goal across a slippery lake without falling into a hole.

    ## Action Space
    ``Left``, ``Down``, ``Right``, ``Up`` (case-insensitive).

    ## Observation
    The board, one text row per map row: ``P`` player, ``_`` frozen, ``O`` hole, ``G`` goal,
    ``X`` player in a hole, ``√`` player on the goal.

    ## Rewards
    1 on reaching the goal, else 0 (an invalid action gives 0).

    ## Episode End
    Terminated in a hole or on the goal (``info["success"]`` = on the goal); truncated after
    ``max_actions_per_episode`` valid actions.

    ## Arguments
    See ``FrozenLakeConfig`` (``size``, ``p_frozen``, ``desc``, ``is_slippery``, ``success_rate``).
    """

    name = "frozen_lake"
    config: FrozenLakeConfig
    render_mode = "ansi"

    def __init__(self, config: FrozenLakeConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = load_config(FrozenLakeConfig, self.name, overrides)
        elif overrides:
            raise ValueError(
                f"frozen_lake: pass either a FrozenLakeConfig or keyword options, not both ({sorted(overrides)})"
            )
        self.config = config
        rows = len(config.desc) if config.desc else config.size
        cols = len(config.desc[0]) if config.desc else config.size
        self.observation_space = text_space(rows * (cols + 1), LEGEND)
        self.action_space = action_space(ACTIONS)
        self.desc: tuple[str, ...] = config.desc or ()
        self._table: TransitionTable = ()
        self._ncol = cols
        self._state = 0
        self._actions = 0
        self._boards: dict[int, str] = {}
        if config.desc is not None:
            self._set_map(config.desc)

    def _set_map(self, desc: tuple[str, ...]) -> None:
        self.desc = desc
        self._ncol = len(desc[0])
        self._table = transition_table(desc, is_slippery=self.config.is_slippery, success_rate=self.config.success_rate)
        self._flat = "".join(desc)
        self._boards = {}

    @property
    def action_names(self) -> tuple[str, ...]:
        return ACTIONS

    @property
    def legend(self) -> Mapping[str, str]:
        return LEGEND

    @property
    def position(self) -> tuple[int, int]:
        """(row, col) of the player."""
        r, c = divmod(self._state, self._ncol)
        return (r, c)

    @property
    def cell(self) -> int:
        """The player's flat cell index, ``row * width + col``: how the planner's tables index cells."""
        return self._state

    @property
    def goal(self) -> tuple[int, int]:
        """(row, col) of the goal."""
        return divmod(self._flat.index("G"), self._ncol)

    @property
    def neighbours(self) -> tuple[str, ...]:
        """What lies one step from the player in each direction, in ACTIONS' order: ``hole``,
        ``frozen`` (the start included), ``goal``, or ``wall`` off the board (a move into it leaves
        the player where it is)."""
        return self._tiles_at(ACTION_DELTAS)

    @property
    def diagonals(self) -> tuple[str, ...]:
        """What lies one step diagonally from the player, in ``DIAGONALS``' order (Up Left, Up Right,
        Down Left, Down Right), in the words of ``neighbours``."""
        return self._tiles_at(tuple(delta for _, delta in DIAGONALS))

    def _tiles_at(self, deltas: tuple[tuple[int, int], ...]) -> tuple[str, ...]:
        """The tile word at each (row, col) offset from the player, ``wall`` off the board."""
        row, col = self.position
        rows, cols = len(self.desc), len(self.desc[0])
        return tuple(
            _TILE_WORD[self.desc[row + d_row][col + d_col]]
            if 0 <= row + d_row < rows and 0 <= col + d_col < cols
            else "wall"
            for d_row, d_col in deltas
        )

    @property
    def actions_left(self) -> int:
        """Valid actions this episode may still take before it truncates."""
        return self.config.max_actions_per_episode - self._actions

    def turn_outcome(self, actions: Sequence[str]) -> np.ndarray:
        """Where a turn of ``actions``, run blind from the current cell, ends: (cells,) probabilities
        under the game's slip law (a hole or the goal ends it early; no actions: where it stands)."""
        step = _step_matrix(self._table)  # (4, cells, cells)
        where = np.zeros(step.shape[1])  # (cells,) probability of standing on each cell
        where[self._state] = 1.0
        for action in actions:
            where = where @ step[ACTIONS.index(action)]
        return where

    def planner(self, *, turns: int, actions: int, max_actions_per_turn: int) -> TurnPlanner:
        """The slip-aware ``TurnPlanner`` of the current map for an agent with ``turns`` turns,
        ``actions`` actions (at most this lake's own limit) and up to ``max_actions_per_turn`` blind
        actions a turn (at most ``PLANNED_ACTIONS_PER_TURN``): the game's ceiling at that budget and
        the warm start's demonstrator."""
        return turn_planner(
            self.desc,
            turns=turns,
            actions=min(actions, self.config.max_actions_per_episode),
            max_actions_per_turn=min(max_actions_per_turn, PLANNED_ACTIONS_PER_TURN),
            is_slippery=self.config.is_slippery,
            success_rate=self.config.success_rate,
        )

    def render(self) -> str:
        board = self._boards.get(self._state)
        if board is None:  # boards depend only on the player's cell: build each once per map
            cells = [_TILE_SYMBOL[ch] for ch in self._flat]
            cells[self._state] = _PLAYER_SYMBOL[self._flat[self._state]]
            board = "\n".join("".join(cells[i : i + self._ncol]) for i in range(0, len(cells), self._ncol))
            hint = position_hint(self.position, self.goal, self.config.position_hint)
            if hint:
                board += "\n" + hint
            self._boards[self._state] = board
        return board

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if self.config.desc is None:
            cfg = self.config
            self._set_map(generate_map(self.np_random, cfg.size, cfg.p_frozen, cfg.generation_tries))
        self._state = self._flat.index("S")
        self._actions = 0
        return self.render(), {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        tile = self._flat[self._state]
        terminated = tile in "GH"
        truncated = not terminated and self._actions >= self.config.max_actions_per_episode
        name = canonical_action(action, ACTIONS) if isinstance(action, str) else None
        if name is None or terminated or truncated:
            info = step_info(valid=name is not None, effective=False, success=tile == "G")
            return self.render(), 0.0, terminated, truncated, info
        entries = self._table[self._state][ACTIONS.index(name)]
        u = self.np_random.random()
        nxt = entries[-1][1]
        for p, s in entries:
            if u < p:
                nxt = s
                break
            u -= p
        effective = nxt != self._state
        self._state = nxt
        self._actions += 1
        tile = self._flat[nxt]
        terminated = tile in "GH"
        truncated = not terminated and self._actions >= self.config.max_actions_per_episode
        reward = 1.0 if tile == "G" else 0.0
        return (
            self.render(),
            reward,
            terminated,
            truncated,
            step_info(valid=True, effective=effective, success=tile == "G"),
        )

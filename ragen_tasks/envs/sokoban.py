"""Sokoban: the multi-turn, deterministic, irreversible RAGEN game; room generator and BFS solver.

Generation (always solvable by construction): a random-walk topology carved inside an outer wall,
boxes placed on their targets, then *reverse play*: the player walks randomly and sometimes pulls
the box behind it. A pull is the inverse of a push, so the solved room can be reached from every
state of the walk. Over ``reverse_walks`` walks we keep the state with the best score (boxes
switched x total box displacement, as in gym-sokoban; rooms of 6x6 and up need a score of at least
2, so no room is solved by a single push) and finish with a few plain walking steps. Randomness comes only from the env's
``np_random`` (drawn in batches, which is also what makes generation fast).

Cells are flat indices ``row * width + col``; the outer ring of a room is wall, so moves never
leave the grid.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from ragen_tasks.envs._common import GameConfig, action_space, load_config, step_info, text_space
from ragen_tasks.envs.base import TextGame, canonical_action

ACTIONS: tuple[str, ...] = ("Up", "Down", "Left", "Right")
#: (row, col) step of each action, in ACTIONS' order.
ACTION_DELTAS: tuple[tuple[int, int], ...] = ((-1, 0), (1, 0), (0, -1), (0, 1))
MAX_DIM = 30


@dataclass(frozen=True)
class SymbolSet:
    """One character per kind of cell."""

    wall: str
    floor: str
    target: str
    box: str
    box_on_target: str
    player: str
    player_on_target: str

    def chars(self) -> tuple[str, ...]:
        return (self.wall, self.floor, self.target, self.box, self.box_on_target, self.player, self.player_on_target)

    def legend(self) -> dict[str, str]:
        meanings = ("wall", "empty floor", "target", "box", "box on target", "player", "player on target")
        return dict(zip(self.chars(), meanings, strict=True))


#: Symbol sets by name: RAGEN's (default) and the classic XSB level format (so users can paste levels).
SYMBOL_SETS: Mapping[str, SymbolSet] = {
    "ragen": SymbolSet("#", "_", "O", "X", "√", "P", "S"),
    "xsb": SymbolSet("#", " ", ".", "$", "*", "@", "+"),
}


@dataclass(frozen=True)
class Room:
    """A Sokoban state: immutable, hashable. Cells are flat indices ``row * width + col``."""

    height: int
    width: int
    walls: frozenset[int]
    targets: frozenset[int]
    boxes: frozenset[int]
    player: int

    @property
    def solved(self) -> bool:
        return self.boxes == self.targets

    def to_text(self, symbols: SymbolSet | str = "ragen") -> str:
        sym = SYMBOL_SETS[symbols] if isinstance(symbols, str) else symbols
        cells = []
        for i in range(self.height * self.width):
            if i in self.walls:
                ch = sym.wall
            elif i == self.player:
                ch = sym.player_on_target if i in self.targets else sym.player
            elif i in self.boxes:
                ch = sym.box_on_target if i in self.targets else sym.box
            else:
                ch = sym.target if i in self.targets else sym.floor
            cells.append(ch)
        w = self.width
        return "\n".join("".join(cells[i : i + w]) for i in range(0, len(cells), w))

    @classmethod
    def from_text(cls, text: str, symbols: SymbolSet | str = "ragen") -> Room:
        """Parse a room; short rows are padded with wall. Raises ValueError saying what is wrong."""
        sym = SYMBOL_SETS[symbols] if isinstance(symbols, str) else symbols
        rows = text.strip("\n").split("\n")
        height, width = len(rows), max(len(row) for row in rows)
        if height < 3 or width < 3:
            raise ValueError(f"a room must be at least 3x3, got {height}x{width}")
        if height > MAX_DIM or width > MAX_DIM:
            raise ValueError(f"a room must be at most {MAX_DIM}x{MAX_DIM}, got {height}x{width}")
        walls, targets, boxes, players = set(), set(), set(), []
        known = sym.legend()
        for r, row in enumerate(rows):
            for c, ch in enumerate(row.ljust(width, sym.wall)):
                i = r * width + c
                if ch not in known:
                    raise ValueError(f"unknown symbol {ch!r} at row {r}, col {c}; allowed symbols: {known}")
                if ch == sym.wall:
                    walls.add(i)
                if ch in (sym.target, sym.box_on_target, sym.player_on_target):
                    targets.add(i)
                if ch in (sym.box, sym.box_on_target):
                    boxes.add(i)
                if ch in (sym.player, sym.player_on_target):
                    players.append(i)
        if len(players) != 1:
            raise ValueError(
                f"a room needs exactly one player ({sym.player!r} or {sym.player_on_target!r}), found {len(players)}"
            )
        if not boxes or len(boxes) != len(targets):
            raise ValueError(
                f"a room needs as many boxes as targets (at least one), found {len(boxes)} and {len(targets)}"
            )
        room = cls(height, width, frozenset(walls), frozenset(targets), frozenset(boxes), players[0])
        edge = _reaches_edge(room)
        if edge is not None:
            raise ValueError(
                f"the room is not enclosed: the player can reach the edge at row {edge[0]}, col {edge[1]}; add walls"
            )
        return room


def _reaches_edge(room: Room) -> tuple[int, int] | None:
    h, w = room.height, room.width
    seen = {room.player}
    queue = deque([room.player])
    while queue:
        i = queue.popleft()
        r, c = divmod(i, w)
        if r in (0, h - 1) or c in (0, w - 1):
            return (r, c)
        for j in (i - w, i + w, i - 1, i + 1):
            if j not in seen and j not in room.walls:
                seen.add(j)
                queue.append(j)
    return None


class SokobanConfig(GameConfig):
    """Sokoban options: a random ``dim_room`` room with ``num_boxes`` boxes, or a fixed ``room``."""

    dim_room: tuple[int, int] = Field(
        (6, 6), description=f"(rows, cols) of a random room, 3x3 to {MAX_DIM}x{MAX_DIM}, outer wall included"
    )
    num_boxes: int = Field(1, ge=1, description="boxes (and targets) in a random room")
    symbols: Literal["ragen", "xsb"] = Field("ragen", description="symbol set of the board text (and of a fixed room)")
    room: str | None = Field(None, description="fixed room in the text form of `symbols` (every reset gives this room)")
    reverse_steps: int = Field(300, ge=1, le=100_000, description="steps of one reverse-play walk")
    reverse_walks: int = Field(
        4, ge=1, le=100, description="reverse-play walks per attempt; the best-scoring state is kept (harder rooms)"
    )
    generation_tries: int = Field(50, ge=1, le=10_000, description="generation attempts before raising an error")
    step_reward: float = Field(-0.1, description="reward of every valid action")
    box_on_target_reward: float = Field(1.0, description="reward for pushing a box onto a target")
    box_off_target_reward: float = Field(-1.0, description="reward for pushing a box off a target")
    solved_reward: float = Field(10.0, description="bonus when every box is on a target")

    @field_validator("dim_room")
    @classmethod
    def _dim_ok(cls, dim: tuple[int, int]) -> tuple[int, int]:
        if min(dim) < 3:
            raise ValueError("must be at least 3x3")
        if max(dim) > MAX_DIM:
            raise ValueError(f"must be at most {MAX_DIM}x{MAX_DIM}")
        return dim

    @model_validator(mode="after")
    def _consistent(self) -> SokobanConfig:
        if self.room is not None:
            try:
                room = Room.from_text(self.room, self.symbols)
            except ValueError as err:
                raise ValueError(f"room={self.room!r}: {err}") from None
            if room.solved:
                raise ValueError(f"room={self.room!r}: already solved (every box is on a target)")
            if "dim_room" in self.model_fields_set and self.dim_room != (room.height, room.width):
                raise ValueError(
                    f"dim_room={self.dim_room}: the fixed room is {room.height}x{room.width}; drop dim_room"
                )
            if "num_boxes" in self.model_fields_set and self.num_boxes != len(room.boxes):
                raise ValueError(f"num_boxes={self.num_boxes}: the fixed room has {len(room.boxes)}; drop num_boxes")
            return self
        interior = (self.dim_room[0] - 2) * (self.dim_room[1] - 2)
        if self.num_boxes + 1 > interior:
            raise ValueError(
                f"num_boxes={self.num_boxes}: more boxes than floor; a {self.dim_room[0]}x{self.dim_room[1]} room has "
                f"{interior} inner cells, so at most {interior - 1} boxes (one cell is the player's)"
            )
        return self


class RoomGenerationError(RuntimeError):
    """No room could be generated within the configured budget."""


# Brushes carved along the topology walk: (dr, dc) offsets (gym-sokoban's five 3x3 masks).
_BRUSHES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, -1), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
)


def _topology(rng: np.random.Generator, h: int, w: int) -> list[int]:
    """Floor cells carved by a random walk with random brushes, inside the outer wall."""
    steps = int(1.7 * (h + w))
    floor = bytearray(h * w)
    r = int(rng.integers(1, h - 1))
    c = int(rng.integers(1, w - 1))
    turns = (rng.random(steps) < 0.35).tolist()
    dirs = rng.integers(0, 4, size=steps).tolist()
    brushes = rng.integers(0, len(_BRUSHES), size=steps).tolist()
    direction = dirs[0]
    for turn, new_dir, brush in zip(turns, dirs, brushes, strict=True):
        if turn:
            direction = new_dir
        for dr, dc in _BRUSHES[brush]:
            rr, cc = r + dr, c + dc
            if 0 < rr < h - 1 and 0 < cc < w - 1:
                floor[rr * w + cc] = 1
        dr, dc = ACTION_DELTAS[direction]
        r = min(max(r + dr, 1), h - 2)
        c = min(max(c + dc, 1), w - 2)
    return [i for i in range(h * w) if floor[i]]


def _reverse_walk(
    rng: np.random.Generator, is_floor: bytearray, w: int, targets: list[int], player: int, steps: int
) -> tuple[int, tuple[int, tuple[int, ...]] | None]:
    """One reverse-play walk from the solved state: (best score, (player, boxes) at that score or None)."""
    target_set = frozenset(targets)
    boxes = list(targets)  # box id -> cell; boxes start on their targets
    occupied = {cell: k for k, cell in enumerate(boxes)}
    deltas = (-w, w, -1, 1)
    moves = rng.integers(0, 4, size=steps).tolist()
    pulls = (rng.random(steps) < 0.8).tolist()
    best: tuple[int, tuple[int, ...]] | None = None
    best_score = 0
    swaps, last_box = 0, -1
    for move, pull in zip(moves, pulls, strict=True):
        d = deltas[move]
        nxt = player + d
        if not is_floor[nxt] or nxt in occupied:
            continue
        behind = player - d
        if pull and behind in occupied:  # pull: the box behind follows the player
            k = occupied.pop(behind)
            occupied[player] = k
            boxes[k] = player
            if k != last_box:
                swaps, last_box = swaps + 1, k
            player = nxt
            displacement = sum(abs(b // w - t // w) + abs(b % w - t % w) for b, t in zip(boxes, targets, strict=True))
            score = swaps * displacement
            if score > best_score and any(b not in target_set for b in boxes):
                best_score, best = score, (player, tuple(boxes))
        else:
            player = nxt
    return best_score, best


def _try_generate(
    rng: np.random.Generator, h: int, w: int, num_boxes: int, reverse_steps: int, walks: int
) -> Room | None:
    interior = (h - 2) * (w - 2)
    floors = _topology(rng, h, w)
    if len(floors) < max(num_boxes + 2, interior // 2):  # too cramped to be interesting: redraw
        return None
    picks = rng.choice(len(floors), size=num_boxes + 1, replace=False).tolist()
    targets = [floors[k] for k in picks[:num_boxes]]
    is_floor = bytearray(h * w)
    for i in floors:
        is_floor[i] = 1
    best_score, best = 0, None
    for _ in range(walks):  # several walks from the same start; keep the best-scoring state
        score, state = _reverse_walk(rng, is_floor, w, targets, floors[picks[-1]], reverse_steps)
        if score > best_score:
            best_score, best = score, state
    # Rooms of 6x6 and up must move the boxes at least 2 cells in all (no 1-push rooms); smaller ones 1.
    if best is None or best_score < (2 if interior >= 16 else 1):
        return None
    player, final_boxes = best
    box_set = frozenset(final_boxes)
    deltas = (-w, w, -1, 1)
    for move in rng.integers(0, 4, size=h + w).tolist():  # a few plain walking steps
        nxt = player + deltas[move]
        if is_floor[nxt] and nxt not in box_set:
            player = nxt
    walls = frozenset(i for i in range(h * w) if not is_floor[i])
    return Room(h, w, walls, frozenset(targets), box_set, player)


def generate_room(
    rng: np.random.Generator,
    dim_room: tuple[int, int],
    num_boxes: int,
    *,
    reverse_steps: int = 300,
    walks: int = 4,
    tries: int = 50,
) -> Room:
    """A random solvable room (not already solved); ``RoomGenerationError`` after ``tries`` failed attempts."""
    h, w = dim_room
    for _ in range(tries):
        room = _try_generate(rng, h, w, num_boxes, reverse_steps, walks)
        if room is not None:
            return room
    raise RoomGenerationError(
        f"sokoban: could not generate a {h}x{w} room with {num_boxes} box(es) in {tries} tries of {reverse_steps} "
        "reverse-play steps; use a larger dim_room, fewer num_boxes, or raise generation_tries / reverse_steps"
    )


class SolverBudgetExceeded(RuntimeError):
    """The BFS solver visited ``max_states`` states without deciding."""


def _dead_cells(room: Room) -> frozenset[int]:
    """Non-target floor cells in a corner: a box pushed there can never move again."""
    w, dead = room.width, set()
    for i in range(room.height * room.width):
        if i in room.walls or i in room.targets:
            continue
        vertical = (i - w) in room.walls or (i + w) in room.walls
        horizontal = (i - 1) in room.walls or (i + 1) in room.walls
        if vertical and horizontal:
            dead.add(i)
    return frozenset(dead)


def solve(room: Room | str, *, symbols: SymbolSet | str = "ragen", max_states: int = 1_000_000) -> list[str] | None:
    """Shortest plan (fewest actions) solving ``room``, by BFS over (player, boxes).

    ``room`` is a ``Room`` or its text form in ``symbols``. Returns action names ([] if already
    solved), None when the room is unsolvable; raises ``SolverBudgetExceeded`` after ``max_states``.
    """
    if isinstance(room, str):
        room = Room.from_text(room, symbols)
    if room.solved:
        return []
    walls, targets, dead = room.walls, room.targets, _dead_cells(room)
    deltas = (-room.width, room.width, -1, 1)
    start = (room.player, tuple(sorted(room.boxes)))
    parent: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, tuple[int, ...]], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        for a, d in enumerate(deltas):
            nxt = player + d
            if nxt in walls:
                continue
            new_boxes = boxes
            if nxt in boxes:
                beyond = nxt + d
                if beyond in walls or beyond in boxes or beyond in dead:
                    continue
                new_boxes = tuple(sorted(beyond if b == nxt else b for b in boxes))
            child = (nxt, new_boxes)
            if child in parent:
                continue
            parent[child] = (state, a)
            if new_boxes is not boxes and targets.issuperset(new_boxes):
                plan: list[str] = []
                link = parent[child]
                while link is not None:
                    prev, action = link
                    plan.append(ACTIONS[action])
                    link = parent[prev]
                return plan[::-1]
            if len(parent) > max_states:
                raise SolverBudgetExceeded(f"sokoban.solve: more than {max_states} states visited; raise max_states")
            queue.append(child)
    return None


class SokobanEnv(TextGame):
    """Push every box onto a target. Pushes are irreversible: a box in a corner stays there.

    ## Action Space
    ``Up``, ``Down``, ``Left``, ``Right`` (case-insensitive). Walking into a wall or pushing a box
    into a wall/box is valid but has no effect.

    ## Observation
    The board, one text row per room row, in the configured symbol set (``legend``). Default:
    ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on target, ``P`` player,
    ``S`` player on target.

    ## Rewards
    ``step_reward`` (-0.1) per valid action, +1 per box pushed onto a target, -1 per box pushed off,
    +10 when all boxes are on targets. An invalid action gives 0.

    ## Episode End
    Terminated when every box is on a target (``info["success"]``); truncated after
    ``max_actions_per_episode`` valid actions.

    ## Arguments
    See ``SokobanConfig`` (``dim_room``, ``num_boxes``, ``symbols``, ``room``, rewards, budgets).
    """

    name = "sokoban"
    config: SokobanConfig
    render_mode = "ansi"

    def __init__(self, config: SokobanConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = load_config(SokobanConfig, self.name, overrides)
        elif overrides:
            raise ValueError(f"sokoban: pass either a SokobanConfig or keyword options, not both ({sorted(overrides)})")
        self.config = config
        self.symbols = SYMBOL_SETS[config.symbols]
        self._fixed = Room.from_text(config.room, self.symbols) if config.room is not None else None
        h, w = (self._fixed.height, self._fixed.width) if self._fixed else config.dim_room
        self.observation_space = text_space(h * (w + 1), self.symbols.chars())
        self.action_space = action_space(ACTIONS)
        self._room: Room = self._fixed or Room(h, w, frozenset(), frozenset(), frozenset(), 0)
        self._boxes: set[int] = set(self._room.boxes)
        self._player = self._room.player
        self._actions = 0

    @property
    def action_names(self) -> tuple[str, ...]:
        return ACTIONS

    @property
    def legend(self) -> Mapping[str, str]:
        return self.symbols.legend()

    @property
    def room(self) -> Room:
        """The current state as an immutable ``Room``."""
        r = self._room
        return Room(r.height, r.width, r.walls, r.targets, frozenset(self._boxes), self._player)

    def solve(self, max_states: int = 1_000_000) -> list[str] | None:
        """Shortest plan from the current state (see ``solve``)."""
        return solve(self.room, max_states=max_states)

    def render(self) -> str:
        return self.room.to_text(self.symbols)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        cfg = self.config
        if self._fixed is None:
            self._room = generate_room(
                self.np_random,
                cfg.dim_room,
                cfg.num_boxes,
                reverse_steps=cfg.reverse_steps,
                walks=cfg.reverse_walks,
                tries=cfg.generation_tries,
            )
        self._boxes = set(self._room.boxes)
        self._player = self._room.player
        self._actions = 0
        return self.render(), {"success": False}

    def _solved(self) -> bool:
        return self._boxes == self._room.targets

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        solved = self._solved()
        truncated = not solved and self._actions >= self.config.max_actions_per_episode
        name = canonical_action(action, ACTIONS) if isinstance(action, str) else None
        if name is None or solved or truncated:
            return (
                self.render(),
                0.0,
                solved,
                truncated,
                step_info(valid=name is not None, effective=False, success=solved),
            )
        cfg, walls, targets = self.config, self._room.walls, self._room.targets
        d = (-self._room.width, self._room.width, -1, 1)[ACTIONS.index(name)]
        reward = cfg.step_reward
        nxt = self._player + d
        effective = False
        if nxt not in walls:
            if nxt in self._boxes:
                beyond = nxt + d
                if beyond not in walls and beyond not in self._boxes:
                    self._boxes.remove(nxt)
                    self._boxes.add(beyond)
                    self._player, effective = nxt, True
                    reward += cfg.box_on_target_reward * (beyond in targets) + cfg.box_off_target_reward * (
                        nxt in targets
                    )
            else:
                self._player, effective = nxt, True
        self._actions += 1
        solved = self._solved()
        if solved:
            reward += cfg.solved_reward
        truncated = not solved and self._actions >= cfg.max_actions_per_episode
        return (
            self.render(),
            float(reward),
            solved,
            truncated,
            step_info(valid=True, effective=effective, success=solved),
        )

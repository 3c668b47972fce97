"""The warm start: a short supervised stage that teaches a from-scratch model the answer FORMAT.

A tiny model built from a config cannot know ``<think>..</think><answer>..</answer>``; without a
warm start RL would spend its budget discovering the tags. The warm start must teach the format,
not the answer:

* Bandit demonstrations pick an arm UNIFORMLY AT RANDOM (the reasoning text names no arm), so the
  warm-started policy is arm-neutral; ``warm_start`` measures and returns its choice rate of the
  higher-EV arm (it should be near 0.5), so the Bandit learning a run shows is RL's.
* FrozenLake / Sokoban demonstrations follow the solvers, with a fraction of actions replaced by
  random ones, so the warm-started policy is a noisy solver and RL has to improve on it
  (``warm_start.demo_noise``). Sokoban: the BFS solver's shortest plan from the current room, cut
  to the turn's action limit. FrozenLake: the slip-aware turn planner (``frozen_lake.turn_planner``:
  the best actions for this turn given the turns and actions left, under the game's own slip law);
  a slip-blind shortest path would teach a policy barely above random on slippery ice.
  ``warm_start.demo_actions_per_turn`` lets the demonstrator play fewer actions a turn than the
  agent may (``demonstrator_agent``): on the lake a plan of at most 2 blind actions plays nearly as
  well and is easier to imitate from a local reading of the board (``bench/lake_features.py``).
  On a FrozenLake with a ``position_hint``, the demonstrator's reasoning restates the hint: a small
  model learns to copy it far sooner than to act on it directly (measured: first-action accuracy
  0.83 after 400 steps when the hint is restated, 0.29 when the reasoning is a fixed sentence).

Demonstrations are played through the real multi-turn loop (``run_rollouts``) by a demonstrator
engine, so their token layout (prompt, response, observation glue) is exactly what RL trains on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ragen_tasks.config import AgentConfig, LrSchedule, TrainConfig, scheduled_lr
from ragen_tasks.data.token_batch import collate, length_bucketed_batches
from ragen_tasks.data.trajectory import TOKEN_FIELDS, TURN_FIELDS, Trajectory
from ragen_tasks.envs import make
from ragen_tasks.envs._common import DIAGONALS, direction_words
from ragen_tasks.envs.base import TextGame
from ragen_tasks.envs.frozen_lake import ACTIONS, TurnPlanner, position_hint
from ragen_tasks.envs.sokoban import ACTION_DELTAS as SOKOBAN_DELTAS
from ragen_tasks.envs.sokoban import ACTIONS as SOKOBAN_ACTIONS
from ragen_tasks.envs.sokoban import Room
from ragen_tasks.rollout.engine import Generation, GenerationRequest, SamplingParams
from ragen_tasks.rollout.hf_engine import HFEngine
from ragen_tasks.rollout.loop import RolloutTask, make_eval_tasks, make_group_tasks, run_rollouts
from ragen_tasks.training.critic import token_logprobs

log = logging.getLogger(__name__)

#: Bump when what a warm start produces changes for the same config (demonstrators, reasoning, the
#: prompts the agent sees, the supervised loop): cached warm starts (``pipeline.warm_start_key``)
#: are keyed by it, and a stale cache would silently train on the old text.
WARM_START_VERSION = "4"

_REASON = {
    "bandit": "I will try one of the arms.",
    "frozen_lake": "I move toward the goal and stay off the holes.",
    "sokoban": "I push the box toward the target.",
}


def demo_reasoning(env: TextGame, style: str = "relative", *, turns_left: int | None = None) -> str:
    """The demonstration's think text: what the demonstrator reads off the board, not its choice.

    ``style`` is ``WarmStartConfig.reasoning``. ``"relative"``: Sokoban says where the nearest box
    not on a target lies from the player and where the nearest free target lies from that box;
    FrozenLake says where the goal lies (a small model learns to act on these directions far sooner
    than on the grid alone). ``"neighbours"``: the relative text, then what lies one step from the
    player on each side (the features a slip-aware lake policy turns on: where the holes and the
    edges are). ``"neighbours-diagonals"``: the neighbours text, then what lies one step away
    diagonally (``Up Left hole. Up Right frozen. Down Left wall. Down Right frozen.``: where a slip
    after a first move can land). A ``-turns`` suffix (``"neighbours-turns"``,
    ``"neighbours-diagonals-turns"``) then restates ``Turns left: N.`` from the prompt
    (``turns_left``, required: on slippery ice the best turn depends on how many are left).
    A ``rows-`` prefix (``"rows-neighbours-diagonals-turns"``) copies the board's rows above and
    below the player after the relative text (``Above: _O__. Below: wall.``), so that the
    cells above and below are then read from a row a few tokens back instead of found on the board.
    A ``cells-`` prefix copies the same rows cell by cell (``Above: _ O _ _. Below: wall.``): with one
    token per lake row, the copy then spells each row token out, and the cell above the player sits
    at a fixed distance back from the sentence that names it.
    A FrozenLake with a ``position_hint`` restates the hint, whatever the style.
    ``"fixed"``: one sentence per game. Bandit reasoning is always the fixed, arm-neutral sentence.
    """
    if style.endswith("-turns") and env.name != "bandit":
        if turns_left is None:
            raise ValueError(f"demo_reasoning(style={style!r}) needs turns_left: the turns left in the episode")
        return f"{demo_reasoning(env, style.removesuffix('-turns'))} Turns left: {turns_left}."
    copy_rows = style.startswith(("rows-", "cells-"))
    by_cell = style.startswith("cells-")
    style = style.removeprefix("rows-").removeprefix("cells-")
    if style not in ("relative", "neighbours", "neighbours-diagonals"):
        return _REASON.get(env.name, "I act.")
    parts: list[str] = []
    if env.name == "frozen_lake":
        lake: Any = env
        if lake.config.position_hint != "none":
            return position_hint(lake.position, lake.goal, lake.config.position_hint)
        parts.append(position_hint(lake.position, lake.goal, "directions").replace("from you.", "from me."))
        if copy_rows:
            parts.append(_rows_around(lake.render().split("\n")[: len(lake.desc)], lake.position[0], by_cell=by_cell))
        if style != "relative":
            parts.append(_named_tiles(ACTIONS, lake.neighbours))
        if style == "neighbours-diagonals":
            parts.append(_named_tiles([name for name, _ in DIAGONALS], lake.diagonals))
    elif env.name == "sokoban":
        room = getattr(env, "room")  # noqa: B009 (SokobanEnv.room; TextGame does not declare it)
        parts.append(_sokoban_relative(room))
        if copy_rows:
            parts.append(_rows_around(env.render().split("\n"), room.player // room.width, by_cell=by_cell))
        if style != "relative":
            parts.append(_sokoban_cells(room, tuple(zip(SOKOBAN_ACTIONS, SOKOBAN_DELTAS, strict=True))))
        if style == "neighbours-diagonals":
            parts.append(_sokoban_cells(room, DIAGONALS))
    else:
        return _REASON.get(env.name, "I act.")
    return " ".join(parts)


def _rows_around(rows: Sequence[str], player_row: int, *, by_cell: bool = False) -> str:
    """``Above: _O__. Below: wall.``: the board's rows (``rows``, as rendered) above and below row
    ``player_row``, ``wall`` past the board's edge; ``by_cell`` puts a space between a row's cells
    (``Above: _ O _ _.``)."""

    def row(index: int) -> str:
        if not 0 <= index < len(rows):
            return "wall"
        return " ".join(rows[index]) if by_cell else rows[index]

    return f"Above: {row(player_row - 1)}. Below: {row(player_row + 1)}."


def _named_tiles(names: Sequence[str], tiles: Sequence[str]) -> str:
    """``Left hole. Down frozen. Right wall. Up goal.``: each direction's name, then what lies there."""
    return " ".join(f"{name} {tile}." for name, tile in zip(names, tiles, strict=True))


def _sokoban_cells(room: Room, directions: Sequence[tuple[str, tuple[int, int]]]) -> str:
    """What lies one step from the player in each of ``directions`` ((name, (row, col) step) pairs):
    ``Up wall. Down box. ...`` (a box on a target is a box; the room's outer wall keeps every step,
    diagonal ones too, inside it)."""
    row, col = divmod(room.player, room.width)
    kinds = ((room.walls, "wall"), (room.boxes, "box"), (room.targets, "target"))  # first match names the cell
    words = []
    for d_row, d_col in (delta for _, delta in directions):
        cell = (row + d_row) * room.width + col + d_col
        words.append(next((word for cells, word in kinds if cell in cells), "floor"))
    return _named_tiles([name for name, _ in directions], words)


def _sokoban_relative(room: Room) -> str:
    width = room.width

    def cell(i: int) -> tuple[int, int]:
        return divmod(i, width)

    def distance(a: int, b: int) -> int:
        return abs(a // width - b // width) + abs(a % width - b % width)

    loose = sorted(room.boxes - room.targets, key=lambda b: (distance(room.player, b), b))
    if not loose:
        return "Every box is on a target."
    box = loose[0]
    free = sorted(room.targets - room.boxes, key=lambda t: (distance(box, t), t))
    return (
        f"The box is {direction_words(cell(room.player), cell(box)) or 'here'} from me. "
        f"The target is {direction_words(cell(box), cell(free[0]))} from the box."
    )


def demo_actions(
    env: TextGame,
    rng: np.random.Generator,
    agent: AgentConfig,
    *,
    turns_left: int,
    noise: float,
    planner: TurnPlanner | None = None,
) -> list[str]:
    """The demonstrator's actions for the env's current state and this turn of the episode.

    ``planner``: FrozenLake's ``lake_planner(env, agent)`` for this episode's map (made here if None)."""
    names = list(env.action_names)
    if env.name == "bandit":
        return [names[int(rng.integers(len(names)))]]  # arm-neutral by construction
    plan: Sequence[str] | None = None
    if env.name == "frozen_lake":
        lake: Any = env
        planner = planner or lake_planner(lake, agent)
        plan = planner.best(lake.cell, turns_left, lake.actions_left)
    elif hasattr(env, "solve"):
        plan = env.solve()
    plan = list(plan or [])[: agent.max_actions_per_turn] or [names[int(rng.integers(len(names)))]]
    return [names[int(rng.integers(len(names)))] if rng.random() < noise else a for a in plan]


def demonstrator_agent(config: TrainConfig) -> AgentConfig:
    """The agent rules the demonstrator plays by: the run's, with at most
    ``warm_start.demo_actions_per_turn`` actions per turn where that is set."""
    limit = config.warm_start.demo_actions_per_turn
    return config.agent if limit is None else config.agent.model_copy(update={"max_actions_per_turn": limit})


def lake_planner(lake: Any, agent: AgentConfig) -> TurnPlanner:
    """The slip-aware planner of a FrozenLake env's current map under the agent's turn rules."""
    return lake.planner(  # type: ignore[no-any-return]
        turns=agent.max_turns, actions=agent.max_actions_per_episode, max_actions_per_turn=agent.max_actions_per_turn
    )


class DemonstratorEngine:
    """An Engine whose replies are demonstrations computed from the live env of each session.

    ``env_factory`` must be passed to ``run_rollouts`` with the same ``tasks``: the loop creates
    one env per task, in task order, which binds each session id to its env.
    """

    def __init__(
        self,
        tokenizer: Any,
        tasks: Sequence[RolloutTask],
        agent: AgentConfig,
        *,
        seed: int,
        noise: float,
        reasoning: str = "relative",
    ) -> None:
        self.tokenizer = tokenizer
        self.agent = agent
        self.noise = noise
        self.reasoning = reasoning
        self.rng = np.random.default_rng(seed)
        self._pending = [t.traj_id for t in tasks]
        self._envs: dict[str, TextGame] = {}
        self._turns: dict[str, int] = {}  # session -> turns already answered
        # session -> its FrozenLake map's planner: made once per episode (a whole batch of maps at once
        # would thrash any small shared cache)
        self._planners: dict[str, TurnPlanner] = {}
        self._warned_cut = False  # a demonstration longer than a turn's tokens was reported

    def env_factory(self, name: str, config: Mapping[str, Any]) -> TextGame:
        env = make(name, **dict(config))
        self._envs[self._pending[len(self._envs)]] = env
        return env

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        out = []
        for request in requests:
            env = self._envs[request.session_id]
            turn = self._turns.get(request.session_id, 0)
            self._turns[request.session_id] = turn + 1
            planner = None
            if env.name == "frozen_lake":
                if request.session_id not in self._planners:
                    self._planners[request.session_id] = lake_planner(env, self.agent)
                planner = self._planners[request.session_id]
            turns_left = self.agent.max_turns - turn
            actions = demo_actions(env, self.rng, self.agent, turns_left=turns_left, noise=self.noise, planner=planner)
            answer = f"<answer>{' || '.join(actions)}</answer>"
            reasoning = demo_reasoning(env, self.reasoning, turns_left=turns_left)
            text = f"<think>{reasoning}</think>{answer}" if self.agent.think else answer
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(ids) > params.max_new_tokens and not self._warned_cut:
                # cut to the turn's limit, the reply teaches an answer that never closes
                log.warning(
                    "warm start: a %s demonstration takes %d tokens (%r) but agent.max_tokens_per_turn=%d: "
                    "demonstrations are cut to it; raise agent.max_tokens_per_turn to at least %d or choose "
                    "shorter warm_start.reasoning",
                    env.name,
                    len(ids),
                    text,
                    params.max_new_tokens,
                    len(ids) + 8,
                )
                self._warned_cut = True
            ids = ids[: params.max_new_tokens]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", text=text))
        return out

    def release(self, session_ids: Sequence[str]) -> None:
        for sid in session_ids:
            self._envs.pop(sid, None)
            self._turns.pop(sid, None)
            self._planners.pop(sid, None)


#: The seed streams of demonstrations (``make_group_tasks``' iteration): the warm start's, and RL's
#: supervised term's from ``RL_DEMO_STREAM + iteration``; RL's rollouts use iterations below both.
WARM_START_STREAM = 999_999
RL_DEMO_STREAM = 1_000_000


def demonstrations(
    tokenizer: Any, config: TrainConfig, *, seed: int, episodes: int | None = None, stream: int = WARM_START_STREAM
) -> list[Trajectory]:
    """Demonstration episodes on training seeds only: ``episodes`` of the env mixture (default
    ``warm_start.episodes_per_env`` per env), from the seed stream ``stream``."""
    groups = config.warm_start.episodes_per_env * len(config.envs) if episodes is None else episodes
    tasks = make_group_tasks(config.envs, groups, 1, seed, iteration=stream, seed_space=config.eval.seed_offset)
    ws = config.warm_start
    engine = DemonstratorEngine(
        tokenizer, tasks, demonstrator_agent(config), seed=seed, noise=ws.demo_noise, reasoning=ws.reasoning
    )
    sampling = SamplingParams(max_new_tokens=config.agent.max_tokens_per_turn)
    return run_rollouts(
        engine,
        tokenizer,
        tasks,
        agent=config.agent.model_copy(update={"loss_on_reasoning": True}),  # imitation is of the reasoning too
        sampling=sampling,
        policy_version=0,
        weights_fingerprint="demonstrations",
        env_factory=engine.env_factory,
    )


def rl_demonstrations(tokenizer: Any, config: TrainConfig, *, iteration: int, episodes: int) -> list[Trajectory]:
    """Fresh demonstration episodes for RL's supervised term (``algo.demo_loss_coef``) at ``iteration``:
    the warm start's demonstrator and reasoning, at ``algo.demo_noise`` (default: the warm start's
    noise), on seeds of their own stream, so RL imitates boards neither the warm start nor the
    rollouts saw. The same on every rank."""
    if config.algo.demo_noise is not None:
        warm = config.warm_start.model_copy(update={"demo_noise": config.algo.demo_noise})
        config = config.model_copy(update={"warm_start": warm})
    return demonstrations(tokenizer, config, seed=config.seed, episodes=episodes, stream=RL_DEMO_STREAM + iteration)


_TURN_INDEX_FIELDS = ("turn_starts", "turn_ends")  # turn fields that are token indices: a segment shifts them


def turn_segments(episodes: Sequence[Trajectory]) -> list[Trajectory]:
    """Each turn of ``episodes`` as a sequence of its own: the turn's observation and its response.

    Turn k's segment is the episode's tokens from the end of turn k - 1's response (the first
    turn: from the episode's start, the whole prompt) to the end of turn k's response, so it holds
    one board, the one the turn answers, and none of the earlier turns. Its loss mask is the
    episode's over those tokens: the turn's response. Its reward is the turn's; it succeeded if it
    is the last turn of an episode that did."""
    segments = []
    for episode in episodes:
        begins = [0, *episode.turn_ends[:-1]]  # where each turn's segment starts in the episode
        for turn, (begin, start, end) in enumerate(zip(begins, episode.turn_starts, episode.turn_ends, strict=True)):
            tokens: dict[str, Any] = {name: getattr(episode, name)[begin:end] for name in TOKEN_FIELDS}
            turns: dict[str, Any] = {
                name: [getattr(episode, name)[turn]] for name in TURN_FIELDS if name not in _TURN_INDEX_FIELDS
            }
            segments.append(
                dataclasses.replace(
                    episode,
                    **tokens,
                    **turns,
                    traj_id=f"{episode.traj_id}/turn{turn}",
                    turn_starts=[start - begin],
                    turn_ends=[end - begin],
                    prompt_length=start - begin,
                    reward=episode.turn_rewards[turn],
                    success=episode.success and turn == episode.num_turns - 1,
                )
            )
    return segments


def supervised_steps(
    model: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_id: int,
    lr_schedule: LrSchedule = "constant",
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Cross-entropy on the response tokens (loss_mask = 1) of ``trajectories``; returns the losses.
    ``lr_schedule``: the rate over the steps (``config.scheduled_lr``; ``linear`` decays to 0).

    Minibatches take every demonstration once per epoch, rows of similar length together
    (``length_bucketed_batches``), so little of a step's compute goes to padding."""
    batch = collate(list(trajectories), pad_id=pad_id)
    generator = torch.Generator().manual_seed(seed)
    minibatches = length_bucketed_batches(batch.lengths, batch_size, generator)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        rows = next(minibatches)  # (b,)
        mb = batch.select(rows)  # trimmed to the minibatch's longest row
        ids = mb.input_ids  # (b, T)
        attention = mb.attention_mask  # (b, T) 1 = real token
        targets = mb.loss_mask > 0  # (b, T) True = a demonstrated response token
        logp, _ = token_logprobs(model, ids, attention, positions=targets)  # (b, T)
        loss = -(logp * targets).sum() / targets.sum().clamp(min=1)  # mean negative log-likelihood of the targets
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(lr, step, steps, lr_schedule)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def bandit_choice_rate(
    model: torch.nn.Module, tokenizer: Any, config: TrainConfig, *, episodes: int = 64, temperature: float = 1.0
) -> float | None:
    """Fraction of held-out Bandit episodes in which the policy picks the higher-EV arm (None: no Bandit)."""
    specs = [s for s in config.envs if s.name == "bandit"]
    if not specs:
        return None
    tasks = make_eval_tasks(specs[:1], episodes, config.eval.seed_offset)
    sampling = SamplingParams(
        max_new_tokens=config.agent.max_tokens_per_turn,
        temperature=temperature,
        seed=config.warm_start.seed_for(config.seed),
    )
    trajectories = run_rollouts(
        HFEngine(model, tokenizer),
        tokenizer,
        tasks,
        agent=config.agent,
        sampling=sampling,
        policy_version=0,
        weights_fingerprint="warm-start",
    )
    return float(np.mean([t.success for t in trajectories]))


def warm_start(model: torch.nn.Module, tokenizer: Any, config: TrainConfig, *, progress: Any = None) -> dict[str, Any]:
    """Run the warm start on ``model`` in place; return what it did and measured (JSON-able)."""
    ws = config.warm_start
    seed = ws.seed_for(config.seed)
    demos = demonstrations(tokenizer, config, seed=seed)
    log.info(
        "warm start: %d demonstration episodes, %d supervised steps on their turns, then %d on the episodes",
        len(demos),
        ws.turn_steps,
        ws.steps,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses: list[float] = []
    # (trajectories, steps, the first step's index over the whole warm start): each phase its own AdamW
    phases = [(turn_segments(demos) if ws.turn_steps else [], ws.turn_steps, 0), (demos, ws.steps, ws.turn_steps)]
    for trajectories, steps, first_step in phases:
        if steps == 0:
            continue

        def on_step(step: int, loss: float, first_step: int = first_step) -> None:
            if progress is not None:
                progress(first_step + step, loss)

        losses += supervised_steps(
            model,
            trajectories,
            steps=steps,
            batch_size=ws.batch_size,
            lr=ws.lr,
            seed=seed + first_step,
            pad_id=pad_id,
            lr_schedule=ws.lr_schedule,
            on_step=on_step,
        )
    result: dict[str, Any] = {
        "episodes": len(demos),
        "steps": ws.steps,
        "turn_steps": ws.turn_steps,
        "first_loss": losses[0] if losses else math.nan,
        "final_loss": losses[-1] if losses else math.nan,
        "demo_noise": config.warm_start.demo_noise,
    }
    rate = bandit_choice_rate(model, tokenizer, config)
    if rate is not None:
        result["bandit_high_ev_choice_rate"] = rate  # arm-neutral warm start: should be near 0.5
        log.info("warm start: Bandit higher-EV arm choice rate %.3f (0.5 = arm-neutral)", rate)
    return result

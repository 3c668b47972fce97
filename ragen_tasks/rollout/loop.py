"""The batched multi-turn rollout loop: tasks in, token-in/token-out trajectories out.

Per turn: ONE ``engine.generate`` call for all live episodes; each reply is parsed, its actions run
in order until the game ends; finished episodes leave the batch and are ``release``d; the others
get the observation ids (chat-template glue + new board) appended. An episode ends when the game
terminates (status "terminated"), truncates at max actions (either the game's own limit or
``agent.max_actions_per_episode``: "max_actions"), after ``agent.max_turns`` turns ("max_turns"),
or when the next turn would not fit ``agent.max_context_tokens`` ("context"; it never crashes).

Decisions:
* The per-turn token cap is ``min(sampling.max_new_tokens, agent.max_tokens_per_turn)``.
* An initial prompt that leaves no room for one response is a configuration error (ValueError
  naming ``agent.max_context_tokens``); later turns end the episode with status "context".
* An engine that returns fewer/more generations than requests, or a malformed generation, raises
  ``EngineReplyError``: a dropped reply must fail loudly, never shift replies between episodes.
* If ``sampling.seed`` is set, turn ``t`` is generated with seed ``sampling.seed + t``.
* Invalid actions: see ``ragen_tasks.agent.parsing`` (the valid prefix runs, the turn is penalised).
* ``loss_mask`` = the sampled tokens; with ``agent.loss_on_reasoning=false`` less each turn's
  reasoning (``reasoning_token_count``), with ``agent.loss_on_observations`` plus the observations.

Also here: ``make_group_tasks`` (groups of rollouts sharing an initial state, seeds derived with
``numpy.random.SeedSequence`` from (seed, iteration, group), never ``hash()``; optionally only initial
states whose shortest solution is long enough: a curriculum over difficulty).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from ragen_tasks.agent.chat import ChatRenderer
from ragen_tasks.agent.parsing import map_actions, parse_response
from ragen_tasks.agent.prompts import followup_message, initial_messages
from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.data.trajectory import Trajectory, TrajectoryStatus
from ragen_tasks.envs.base import TextGame
from ragen_tasks.rollout.engine import Engine, Generation, GenerationRequest, SamplingParams

logger = logging.getLogger(__name__)


class EngineReplyError(RuntimeError):
    """The engine broke the Engine contract (wrong number of generations, malformed generation)."""


@dataclass(frozen=True)
class RolloutTask:
    """One episode to play. Tasks with the same ``group_id`` must share env_name, env_config and seed."""

    traj_id: str  # unique within the batch; also the engine session id
    env_name: str  # registry name for ragen_tasks.envs.make
    env_config: dict[str, Any]  # keyword arguments for ragen_tasks.envs.make
    seed: int  # env seed: fixes the initial state
    group_id: int  # rollouts sharing an initial state


@dataclass
class _Episode:
    """Mutable state of one live episode (internal)."""

    task: RolloutTask
    env: TextGame
    board: str
    ids: list[int]  # (T,) prompt + responses + observations so far
    response_mask: list[int]  # (T,) 1 = sampled by the policy
    logprobs: list[float]  # (T,) rollout log-prob where response_mask = 1, else 0
    prompt_length: int
    actions_used: int = 0
    success: bool = False
    status: str | None = None  # a TrajectoryStatus value once the episode is over
    turn_starts: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_actions: list[list[str]] = field(default_factory=list)
    turn_format_ok: list[bool] = field(default_factory=list)
    turn_think: list[str] = field(default_factory=list)
    turn_responses: list[str] = field(default_factory=list)
    turn_observations: list[str] = field(default_factory=list)
    # [start, end) token spans of the turns' reasoning left out of the loss (agent.loss_on_reasoning=false)
    untrained_reasoning: list[tuple[int, int]] = field(default_factory=list)


def _make_env(name: str, config: Mapping[str, Any]) -> TextGame:
    import importlib  # A's registry; imported late so this module loads before/without it

    make = importlib.import_module("ragen_tasks.envs").make
    env: TextGame = make(name, **dict(config))
    return env


def game_rules(game: TextGame) -> dict[str, Any]:
    """The game's config as a mapping (what the prompt may state about its rules); {} if it has none."""
    dump = getattr(getattr(game, "config", None), "model_dump", None)
    return dict(dump()) if callable(dump) else {}


def _strip_special(text: str, special: Sequence[str]) -> str:
    """Drop special-token text (e.g. a sampled ``<|im_end|>``) from the end of a decoded response."""
    stripped = text.rstrip()
    changed = True
    while changed:
        changed = False
        for token in special:
            if token and stripped.endswith(token):
                stripped = stripped[: -len(token)].rstrip()
                changed = True
    return stripped


def _check_generation(gen: Generation, request: GenerationRequest, cap: int) -> None:
    if len(gen.token_ids) != len(gen.logprobs):
        raise EngineReplyError(
            f"session {request.session_id}: {len(gen.token_ids)} token ids but {len(gen.logprobs)} log-probs"
        )
    if len(gen.token_ids) > cap:
        raise EngineReplyError(
            f"session {request.session_id}: {len(gen.token_ids)} tokens exceed the per-turn cap {cap}"
        )


def run_rollouts(
    engine: Engine,
    tokenizer: Any,
    tasks: Sequence[RolloutTask],
    *,
    agent: AgentConfig,
    sampling: SamplingParams,
    policy_version: int,
    weights_fingerprint: str,
    env_factory: Callable[[str, Mapping[str, Any]], TextGame] | None = None,
) -> list[Trajectory]:
    """Play every task to the end, batched; return one Trajectory per task, in task order.

    ``env_factory(name, config) -> TextGame`` defaults to ``ragen_tasks.envs.make``.
    """
    ids_seen = [t.traj_id for t in tasks]
    if len(set(ids_seen)) != len(ids_seen):
        raise ValueError("tasks: traj_id values must be unique within a batch (they are engine session ids)")
    cap = min(sampling.max_new_tokens, agent.max_tokens_per_turn)
    params = replace(sampling, max_new_tokens=cap)
    renderer = ChatRenderer(tokenizer)
    special = [str(s) for s in getattr(tokenizer, "all_special_tokens", [])]
    factory = env_factory or _make_env
    episodes = _start(tasks, factory, renderer, agent, cap)

    live = list(episodes)
    released: set[str] = set()
    try:
        for turn in range(agent.max_turns):
            if not live:
                break
            requests = [GenerationRequest(session_id=e.task.traj_id, prompt_ids=list(e.ids)) for e in live]
            turn_params = params if params.seed is None else replace(params, seed=params.seed + turn)
            generations = engine.generate(requests, turn_params)
            if len(generations) != len(requests):
                raise EngineReplyError(
                    f"engine {type(engine).__name__} returned {len(generations)} generations for "
                    f"{len(requests)} requests (turn {turn}); every request needs exactly one reply"
                )
            continuing: list[tuple[_Episode, Generation]] = []  # episodes that get another turn
            for episode, request, gen in zip(live, requests, generations, strict=True):
                _check_generation(gen, request, cap)
                text = gen.text or tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                _play_turn(episode, gen, _strip_special(text, special), agent)
                if not agent.loss_on_reasoning:
                    start = episode.turn_starts[-1]
                    episode.untrained_reasoning.append((start, start + reasoning_token_count(gen.token_ids, tokenizer)))
                if episode.status is None and turn + 1 >= agent.max_turns:
                    episode.status = TrajectoryStatus.MAX_TURNS.value
                if episode.status is None:
                    continuing.append((episode, gen))
            _feed_observations(continuing, renderer, agent, cap)
            finished = [e.task.traj_id for e in live if e.status is not None]
            if finished:
                engine.release(finished)
                released.update(finished)
            live = [e for e in live if e.status is None]
    finally:
        leftover = [e.task.traj_id for e in episodes if e.task.traj_id not in released]
        if leftover:  # only after an error: free the engine's caches, keep the original exception
            try:
                engine.release(leftover)
            except Exception:
                logger.exception("engine.release failed while cleaning up after an error")
    return [_finish(e, policy_version, weights_fingerprint, agent) for e in episodes]


def _start(
    tasks: Sequence[RolloutTask],
    factory: Callable[[str, Mapping[str, Any]], TextGame],
    renderer: ChatRenderer,
    agent: AgentConfig,
    cap: int,
) -> list[_Episode]:
    """Reset every task's game and render its first prompt (the prompts tokenised in one call)."""
    games = [factory(task.env_name, task.env_config) for task in tasks]
    boards = [game.reset(seed=task.seed)[0] for task, game in zip(tasks, games, strict=True)]
    conversations = [
        initial_messages(
            env_name=task.env_name,
            action_names=game.action_names,
            legend=game.legend,
            board=board,
            turns_left=agent.max_turns,
            actions_left=agent.max_actions_per_episode,
            max_actions_per_turn=agent.max_actions_per_turn,
            think=agent.think,
            rules=game_rules(game),
        )
        for task, game, board in zip(tasks, games, boards, strict=True)
    ]
    episodes = []
    for task, game, board, ids in zip(tasks, games, boards, renderer.prompt_ids_batch(conversations), strict=True):
        if len(ids) + cap > agent.max_context_tokens:
            raise ValueError(
                f"task {task.traj_id} ({task.env_name}): the first prompt has {len(ids)} tokens and a response "
                f"may take {cap}, more than agent.max_context_tokens={agent.max_context_tokens}; raise "
                "agent.max_context_tokens (within the model's context) or use a smaller board"
            )
        episodes.append(
            _Episode(
                task=task,
                env=game,
                board=board,
                ids=ids,
                response_mask=[0] * len(ids),
                logprobs=[0.0] * len(ids),
                prompt_length=len(ids),
            )
        )
    return episodes


def reasoning_token_count(token_ids: Sequence[int], tokenizer: Any) -> int:
    """How many leading tokens of a reply hold its reasoning: up to and including the token that
    completes ``</think>`` (a tag may span several tokens, so the decoded text is searched). 0 when
    the reply never closes its reasoning or nothing follows the tag: such a turn is trained whole,
    since its format is what must change."""

    def closed(k: int) -> bool:  # do the first k tokens hold "</think>"? (once true, true for every larger k)
        return "</think>" in tokenizer.decode(list(token_ids[:k]), skip_special_tokens=False)

    if not token_ids or not closed(len(token_ids)):
        return 0
    low, high = 1, len(token_ids)  # the smallest k with closed(k) lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if closed(middle):
            high = middle
        else:
            low = middle + 1
    return low if low < len(token_ids) else 0


def _play_turn(episode: _Episode, gen: Generation, text: str, agent: AgentConfig) -> None:
    """Append the sampled ids, parse, run the actions, record the turn. Sets status if it ended."""
    episode.turn_observations.append(episode.board)
    episode.turn_starts.append(len(episode.ids))
    episode.ids.extend(gen.token_ids)
    episode.response_mask.extend([1] * len(gen.token_ids))
    episode.logprobs.extend(float(lp) for lp in gen.logprobs)
    episode.turn_ends.append(len(episode.ids))
    episode.turn_responses.append(text)

    parsed = parse_response(text, think=agent.think)
    budget = min(agent.max_actions_per_turn, agent.max_actions_per_episode - episode.actions_used)
    actions, all_valid = map_actions(parsed.actions, episode.env.action_names, max_actions=budget)
    format_ok = parsed.ok and all_valid
    env_reward = 0.0
    executed: list[str] = []
    for action in actions:
        board, step_reward, terminated, truncated, info = episode.env.step(action)
        episode.board = board
        if not info.get("action_is_valid", True):  # the game refused a name it listed: still invalid
            format_ok = False
            break
        executed.append(action)
        episode.actions_used += 1
        env_reward += float(step_reward)
        episode.success = bool(info.get("success", False))
        if terminated:
            episode.status = TrajectoryStatus.TERMINATED.value
            break
        if truncated:
            episode.status = TrajectoryStatus.MAX_ACTIONS.value
            break
    reward = env_reward + (0.0 if format_ok else agent.format_penalty)
    if episode.status is None and episode.actions_used >= agent.max_actions_per_episode:
        episode.status = TrajectoryStatus.MAX_ACTIONS.value
    episode.turn_rewards.append(reward)
    episode.turn_actions.append(executed)
    episode.turn_format_ok.append(format_ok)
    episode.turn_think.append(parsed.think)


def _feed_observations(
    continuing: Sequence[tuple[_Episode, Generation]], renderer: ChatRenderer, agent: AgentConfig, cap: int
) -> None:
    """Append each episode's next user message ids (mask 0), tokenised in one call; an episode whose
    next turn would not fit in the context ends with status 'context' instead."""
    messages = [
        followup_message(
            board=episode.board,
            reward=episode.turn_rewards[-1],
            turns_left=agent.max_turns - len(episode.turn_rewards),
            actions_left=agent.max_actions_per_episode - episode.actions_used,
            format_ok=episode.turn_format_ok[-1],
        )
        for episode, _ in continuing
    ]
    all_obs_ids = renderer.observation_ids_batch(messages, [gen.token_ids for _, gen in continuing])
    for (episode, _), obs_ids in zip(continuing, all_obs_ids, strict=True):
        if len(episode.ids) + len(obs_ids) + cap > agent.max_context_tokens:
            episode.status = TrajectoryStatus.CONTEXT.value
            continue
        episode.ids.extend(obs_ids)
        episode.response_mask.extend([0] * len(obs_ids))
        episode.logprobs.extend([0.0] * len(obs_ids))


def _finish(episode: _Episode, policy_version: int, weights_fingerprint: str, agent: AgentConfig) -> Trajectory:
    if episode.status is None:  # only reachable if max_turns was never hit: defensive
        raise RuntimeError(f"episode {episode.task.traj_id} ended without a status")
    # loss_mask: 1 = trained on. Sampled tokens always, except the reasoning if left out; observation
    # tokens (never the prompt) if asked.
    if agent.loss_on_observations:
        loss_mask = [0] * episode.prompt_length + [1] * (len(episode.ids) - episode.prompt_length)
    else:
        loss_mask = list(episode.response_mask)
    for start, end in episode.untrained_reasoning:
        loss_mask[start:end] = [0] * (end - start)
    trajectory = Trajectory(
        traj_id=episode.task.traj_id,
        env_name=episode.task.env_name,
        seed=episode.task.seed,
        group_id=episode.task.group_id,
        policy_version=policy_version,
        weights_fingerprint=weights_fingerprint,
        input_ids=episode.ids,
        response_mask=episode.response_mask,
        loss_mask=loss_mask,
        rollout_logprobs=episode.logprobs,
        turn_starts=episode.turn_starts,
        turn_ends=episode.turn_ends,
        turn_rewards=episode.turn_rewards,
        turn_actions=episode.turn_actions,
        turn_format_ok=episode.turn_format_ok,
        turn_think=episode.turn_think,
        turn_responses=episode.turn_responses,
        turn_observations=episode.turn_observations,
        reward=float(sum(episode.turn_rewards)),
        success=episode.success,
        status=episode.status,
        prompt_length=episode.prompt_length,
    )
    trajectory.check()
    return trajectory


def make_group_tasks(
    env_specs: Sequence[EnvSpec],
    groups: int,
    group_size: int,
    seed: int,
    iteration: int,
    *,
    seed_offset: int = 0,
    seed_space: int = 1_000_000,
    min_plan_length: int = 0,
    long_plan_share: float = 1.0,
) -> list[RolloutTask]:
    """``groups`` initial states x ``group_size`` rollouts each; rollouts of a group share the env seed.

    Envs are mixed by weight with a largest-remainder split of the groups (deterministic, exact
    proportions up to rounding). The env seed of group ``g`` is
    ``seed_offset + SeedSequence([seed, iteration, g]) % seed_space``: training uses
    ``seed_offset=0`` and ``seed_space <= eval.seed_offset`` so held-out evaluation seeds (from
    ``eval.seed_offset`` up) never appear in training.

    ``min_plan_length > 0`` (``rollout.min_plan_length``) keeps the groups to initial states whose
    shortest solution (the game's ``solve()``) takes at least that many actions: group ``g`` takes
    the first of its candidate seeds (draw 0 the seed above, draw ``k`` from
    ``SeedSequence([seed, iteration, g, k])``) that qualifies. States that cannot be solved within
    the game's ``max_actions_per_episode`` never qualify: no rollout of theirs can succeed.
    ``long_plan_share`` (``rollout.long_plan_share``) applies that to the first
    ``round(long_plan_share * groups)`` groups only; the others keep draw 0, the game's own mix.
    """
    if groups < 1 or group_size < 1:
        raise ValueError(f"groups={groups} and group_size={group_size} must both be >= 1")
    if not env_specs:
        raise ValueError("env_specs: give at least one EnvSpec")
    if not 0 < long_plan_share <= 1:
        raise ValueError(f"long_plan_share={long_plan_share} must be in (0, 1]")
    if seed < 0 or iteration < 0 or seed_offset < 0 or seed_space < 1 or min_plan_length < 0:
        raise ValueError(
            f"seed={seed}, iteration={iteration}, seed_offset={seed_offset}, min_plan_length={min_plan_length} "
            f"must be >= 0 and seed_space={seed_space} >= 1"
        )
    weights = np.array([spec.weight for spec in env_specs], dtype=np.float64)
    shares = weights / weights.sum() * groups
    counts = np.floor(shares).astype(int)
    for i in np.argsort(-(shares - counts), kind="stable")[: groups - int(counts.sum())]:
        counts[i] += 1
    spec_of_group = [i for i, n in enumerate(counts) for _ in range(int(n))]  # (groups,) index into env_specs

    tasks: list[RolloutTask] = []
    long_groups = round(long_plan_share * groups) if min_plan_length else 0
    # one env per game to search the curriculum's seeds with, made only when a group needs it
    solver_envs: dict[int, TextGame] = {}

    def candidate(g: int, draw: int) -> int:
        entropy = [seed, iteration, g] if draw == 0 else [seed, iteration, g, draw]
        state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint64)
        return seed_offset + int(state[0] % np.uint64(seed_space))

    for g, spec_index in enumerate(spec_of_group):
        spec = env_specs[spec_index]
        if g < long_groups:
            if spec_index not in solver_envs:
                solver_envs[spec_index] = _make_env(spec.name, spec.config)
            env_seed = _seed_with_long_plan(solver_envs[spec_index], partial(candidate, g), min_plan_length)
        else:
            env_seed = candidate(g, 0)
        for r in range(group_size):
            tasks.append(
                RolloutTask(
                    traj_id=f"it{iteration:06d}-g{g:04d}-r{r:03d}",
                    env_name=spec.name,
                    env_config=dict(spec.config),
                    seed=env_seed,
                    group_id=g,
                )
            )
    return tasks


#: Candidate seeds a group draws before ``rollout.min_plan_length`` is called unreachable.
CURRICULUM_DRAWS = 1000


def _seed_with_long_plan(env: TextGame, candidate: Callable[[int], int], min_plan_length: int) -> int:
    """The first ``candidate(draw)`` seed whose initial state in ``env`` has a shortest solution of at
    least ``min_plan_length`` actions that fits the episode's action budget; ValueError if the game
    has no solver or none of ``CURRICULUM_DRAWS`` qualifies."""
    budget = env.config.max_actions_per_episode
    solve = getattr(env, "solve", None)
    if not callable(solve):
        raise ValueError(
            f"rollout.min_plan_length={min_plan_length} needs a game with a solver (sokoban); "
            f"{env.name} has none: set rollout.min_plan_length to 0"
        )
    for draw in range(CURRICULUM_DRAWS):
        env_seed = candidate(draw)
        env.reset(seed=env_seed)
        plan = solve()
        if plan is not None and min_plan_length <= len(plan) <= budget:
            return env_seed
    raise ValueError(
        f"rollout.min_plan_length={min_plan_length}: none of {CURRICULUM_DRAWS} initial states of {env.name} "
        f"drawn needs that many actions and can be solved within max_actions_per_episode={budget}; lower it"
    )


def make_eval_tasks(env_specs: Sequence[EnvSpec], num_seeds: int, seed_offset: int) -> list[RolloutTask]:
    """Held-out evaluation: seeds ``seed_offset .. seed_offset + num_seeds - 1`` per env, one rollout each."""
    if num_seeds < 1:
        raise ValueError(f"num_seeds={num_seeds} must be >= 1")
    tasks: list[RolloutTask] = []
    for e, spec in enumerate(env_specs):
        for i in range(num_seeds):
            tasks.append(
                RolloutTask(
                    traj_id=f"eval-{spec.name}-{e}-{i:06d}",
                    env_name=spec.name,
                    env_config=dict(spec.config),
                    seed=seed_offset + i,
                    group_id=e * num_seeds + i,
                )
            )
    return tasks

"""The game's optimal value of the state before each turn of a played episode, and the per-turn
advantages of ``algo.advantage=turn_td`` and ``turn_q`` built on it.

On slippery ice most of an episode's outcome is luck: a trajectory's reward says little about its
turns. The slip-aware planner knows each state's exact value under the agent's rules (the best
probability of reaching the goal with the turns and actions left, ``TurnPlanner.value``), so a turn
can be credited with what it changed: its reward plus the value of the state it led to, less the
value of the state it was played in (``turn_td``: ``algos.advantages.turn_td_advantages``), or,
with the slips averaged out, with the exact advantage ``Q*(s, a) - V*(s)`` of the actions it named
(``turn_q``: no luck left in the signal at all). Only FrozenLake has such a value
(``GAMES_WITH_VALUES``).

An episode's states are rebuilt by replaying it: the game reset from the trajectory's seed, then
its executed actions in order. The game's randomness (the map, every slip) comes from that seed
alone, so the replay passes through the states the episode did; each board is checked against the
one the trajectory recorded, and a mismatch is an error, never a silent wrong value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ragen_tasks.agent.parsing import map_actions, parse_response
from ragen_tasks.algos.advantages import turn_td_advantages, whiten_turns
from ragen_tasks.config import AgentConfig, TrainConfig
from ragen_tasks.data.token_batch import TokenBatch, with_turn_advantages
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make
from ragen_tasks.envs.frozen_lake import TurnPlanner

#: The games whose states have an exact optimal value here.
GAMES_WITH_VALUES: tuple[str, ...] = ("frozen_lake",)


def _replay(trajectory: Trajectory, env_config: Mapping[str, Any], agent: AgentConfig) -> Iterator[_TurnState]:
    """The trajectory's turns replayed in a fresh game: before each turn, the game in the state the
    turn was played in and what the turn had left; after the last, the state it ended in."""
    if trajectory.env_name not in GAMES_WITH_VALUES:
        raise ValueError(
            f"trajectory {trajectory.traj_id}: {trajectory.env_name!r} has no optimal state value; "
            f"algo.advantage='turn_td' / 'turn_q' need games in {GAMES_WITH_VALUES}"
        )
    lake: Any = make(trajectory.env_name, **dict(env_config))
    board, _ = lake.reset(seed=trajectory.seed)
    planner = lake.planner(
        turns=agent.max_turns, actions=agent.max_actions_per_episode, max_actions_per_turn=agent.max_actions_per_turn
    )
    actions_used = 0
    for turn, actions in enumerate(trajectory.turn_actions):
        if board != trajectory.turn_observations[turn]:
            raise ValueError(
                f"trajectory {trajectory.traj_id}: replaying seed {trajectory.seed} with its actions does not "
                f"reach the board it recorded before turn {turn}: it was not played with this game config "
                f"({dict(env_config)}), or the game was not driven by its seed alone"
            )
        yield _TurnState(lake, planner, agent.max_turns - turn, agent.max_actions_per_episode - actions_used)
        for action in actions:
            board, *_ = lake.step(action)
        actions_used += len(actions)
    turns_left = agent.max_turns - len(trajectory.turn_actions)
    yield _TurnState(lake, planner, turns_left, agent.max_actions_per_episode - actions_used)


@dataclass(frozen=True)
class _TurnState:
    lake: Any  # FrozenLakeEnv in the state (live: the replay moves it on)
    planner: TurnPlanner  # the map's planner under the agent's rules
    turns_left: int
    actions_left: int

    @property
    def value(self) -> float:
        """The optimal success probability from here; 0 once the episode is over."""
        row, col = self.lake.position
        if self.lake.desc[row][col] in "GH" or self.turns_left <= 0 or self.actions_left <= 0:
            return 0.0
        return float(self.planner.value[self.turns_left, self.actions_left, self.lake.cell])


def optimal_turn_values(trajectory: Trajectory, env_config: Mapping[str, Any], agent: AgentConfig) -> list[float]:
    """K + 1 values for a trajectory of K turns: the optimal success probability of the state each
    turn was played in (with that turn's turns and actions left, under ``agent``'s rules), then that
    of the state after the last turn (0 once the episode is over: in a hole, on the goal, or out of
    turns or actions). ``env_config`` is the game's config the trajectory was played with."""
    return [state.value for state in _replay(trajectory, env_config, agent)]


def optimal_turn_advantages(trajectory: Trajectory, env_config: Mapping[str, Any], agent: AgentConfig) -> list[float]:
    """K exact advantages: for each turn, ``Q*(s, a) - V*(s)`` of the actions it named (``a``: as the
    rollout parsed its response, the actions after an early end included) in the state it was played
    in, the slips averaged out under the game's law, plus the turn's format penalty. ``Q*`` is the
    success probability of playing ``a`` blind and then the best play; 0 for the planner's own turn."""
    advantages = []
    for turn, state in zip(range(trajectory.num_turns), _replay(trajectory, env_config, agent), strict=False):
        parsed = parse_response(trajectory.turn_responses[turn], think=agent.think)
        budget = min(agent.max_actions_per_turn, state.actions_left)
        named, _ = map_actions(parsed.actions, state.lake.action_names, max_actions=budget)
        executed = trajectory.turn_actions[turn]
        if named[: len(executed)] != executed:
            raise ValueError(
                f"trajectory {trajectory.traj_id}: turn {turn} ran {executed} but its response names {named}"
            )
        ends = state.lake.turn_outcome(named)  # (cells,) where the turn ends
        after = state.planner.value[state.turns_left - 1, state.actions_left - len(named)]  # (cells,)
        penalty = 0.0 if trajectory.turn_format_ok[turn] else agent.format_penalty
        advantages.append(float(ends @ after) - state.value + penalty)
    return advantages


def turn_advantages_batch(batch: TokenBatch, trajectories: Sequence[Trajectory], config: TrainConfig) -> TokenBatch:
    """``batch`` (collated from ``trajectories``, in the same row order) with each turn's advantage on
    the tokens sampled in that turn, whitened over the batch's turns: ``algo.advantage='turn_td'``,
    the TD(``algo.lam``) errors against the optimal values; ``'turn_q'``, the exact advantages."""
    if len(trajectories) != batch.batch_size:
        raise ValueError(f"{len(trajectories)} trajectories for a batch of {batch.batch_size} rows")
    env_configs = {spec.name: spec.config for spec in config.envs}
    k = max(trajectory.num_turns for trajectory in trajectories)
    rewards = torch.zeros(len(trajectories), k)  # (B, K) each turn's reward, 0 on padding turns
    values = torch.zeros(len(trajectories), k + 1)  # (B, K + 1) V before each turn, then after the last
    exact = torch.zeros(len(trajectories), k)  # (B, K) Q* - V* of each turn (turn_q)
    valid = torch.zeros(len(trajectories), k, dtype=torch.bool)  # (B, K) 1 = a real turn
    spans = torch.zeros(len(trajectories), k, 2, dtype=torch.int64)  # (B, K, 2) [start, end) of its tokens
    for row, trajectory in enumerate(trajectories):
        n = trajectory.num_turns
        env_config = env_configs[trajectory.env_name]
        if config.algo.advantage == "turn_q":
            exact[row, :n] = torch.tensor(optimal_turn_advantages(trajectory, env_config, config.agent))
        else:
            values[row, : n + 1] = torch.tensor(optimal_turn_values(trajectory, env_config, config.agent))
        rewards[row, :n] = torch.tensor(trajectory.turn_rewards)
        valid[row, :n] = True
        spans[row, :n, 0] = torch.tensor(trajectory.turn_starts)
        spans[row, :n, 1] = torch.tensor(trajectory.turn_ends)
    if config.algo.advantage == "turn_q":
        advantages = whiten_turns(exact, valid)
    else:
        advantages = turn_td_advantages(rewards, values, valid, lam=config.algo.lam)  # (B, K)
    return with_turn_advantages(batch, advantages, spans)

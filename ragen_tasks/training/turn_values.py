"""The game's optimal value of the state before each turn of a played episode, and the per-turn
advantages of ``algo.advantage=turn_td`` built on it.

On slippery ice most of an episode's outcome is luck: a trajectory's reward says little about its
turns. The slip-aware planner knows each state's exact value under the agent's rules (the best
probability of reaching the goal with the turns and actions left, ``TurnPlanner.value``), so a turn
can be credited with what it changed: its reward plus the value of the state it led to, less the
value of the state it was played in (``algos.advantages.turn_td_advantages``). Only FrozenLake has
such a value (``GAMES_WITH_VALUES``).

An episode's states are rebuilt by replaying it: the game reset from the trajectory's seed, then
its executed actions in order. The game's randomness (the map, every slip) comes from that seed
alone, so the replay passes through the states the episode did; each board is checked against the
one the trajectory recorded, and a mismatch is an error, never a silent wrong value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ragen_tasks.algos.advantages import turn_td_advantages
from ragen_tasks.config import AgentConfig, TrainConfig
from ragen_tasks.data.token_batch import TokenBatch, with_turn_advantages
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make

#: The games whose states have an exact optimal value here.
GAMES_WITH_VALUES: tuple[str, ...] = ("frozen_lake",)


def optimal_turn_values(trajectory: Trajectory, env_config: Mapping[str, Any], agent: AgentConfig) -> list[float]:
    """K + 1 values for a trajectory of K turns: the optimal success probability of the state each
    turn was played in (with that turn's turns and actions left, under ``agent``'s rules), then that
    of the state after the last turn (0 once the episode is over: in a hole, on the goal, or out of
    turns or actions). ``env_config`` is the game's config the trajectory was played with."""
    if trajectory.env_name not in GAMES_WITH_VALUES:
        raise ValueError(
            f"trajectory {trajectory.traj_id}: {trajectory.env_name!r} has no optimal state value; "
            f"algo.advantage='turn_td' needs games in {GAMES_WITH_VALUES}"
        )
    lake: Any = make(trajectory.env_name, **dict(env_config))
    board, _ = lake.reset(seed=trajectory.seed)
    planner = lake.planner(
        turns=agent.max_turns, actions=agent.max_actions_per_episode, max_actions_per_turn=agent.max_actions_per_turn
    )
    width = len(lake.desc[0])

    def value(turns_left: int, actions_left: int) -> float:
        row, col = lake.position
        if lake.desc[row][col] in "GH" or turns_left <= 0 or actions_left <= 0:
            return 0.0
        return float(planner.value[turns_left, actions_left, row * width + col])

    values = []
    actions_used = 0
    for turn, actions in enumerate(trajectory.turn_actions):
        if board != trajectory.turn_observations[turn]:
            raise ValueError(
                f"trajectory {trajectory.traj_id}: replaying seed {trajectory.seed} with its actions does not "
                f"reach the board it recorded before turn {turn}: it was not played with this game config "
                f"({dict(env_config)}), or the game was not driven by its seed alone"
            )
        values.append(value(agent.max_turns - turn, agent.max_actions_per_episode - actions_used))
        for action in actions:
            board, *_ = lake.step(action)
        actions_used += len(actions)
    values.append(value(agent.max_turns - len(trajectory.turn_actions), agent.max_actions_per_episode - actions_used))
    return values


def turn_td_batch(batch: TokenBatch, trajectories: Sequence[Trajectory], config: TrainConfig) -> TokenBatch:
    """``batch`` (collated from ``trajectories``, in the same row order) with each turn's TD(lambda)
    advantage against the optimal values (``algo.lam``; whitened over the batch's turns) on the
    tokens sampled in that turn."""
    if len(trajectories) != batch.batch_size:
        raise ValueError(f"{len(trajectories)} trajectories for a batch of {batch.batch_size} rows")
    env_configs = {spec.name: spec.config for spec in config.envs}
    k = max(trajectory.num_turns for trajectory in trajectories)
    rewards = torch.zeros(len(trajectories), k)  # (B, K) each turn's reward, 0 on padding turns
    values = torch.zeros(len(trajectories), k + 1)  # (B, K + 1) V before each turn, then after the last
    valid = torch.zeros(len(trajectories), k, dtype=torch.bool)  # (B, K) 1 = a real turn
    spans = torch.zeros(len(trajectories), k, 2, dtype=torch.int64)  # (B, K, 2) [start, end) of its tokens
    for row, trajectory in enumerate(trajectories):
        n = trajectory.num_turns
        row_values = optimal_turn_values(trajectory, env_configs[trajectory.env_name], config.agent)
        rewards[row, :n] = torch.tensor(trajectory.turn_rewards)
        values[row, : n + 1] = torch.tensor(row_values)
        valid[row, :n] = True
        spans[row, :n, 0] = torch.tensor(trajectory.turn_starts)
        spans[row, :n, 1] = torch.tensor(trajectory.turn_ends)
    advantages = turn_td_advantages(rewards, values, valid, lam=config.algo.lam)  # (B, K)
    return with_turn_advantages(batch, advantages, spans)

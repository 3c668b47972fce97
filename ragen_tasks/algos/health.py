"""Echo-Trap health metrics: the per-iteration signals the paper watches, one function per concern.

* ``rollout_health``: from a rollout batch given as plain sequences (no class needed) ->
  ``rollout/...`` floats (in-group reward std, reward mean/std, success, lengths, think, format).
* ``rollout_health_from_trajectories``: the same, unpacking ``Trajectory`` objects.
* ``staleness_health``: policy-version lag of a batch -> ``rollout/staleness_...``.
* ``mean_metrics``: average the per-micro-batch ``(loss, metrics)`` dicts of the update into floats
  (``actor/entropy``, ``actor/clipfrac_low``...); the update adds ``actor/grad_norm`` (pre-clip).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ragen_tasks.algos.advantages import group_stats

if TYPE_CHECKING:
    from ragen_tasks.data.trajectory import Trajectory


def _mean(xs: Sequence[float]) -> float:
    """Mean; 0 for no values."""
    return statistics.fmean(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    """Unbiased (sample) std; 0 for fewer than two values."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def rollout_health(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    successes: Sequence[bool],
    response_lengths: Sequence[int],
    think_lengths: Sequence[float],
    turn_think_nonempty: Sequence[Sequence[bool]],
    turn_format_ok: Sequence[Sequence[bool]],
) -> dict[str, float]:
    """Health metrics of one rollout batch of N trajectories.

    Args:
        rewards: (N,) trajectory rewards.
        group_ids: (N,) initial-state group of each trajectory.
        successes: (N,) the game reported success.
        response_lengths: (N,) number of policy-sampled tokens of each trajectory.
        think_lengths: (N,) mean length of the ``<think>`` text per turn of each trajectory (any unit,
            the caller's; ``rollout_health_from_trajectories`` uses characters).
        turn_think_nonempty: N lists, one flag per turn: the turn's think text is non-empty.
        turn_format_ok: N lists, one flag per turn: the answer parsed and every action was valid.

    Returns:
        floats: ``rollout/num_trajectories``, ``rollout/num_groups``, ``rollout/in_group_std`` (mean
        over groups of the unbiased in-group reward std, 0 for singleton groups),
        ``rollout/in_group_std_max``, ``rollout/zero_std_group_fraction``, ``rollout/reward_mean``,
        ``rollout/reward_std``, ``rollout/success``, ``rollout/response_length``,
        ``rollout/response_length_max``, ``rollout/think_length``, ``rollout/think_fraction`` (turns
        with a non-empty think / all turns), ``rollout/format_error_rate`` (turns not format-ok / all
        turns), ``rollout/turns`` (mean turns per trajectory). An empty batch gives all zeros.
    """
    n = len(rewards)
    columns = {
        "group_ids": len(group_ids),
        "successes": len(successes),
        "response_lengths": len(response_lengths),
        "think_lengths": len(think_lengths),
        "turn_think_nonempty": len(turn_think_nonempty),
        "turn_format_ok": len(turn_format_ok),
    }
    for name, length in columns.items():
        if length != n:
            raise ValueError(f"{name} has {length} entries but rewards has {n}: pass one entry per trajectory")
    for i, (think, fmt) in enumerate(zip(turn_think_nonempty, turn_format_ok, strict=True)):
        if len(think) != len(fmt):
            raise ValueError(
                f"trajectory {i}: turn_think_nonempty has {len(think)} turns but turn_format_ok has {len(fmt)}"
            )
    if n == 0:
        std_mean = std_max = zero_frac = 0.0
        n_groups = 0
    else:
        _, _, std, _ = group_stats(
            torch.tensor([float(r) for r in rewards], dtype=torch.float64),
            torch.tensor(list(group_ids), dtype=torch.int64),
        )
        n_groups = int(std.numel())
        std_mean, std_max = float(std.mean().item()), float(std.max().item())
        zero_frac = float((std == 0).double().mean().item())
    all_think = [bool(f) for turns in turn_think_nonempty for f in turns]
    all_fmt = [bool(f) for turns in turn_format_ok for f in turns]
    rs = [float(r) for r in rewards]
    return {
        "rollout/num_trajectories": float(n),
        "rollout/num_groups": float(n_groups),
        "rollout/in_group_std": std_mean,
        "rollout/in_group_std_max": std_max,
        "rollout/zero_std_group_fraction": zero_frac,
        "rollout/reward_mean": _mean(rs),
        "rollout/reward_std": _std(rs),
        "rollout/success": _mean([float(bool(s)) for s in successes]),
        "rollout/response_length": _mean([float(x) for x in response_lengths]),
        "rollout/response_length_max": float(max(response_lengths)) if n else 0.0,
        "rollout/think_length": _mean([float(x) for x in think_lengths]),
        "rollout/think_fraction": _mean([float(f) for f in all_think]),
        "rollout/format_error_rate": _mean([float(not f) for f in all_fmt]),
        "rollout/turns": _mean([float(len(t)) for t in turn_format_ok]),
    }


def rollout_health_from_trajectories(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``rollout_health`` of a list of ``Trajectory``; think length = characters per turn (stripped).

    A batch that mixes games also gets, per game, ``rollout/<env>/success``,
    ``rollout/<env>/reward_mean`` and ``rollout/<env>/format_error_rate`` (same definitions): the
    mixture's averages hide a game that does not learn behind one that does.
    """
    think_lengths = [_mean([float(len(t.strip())) for t in traj.turn_think]) for traj in trajs]
    metrics = rollout_health(
        rewards=[traj.reward for traj in trajs],
        group_ids=[traj.group_id for traj in trajs],
        successes=[traj.success for traj in trajs],
        response_lengths=[traj.response_length for traj in trajs],
        think_lengths=think_lengths,
        turn_think_nonempty=[[bool(t.strip()) for t in traj.turn_think] for traj in trajs],
        turn_format_ok=[list(traj.turn_format_ok) for traj in trajs],
    )
    envs = sorted({traj.env_name for traj in trajs})
    if len(envs) > 1:
        for env in envs:  # each game's own batch: one game, so no further split
            own = rollout_health_from_trajectories([traj for traj in trajs if traj.env_name == env])
            for key in ("success", "reward_mean", "format_error_rate"):
                metrics[f"rollout/{env}/{key}"] = own[f"rollout/{key}"]
    return metrics


def staleness_health(policy_versions: Sequence[int], trainer_version: int) -> dict[str, float]:
    """Policy-version lag of a batch: ``rollout/staleness_mean`` and ``rollout/staleness_max``.

    Args:
        policy_versions: (N,) version that sampled each trajectory.
        trainer_version: the version the update starts from.
    """
    lags = [float(trainer_version - v) for v in policy_versions]
    return {
        "rollout/staleness_mean": _mean(lags),
        "rollout/staleness_max": max(lags) if lags else 0.0,
    }


def mean_metrics(metrics: Sequence[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Average metric dicts (e.g. one per micro-batch) key by key into floats; one sync per key.

    A key missing from some dicts is averaged over the dicts that have it.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for m in metrics:
        for key, value in m.items():
            v = float(value.detach().float().item()) if isinstance(value, Tensor) else float(value)
            sums[key] = sums.get(key, 0.0) + v
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}

"""Fixed-seed evaluation and the regression gate.

Evaluation rolls out each env on held-out seeds ``seed_offset .. seed_offset + seeds - 1`` (one
rollout per seed, greedy by default, so it is deterministic given the seeds) and aggregates
per-env metrics. The regression gate compares those metrics with a baseline JSON file of the same
shape and fails only on a statistically real drop in success rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean
from typing import Any

from ragen_tasks.data.trajectory import Trajectory

#: Per-env metric names produced by ``aggregate``; also the keys a baseline file holds.
EVAL_METRICS = ("success", "reward", "format_error_rate", "mean_turns", "think_length", "episodes")


def aggregate(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Per-env metrics over evaluation trajectories: {env_name: {metric: value}}."""
    by_env: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        by_env.setdefault(traj.env_name, []).append(traj)
    result: dict[str, dict[str, float]] = {}
    for env_name, trajs in sorted(by_env.items()):
        turns = [ok for t in trajs for ok in t.turn_format_ok]
        thinks = [len(th) for t in trajs for th in t.turn_think]
        result[env_name] = {
            "success": fmean(float(t.success) for t in trajs),
            "reward": fmean(t.reward for t in trajs),
            "format_error_rate": 1.0 - fmean(float(ok) for ok in turns) if turns else 0.0,
            "mean_turns": fmean(t.num_turns for t in trajs),
            "think_length": fmean(thinks) if thinks else 0.0,  # characters of <think> text per turn
            "episodes": float(len(trajs)),
        }
    return result


@dataclass(frozen=True)
class EnvVerdict:
    env_name: str
    baseline_success: float
    current_success: float
    z: float  # one-sided two-proportion z statistic for "current is below baseline"
    p_value: float
    regressed: bool


@dataclass(frozen=True)
class GateResult:
    passed: bool
    verdicts: list[EnvVerdict]

    def summary(self) -> str:
        lines = [f"regression gate: {'PASS' if self.passed else 'FAIL'}"]
        for v in self.verdicts:
            lines.append(
                f"  {v.env_name}: success {v.baseline_success:.3f} -> {v.current_success:.3f} "
                f"(z={v.z:.2f}, p={v.p_value:.4f}){'  REGRESSED' if v.regressed else ''}"
            )
        return "\n".join(lines)


def regression_gate(
    current: Mapping[str, Mapping[str, float]],
    baseline: Mapping[str, Mapping[str, float]],
    *,
    alpha: float = 0.01,
    min_drop: float = 0.05,
) -> GateResult:
    """Fail an env only if its success rate dropped by more than ``min_drop`` AND the drop is
    significant under a one-sided two-proportion z-test at level ``alpha`` (pooled variance).

    Both inputs map env name -> metrics with at least ``success`` (a rate) and ``episodes`` (n).
    The practical tolerance ``min_drop`` keeps huge evaluations from failing on tiny real drops;
    the test keeps small evaluations from failing on sampling noise. An env in the baseline but
    missing from ``current`` is an error (the evaluation did not cover it), not a pass.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha}: must be in (0, 1)")
    missing = sorted(set(baseline) - set(current))
    if missing:
        raise ValueError(f"evaluation is missing envs present in the baseline: {missing}")
    verdicts = []
    for env_name in sorted(baseline):
        p_b, n_b = float(baseline[env_name]["success"]), float(baseline[env_name]["episodes"])
        p_c, n_c = float(current[env_name]["success"]), float(current[env_name]["episodes"])
        if n_b < 1 or n_c < 1:
            raise ValueError(f"{env_name}: episodes must be >= 1 (baseline {n_b}, current {n_c})")
        pooled = (p_b * n_b + p_c * n_c) / (n_b + n_c)
        se = math.sqrt(pooled * (1 - pooled) * (1 / n_b + 1 / n_c))
        drop = p_b - p_c
        # se == 0: both rates are 0 or both 1, so there is no sampling noise to allow for.
        z = (math.inf if drop > 0 else 0.0) if se == 0.0 else drop / se
        p_value = 1.0 - NormalDist().cdf(z) if math.isfinite(z) else 0.0
        regressed = drop > min_drop and p_value < alpha
        verdicts.append(EnvVerdict(env_name, p_b, p_c, z, p_value, regressed))
    return GateResult(passed=not any(v.regressed for v in verdicts), verdicts=verdicts)


def eval_record(per_env: Mapping[str, Mapping[str, float]], **meta: Any) -> dict[str, Any]:
    """The JSON written by evaluation and read as a baseline: {"envs": per_env, **meta}."""
    return {"envs": {k: dict(v) for k, v in per_env.items()}, **meta}

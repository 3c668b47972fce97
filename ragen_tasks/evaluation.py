"""Fixed-seed evaluation, the game's reference points, and the regression gate.

Evaluation rolls out each env on held-out seeds ``seed_offset .. seed_offset + seeds - 1`` (one
rollout per seed, greedy by default, so it is deterministic given the seeds) and aggregates
per-env metrics. ``reference_points`` puts a result in context on the same seeds: the game's
ceiling at the agent's budget and random play. The regression gate compares metrics with a
baseline JSON file of the same shape and fails only on a statistically real drop in success rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean
from typing import Any

import numpy as np

from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make
from ragen_tasks.envs.frozen_lake import turn_planner

#: Held-out seeds per env one evaluation may ask for: the tasks and trajectories are held in memory.
MAX_EVAL_SEEDS = 100_000

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


def _ceiling(env: Any, agent: AgentConfig) -> float | None:
    """Success probability of the best play from the env's reset state under the agent's rules."""
    if env.name == "bandit":
        return 1.0  # success = the higher-EV arm, which best play always names
    budget = min(agent.max_actions_per_episode, env.config.max_actions_per_episode)
    if env.name == "sokoban":  # deterministic: the shortest plan can be played turn by turn as it is
        plan = env.solve()
        return float(plan is not None and len(plan) <= min(budget, agent.max_turns * agent.max_actions_per_turn))
    if env.name == "frozen_lake":
        planner = turn_planner(
            env.desc,
            turns=agent.max_turns,
            actions=budget,
            max_actions_per_turn=min(agent.max_actions_per_turn, 5),
            is_slippery=env.config.is_slippery,
            success_rate=env.config.success_rate,
        )
        row, col = env.position
        return float(planner.value[agent.max_turns, budget, row * len(env.desc[0]) + col])
    return None


def _random_play(env: Any, agent: AgentConfig, rng: np.random.Generator) -> bool:
    """One episode of a random agent: each turn 1..max_actions_per_turn uniformly random actions."""
    names = list(env.action_names)
    used = 0
    for _turn in range(agent.max_turns):
        for _ in range(int(rng.integers(1, agent.max_actions_per_turn + 1))):
            _obs, _reward, terminated, truncated, info = env.step(names[int(rng.integers(len(names)))])
            used += 1
            if terminated or truncated or used >= agent.max_actions_per_episode:
                return bool(info.get("success", False))
    return bool(info.get("success", False))


def reference_points(
    spec: EnvSpec, agent: AgentConfig, *, seeds: int, seed_offset: int, random_episodes: int = 4
) -> dict[str, float | None]:
    """``{"ceiling", "random"}`` success rates of a game on held-out seeds ``seed_offset ..``:
    the best play at the agent's budget (Sokoban: solvable within it, by BFS; FrozenLake: the slip-
    aware turn planner's success probability; Bandit: 1) and a random agent (``random_episodes``
    per seed, seeded by the seed). ``ceiling`` is None for a game without a solver."""
    env = make(spec.name, **dict(spec.config))
    ceilings: list[float] = []
    wins: list[bool] = []
    for seed in range(seed_offset, seed_offset + seeds):
        env.reset(seed=seed)
        best = _ceiling(env, agent)
        if best is not None:
            ceilings.append(best)
        rng = np.random.default_rng(seed)
        for _ in range(random_episodes):
            env.reset(seed=seed)
            wins.append(_random_play(env, agent, rng))
    return {"ceiling": fmean(ceilings) if len(ceilings) == seeds else None, "random": fmean(wins)}


def one_sided_z(p_low: float, n_low: float, p_high: float, n_high: float) -> float:
    """Two-proportion z statistic (pooled variance) for "the second rate is above the first";
    inf when both are 0 or both 1 and the second is higher, 0 when equal."""
    pooled = (p_low * n_low + p_high * n_high) / (n_low + n_high)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_low + 1 / n_high))
    gain = p_high - p_low
    return (math.inf if gain > 0 else 0.0) if se == 0.0 else gain / se


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
        drop = p_b - p_c
        # se == 0 (both rates 0 or both 1): no sampling noise to allow for, so any drop is infinite z
        z = one_sided_z(p_c, n_c, p_b, n_b)
        p_value = 1.0 - NormalDist().cdf(z) if math.isfinite(z) else 0.0
        regressed = drop > min_drop and p_value < alpha
        verdicts.append(EnvVerdict(env_name, p_b, p_c, z, p_value, regressed))
    return GateResult(passed=not any(v.regressed for v in verdicts), verdicts=verdicts)


def eval_record(per_env: Mapping[str, Mapping[str, float]], **meta: Any) -> dict[str, Any]:
    """The JSON written by evaluation and read as a baseline: {"envs": per_env, **meta}."""
    return {"envs": {k: dict(v) for k, v in per_env.items()}, **meta}

"""Fixed-seed evaluation, the game's reference points, and the regression gate.

Evaluation rolls out each env on held-out seeds ``seed_offset .. seed_offset + seeds - 1`` (one
rollout per seed, greedy by default, so it is deterministic given the seeds) and aggregates
per-env metrics and per-seed outcomes (``eval_record``: the one record format, also a baseline).
``reference_points`` puts a result in context on the same seeds: the game's ceiling at the agent's
budget and random play. The regression gate pairs a candidate with a baseline record on their shared
seeds and fails only on a statistically real drop in success rate (exact McNemar test).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import numpy as np

from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.envs import make

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
        planner = env.planner(turns=agent.max_turns, actions=budget, max_actions_per_turn=agent.max_actions_per_turn)
        return float(planner.value[agent.max_turns, budget, env.cell])
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


#: ``format`` of an evaluation record (what ``ragen evaluate --json`` prints and a baseline holds).
RECORD_FORMAT = "ragen-eval/2"


def per_seed_outcomes(trajectories: Sequence[Trajectory]) -> dict[str, list[dict[str, Any]]]:
    """Each evaluation episode's outcome, by env: ``{env: [{"seed", "success", "reward"}, ...]}`` in
    seed order. The regression gate pairs a candidate with its baseline on these seeds."""
    by_env: dict[str, list[dict[str, Any]]] = {}
    for t in sorted(trajectories, key=lambda t: (t.env_name, t.seed)):
        by_env.setdefault(t.env_name, []).append(
            {"seed": int(t.seed), "success": bool(t.success), "reward": float(t.reward)}
        )
    return by_env


def eval_record(
    per_env: Mapping[str, Mapping[str, float]], trajectories: Sequence[Trajectory], **meta: Any
) -> dict[str, Any]:
    """The one evaluation record: what ``ragen evaluate --json`` prints, the evaluate flow returns and
    writes, and the regression gate reads as a baseline. ``envs``: per-env metrics (``aggregate``);
    ``per_seed``: per-env episode outcomes (``per_seed_outcomes``); ``meta``: checkpoint, seeds, ..."""
    return {
        "format": RECORD_FORMAT,
        **meta,
        "envs": {k: dict(v) for k, v in per_env.items()},
        "per_seed": per_seed_outcomes(trajectories),
    }


def check_record(record: Any, what: str) -> dict[str, Any]:
    """``record`` if it is an evaluation record with per-seed outcomes, else ValueError saying how to
    make one (``what`` names where it came from)."""
    fix = "write it with `ragen evaluate CHECKPOINT --json > baseline.json` (or the evaluate flow's `output`)"
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{what} is not an evaluation record (format {found!r}, expected {RECORD_FORMAT!r}): {fix}")
    if not isinstance(record.get("per_seed"), dict) or not record["per_seed"]:
        raise ValueError(f"{what} has no per-seed outcomes (per_seed): {fix}")
    return record


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly (the one-sided sign / exact McNemar test)."""
    if k <= 0:
        return 1.0
    favourable: int = sum(math.comb(n, i) for i in range(k, n + 1))
    return favourable / (1 << n)  # int / int: exact-rounded, no overflow for large n


@dataclass(frozen=True)
class PairedOutcomes:
    """Two evaluations of one env compared seed by seed, on the seeds both played."""

    seeds: int  # shared seeds (the pairs)
    first_success: float  # the first evaluation's success rate on those seeds
    second_success: float  # the second's
    first_only: int  # seeds the first solved and the second did not
    second_only: int  # seeds the second solved and the first did not

    def p_second_better(self) -> float:
        """Exact one-sided McNemar p of "the second solves more": under no difference each discordant
        seed is the second's with probability 1/2, so p = P(Binomial(discordant, 1/2) >= second_only)."""
        return binomial_tail(self.second_only, self.first_only + self.second_only)

    def p_first_better(self) -> float:
        """The same test the other way round: p = P(Binomial(discordant, 1/2) >= first_only)."""
        return binomial_tail(self.first_only, self.first_only + self.second_only)


def pair_outcomes(
    first: Sequence[Mapping[str, Any]],
    second: Sequence[Mapping[str, Any]],
    env_name: str,
    names: tuple[str, str] = ("first evaluation", "second evaluation"),
) -> PairedOutcomes:
    """Pair two evaluations' per-seed outcomes (``per_seed_outcomes`` rows of one env) on their shared
    seeds. Pairing removes each seed's own difficulty from the comparison, so a real difference shows
    with fewer seeds than two independent proportions need. No shared seed is an error; ``names`` name
    the two evaluations in its message."""
    a = {int(o["seed"]): bool(o["success"]) for o in first}
    b = {int(o["seed"]): bool(o["success"]) for o in second}
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError(
            f"{env_name}: the {names[1]} shares no seed with the {names[0]}; evaluate it on the {names[0]}'s seeds"
        )
    return PairedOutcomes(
        seeds=len(shared),
        first_success=sum(a[s] for s in shared) / len(shared),
        second_success=sum(b[s] for s in shared) / len(shared),
        first_only=sum(a[s] and not b[s] for s in shared),
        second_only=sum(b[s] and not a[s] for s in shared),
    )


@dataclass(frozen=True)
class EnvVerdict:
    env_name: str
    seeds: int  # seeds evaluated in both the baseline and the candidate (the pairs)
    baseline_success: float  # on those seeds
    current_success: float  # on those seeds
    losses: int  # seeds the baseline solved and the candidate did not
    gains: int  # seeds the candidate solved and the baseline did not
    p_value: float  # exact one-sided McNemar: P(losses >= observed | no change), losses + gains trials
    regressed: bool


@dataclass(frozen=True)
class GateResult:
    passed: bool
    verdicts: list[EnvVerdict]
    alpha: float
    min_drop: float

    def summary(self) -> str:
        lines = [
            f"regression gate: {'PASS' if self.passed else 'FAIL'}  (paired on shared seeds; fails on a drop "
            f"> {self.min_drop:g} with exact McNemar p < {self.alpha:g})",
            f"  {'env':<14} {'seeds':>5}  {'baseline':>8} -> {'candidate':<9} {'lost':>4} {'won':>4}  {'p':>8}",
        ]
        for v in self.verdicts:
            lines.append(
                f"  {v.env_name:<14} {v.seeds:>5}  {v.baseline_success:>8.3f} -> {v.current_success:<9.3f} "
                f"{v.losses:>4} {v.gains:>4}  {v.p_value:>8.4f}{'  REGRESSED' if v.regressed else ''}"
            )
        return "\n".join(lines)


def regression_gate(
    current: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    alpha: float = 0.01,
    min_drop: float = 0.05,
) -> GateResult:
    """Paired regression test per env on the seeds both evaluations played (``per_seed`` outcomes).

    On the shared seeds, ``losses`` = baseline solved and candidate did not, ``gains`` = the reverse.
    Under "no change" each discordant seed is a loss with probability 1/2, so the exact one-sided
    McNemar test gives p = P(Binomial(losses + gains, 1/2) >= losses). An env regresses only if its
    success rate on the shared seeds dropped by more than ``min_drop`` AND p < ``alpha``: the
    tolerance keeps huge evaluations from failing on tiny real drops, the test keeps small ones from
    failing on noise. Pairing removes the seeds' own difficulty from the comparison, so it detects a
    real drop with fewer seeds than two independent proportions. An env of the baseline missing from
    ``current``, or sharing no seed with it, is an error (the evaluation did not cover it), not a pass.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha}: must be in (0, 1)")
    if not 0 <= min_drop < 1:
        raise ValueError(f"min_drop={min_drop}: must be in [0, 1)")
    missing = sorted(set(baseline) - set(current))
    if missing:
        raise ValueError(f"evaluation is missing envs present in the baseline: {missing}")
    verdicts = []
    for env_name in sorted(baseline):
        pair = pair_outcomes(baseline[env_name], current[env_name], env_name, names=("baseline", "candidate"))
        p_value = pair.p_first_better()  # the baseline solving more is the candidate regressing
        regressed = pair.first_success - pair.second_success > min_drop and p_value < alpha
        verdicts.append(
            EnvVerdict(
                env_name,
                pair.seeds,
                pair.first_success,
                pair.second_success,
                losses=pair.first_only,
                gains=pair.second_only,
                p_value=p_value,
                regressed=regressed,
            )
        )
    return GateResult(passed=not any(v.regressed for v in verdicts), verdicts=verdicts, alpha=alpha, min_drop=min_drop)

"""Rollout freshness: may a batch sampled by policy version v train the policy at version c?

Pure functions, no I/O. A batch (or one trajectory) is accepted iff

    0 <= c - v <= max_staleness   and   known_fingerprints[v] == the batch's weights fingerprint

Rejections, checked in this order: ``future`` (v > c: sampled by a policy the trainer does not
have yet), ``stale`` (c - v > max_staleness), ``unknown_fingerprint`` (v is not a version the
trainer knows, or its weights differ: e.g. a rollout worker that loaded the wrong checkpoint).
``max_staleness = 0`` is strictly on-policy.

Dropping stale episodes biases the kept data toward short episodes (long ones take longer to
sample, so they lag more): :func:`freshness_report` returns counts and the episode-length
distribution of accepted vs rejected trajectories so the bias is visible.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ragen_tasks.data.trajectory import Trajectory

Reason = Literal["ok", "stale", "future", "unknown_fingerprint"]
REASONS: tuple[Reason, ...] = ("ok", "stale", "future", "unknown_fingerprint")


@dataclass(frozen=True)
class FreshnessDecision:
    accepted: bool
    reason: Reason
    lag: int  # current_version - batch_version (negative: from the future)


def check_freshness(
    batch_version: int,
    batch_fingerprint: str,
    current_version: int,
    known_fingerprints: Mapping[int, str],
    max_staleness: int,
) -> FreshnessDecision:
    """Decide whether data sampled at ``batch_version`` may update the policy at ``current_version``."""
    for name, value in (
        ("batch_version", batch_version),
        ("current_version", current_version),
        ("max_staleness", max_staleness),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"check_freshness: {name}={value!r} must be an int >= 0")
    lag = current_version - batch_version
    if lag < 0:
        return FreshnessDecision(False, "future", lag)
    if lag > max_staleness:
        return FreshnessDecision(False, "stale", lag)
    if known_fingerprints.get(batch_version) != batch_fingerprint:
        return FreshnessDecision(False, "unknown_fingerprint", lag)
    return FreshnessDecision(True, "ok", lag)


@dataclass(frozen=True)
class LengthStats:
    """Distribution of episode lengths (tokens and turns) of a set of trajectories."""

    count: int
    tokens_mean: float
    tokens_p50: float
    tokens_p90: float
    turns_mean: float
    turns_histogram: dict[int, int]  # turns -> number of episodes

    @staticmethod
    def of(trajectories: Sequence[Trajectory]) -> LengthStats:
        if not trajectories:
            return LengthStats(0, float("nan"), float("nan"), float("nan"), float("nan"), {})
        tokens = np.array([t.num_tokens for t in trajectories], dtype=np.float64)  # (N,)
        turns = [t.num_turns for t in trajectories]
        return LengthStats(
            count=len(trajectories),
            tokens_mean=float(tokens.mean()),
            tokens_p50=float(np.percentile(tokens, 50)),
            tokens_p90=float(np.percentile(tokens, 90)),
            turns_mean=float(np.mean(turns)),
            turns_histogram=dict(sorted(Counter(turns).items())),
        )


@dataclass(frozen=True)
class FreshnessReport:
    accepted: list[Trajectory]
    rejected: list[Trajectory]
    counts: dict[str, int]  # reason -> number of trajectories (every reason present, 0 if none)
    accepted_lengths: LengthStats
    rejected_lengths: LengthStats

    def metrics(self) -> dict[str, float]:
        """Flat, namespaced metrics for logging (``freshness/...``)."""
        out: dict[str, float] = {f"freshness/{reason}": float(n) for reason, n in self.counts.items()}
        total = len(self.accepted) + len(self.rejected)
        out["freshness/rejected_fraction"] = len(self.rejected) / total if total else 0.0
        out["freshness/accepted_tokens_mean"] = self.accepted_lengths.tokens_mean
        out["freshness/rejected_tokens_mean"] = self.rejected_lengths.tokens_mean
        out["freshness/accepted_turns_mean"] = self.accepted_lengths.turns_mean
        out["freshness/rejected_turns_mean"] = self.rejected_lengths.turns_mean
        return out


def freshness_report(
    trajectories: Sequence[Trajectory],
    current_version: int,
    known_fingerprints: Mapping[int, str],
    max_staleness: int,
) -> FreshnessReport:
    """Check each trajectory's own (policy_version, weights_fingerprint); split and summarise."""
    accepted: list[Trajectory] = []
    rejected: list[Trajectory] = []
    counts: dict[str, int] = dict.fromkeys(REASONS, 0)
    for traj in trajectories:
        d = check_freshness(
            traj.policy_version, traj.weights_fingerprint, current_version, known_fingerprints, max_staleness
        )
        counts[d.reason] += 1
        (accepted if d.accepted else rejected).append(traj)
    return FreshnessReport(accepted, rejected, counts, LengthStats.of(accepted), LengthStats.of(rejected))

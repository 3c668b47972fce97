"""Regression gate statistics and evaluation aggregation."""

from __future__ import annotations

import random

import pytest

from ragen_tasks.evaluation import regression_gate


def _rates(successes: int, episodes: int) -> dict[str, float]:
    return {"success": successes / episodes, "episodes": float(episodes)}


def test_identical_results_pass() -> None:
    base = {"bandit": _rates(60, 64), "frozen_lake": _rates(20, 64)}
    assert regression_gate(base, base).passed


def test_a_real_drop_fails_and_names_the_env() -> None:
    base = {"bandit": _rates(60, 64), "frozen_lake": _rates(20, 64)}
    cur = {"bandit": _rates(30, 64), "frozen_lake": _rates(20, 64)}
    result = regression_gate(cur, base)
    assert not result.passed
    assert [v.env_name for v in result.verdicts if v.regressed] == ["bandit"]
    assert "REGRESSED" in result.summary()


def test_improvement_passes() -> None:
    assert regression_gate({"b": _rates(64, 64)}, {"b": _rates(40, 64)}).passed


def test_sampling_noise_passes_at_the_stated_level() -> None:
    # Two evaluations of the SAME policy (true success 0.5) on different seeds: the gate must not
    # fire more often than alpha (0.01) plus slack; checked over many simulated pairs.
    rng = random.Random(0)
    fired = 0
    trials = 400
    for _ in range(trials):
        a = sum(rng.random() < 0.5 for _ in range(64))
        b = sum(rng.random() < 0.5 for _ in range(64))
        fired += not regression_gate({"e": _rates(b, 64)}, {"e": _rates(a, 64)}).passed
    assert fired / trials < 0.03


def test_small_drop_below_tolerance_passes_even_with_huge_n() -> None:
    assert regression_gate({"e": _rates(4_800, 10_000)}, {"e": _rates(5_000, 10_000)}, min_drop=0.05).passed


def test_degenerate_rates() -> None:
    assert not regression_gate({"e": _rates(0, 64)}, {"e": _rates(64, 64)}).passed
    assert regression_gate({"e": _rates(64, 64)}, {"e": _rates(64, 64)}).passed


def test_missing_env_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="missing envs"):
        regression_gate({"bandit": _rates(1, 2)}, {"bandit": _rates(1, 2), "sokoban": _rates(1, 2)})

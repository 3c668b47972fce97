"""Echo-Trap detector on synthetic metric histories: fires on collapse at the right iteration, not on noise."""

from __future__ import annotations

import random

import pytest

from ragen_tasks.algos.echo_trap import (
    EchoTrapRules,
    detect_echo_trap,
    first_signals,
    latest_signals,
)


def healthy(rng: random.Random, n: int) -> list[dict[str, float]]:
    """Stationary noisy history: every metric within +-15-20% of its level, grad norm log-normal."""
    out = []
    for _ in range(n):
        out.append(
            {
                "rollout/in_group_std": 0.4 * rng.uniform(0.85, 1.15),
                "actor/grad_norm": rng.lognormvariate(0.0, 0.3),
                "actor/entropy": 1.5 * rng.uniform(0.85, 1.15),
                "rollout/think_length": 40.0 * rng.uniform(0.8, 1.2),
                "rollout/format_error_rate": rng.uniform(0.0, 0.1),
            }
        )
    return out


@pytest.mark.parametrize("seed", range(40))
def test_no_signal_on_noise(seed: int) -> None:
    history = healthy(random.Random(seed), 80)
    assert detect_echo_trap(history) == []


def collapse_history(seed: int) -> list[dict[str, float]]:
    """Healthy for 30 iterations, then the Echo Trap in the paper's order, each at a known iteration."""
    history = healthy(random.Random(seed), 45)
    for i in range(30, 45):
        history[i]["rollout/in_group_std"] = 0.05  # std dies at 30 -> fires at 32 (patience 3)
    for i in range(33, 45):
        history[i]["rollout/think_length"] = 2.0  # reasoning vanishes at 33 -> fires at 34 (patience 2)
    history[35]["actor/grad_norm"] = 25.0  # one spike -> fires at 35 only
    for i in range(36, 45):
        history[i]["actor/entropy"] = 0.1  # entropy collapse at 36 -> fires at 37 (patience 2)
    for i in range(38, 45):
        history[i]["rollout/format_error_rate"] = 0.6  # format errors rise at 38 -> fires at 39
    return history


@pytest.mark.parametrize("seed", range(10))
def test_collapse_fires_at_the_right_iterations(seed: int) -> None:
    signals = detect_echo_trap(collapse_history(seed))
    onsets = {rule: s.iteration for rule, s in first_signals(signals).items()}
    assert onsets == {
        "in_group_std_collapse": 32,
        "think_collapse": 34,
        "grad_norm_spike": 35,
        "entropy_collapse": 37,
        "format_error_rise": 39,
    }
    spikes = [s for s in signals if s.rule == "grad_norm_spike"]
    assert [s.iteration for s in spikes] == [35]
    std = first_signals(signals)["in_group_std_collapse"]
    assert std.window == (0.05, 0.05, 0.05)
    assert std.threshold == pytest.approx(0.2 * std.reference)
    assert "rollout/in_group_std" in std.message and "32" in std.message
    assert std.as_dict()["window"] == [0.05, 0.05, 0.05]


def test_patience_resets_on_recovery() -> None:
    history = [{"rollout/in_group_std": v} for v in [1.0, 1.0, 1.0, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1]]
    signals = detect_echo_trap(history)
    assert [(s.rule, s.iteration) for s in signals] == [("in_group_std_collapse", 8)]


def test_detector_is_causal_latest_matches_full_run() -> None:
    history = collapse_history(0)
    full = detect_echo_trap(history)
    for k in range(1, len(history) + 1):
        latest = latest_signals(history[:k])
        assert latest == [s for s in full if s.iteration == k - 1]


def test_entropy_jump_and_non_finite_grad_norm() -> None:
    history = healthy(random.Random(1), 12)
    history[8]["actor/entropy"] = 9.0
    history[10]["actor/grad_norm"] = float("nan")
    got = {(s.rule, s.iteration) for s in detect_echo_trap(history)}
    assert got == {("entropy_jump", 8), ("grad_norm_spike", 10)}


def test_iteration_key_missing_metrics_and_disabled_rules() -> None:
    history: list[dict[str, float]] = [
        {"iteration": 100 + i, "rollout/in_group_std": v} for i, v in enumerate([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    ]
    history.insert(4, {"actor/grad_norm": 1.0})  # an entry without the metric is ignored by the rule
    signals = detect_echo_trap(history)
    assert [s.iteration for s in signals] == [105]
    assert detect_echo_trap(history, EchoTrapRules(std_collapse_fraction=None)) == []
    assert detect_echo_trap([]) == [] and latest_signals([]) == []


def test_rules_validation() -> None:
    with pytest.raises(ValueError, match="std_collapse_fraction"):
        EchoTrapRules(std_collapse_fraction=1.5)
    with pytest.raises(ValueError, match="grad_norm_spike_factor"):
        EchoTrapRules(grad_norm_spike_factor=0.5)
    with pytest.raises(ValueError, match="warmup"):
        EchoTrapRules(warmup=0)
    with pytest.raises(ValueError, match="median_min_history"):
        EchoTrapRules(median_min_history=20)
    rules = EchoTrapRules()
    with pytest.raises(AttributeError):
        rules.warmup = 5  # type: ignore[misc]

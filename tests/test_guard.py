"""Echo-Trap guard decisions on synthetic metric histories (the detector itself: tests/algos)."""

from __future__ import annotations

from typing import Any

import pytest

from ragen_tasks import guard
from ragen_tasks.presets import load_config


def _rows(stds: list[float]) -> list[dict[str, Any]]:
    """Healthy rows, then whatever in-group std values are given; policy step = iteration."""
    return [
        {
            "iteration": i,
            "policy/step": i,
            "rollout/in_group_std": s,
            "actor/grad_norm": 1.0,
            "actor/entropy": 0.5,
            "rollout/think_length": 30.0,
            "rollout/format_error_rate": 0.0,
        }
        for i, s in enumerate(stds)
    ]


COLLAPSE = [0.4, 0.42, 0.38, 0.4, 0.41, 0.02, 0.01, 0.01]  # in-group std dies at iteration 5


def _config(action: str, **extra: Any):  # type: ignore[no-untyped-def]
    return load_config("bandit-tiny", {"guard.action": action, **extra})


def _replay(config, stds):  # type: ignore[no-untyped-def]
    """Feed rows one by one as the flow does, recording signals on each row."""
    rows: list[dict[str, Any]] = []
    decisions = []
    for row in _rows(stds):
        decision = guard.decide(config, [*rows, row], rollbacks_done=0, patch=guard.GuardPatch())
        row["guard/signals"] = decision.signals
        rows.append(row)
        decisions.append(decision)
    return decisions


def test_noise_never_fires() -> None:
    import random

    rng = random.Random(0)
    noisy = [0.4 + rng.uniform(-0.1, 0.1) for _ in range(30)]
    assert all(d.action == "none" for d in _replay(_config("rollback"), noisy))


def test_warn_fires_at_the_collapse_iteration() -> None:
    decisions = _replay(_config("warn"), COLLAPSE)
    fired = [i for i, d in enumerate(decisions) if d.action == "warn"]
    assert fired and fired[0] == 7  # patience 3: iterations 5, 6, 7 below 0.2 x early level
    assert decisions[7].signals[0]["rule"] == "in_group_std_collapse"


def test_rollback_names_the_last_healthy_step_and_mitigates() -> None:
    config = _config("rollback", **{"guard.mitigation": "lower_lr"})
    decisions = _replay(config, COLLAPSE)
    rollback = decisions[7]
    assert rollback.action == "rollback"
    # The rule fired at 7 with patience 3: its window (5, 6, 7) is the collapse, so the healthy
    # checkpoint is the newest signal-free step BEFORE the onset 5, i.e. 4 (not 5 or 6).
    assert rollback.rollback_to == 4
    assert rollback.patch == guard.GuardPatch(lr=config.optim.lr / 2)


def test_rollback_limit_turns_into_stop() -> None:
    config = _config("rollback", **{"guard.max_rollbacks": 1})
    rows = _rows(COLLAPSE)
    decision = guard.decide(config, rows, rollbacks_done=1, patch=guard.GuardPatch(lr=0.1))
    assert decision.action == "stop"
    assert "rollback limit 1 reached" in decision.message
    assert decision.patch == guard.GuardPatch(lr=0.1)


def test_stop_names_the_healthy_checkpoint() -> None:
    # Fired at 7 with a 3-iteration window: the last healthy checkpoint precedes its onset (5).
    decision = guard.decide(_config("stop"), _rows(COLLAPSE), rollbacks_done=0, patch=guard.GuardPatch())
    assert decision.action == "stop"
    assert decision.rollback_to == 4
    assert "last healthy checkpoint: step 4" in decision.message


def test_off_ignores_everything() -> None:
    assert guard.decide(_config("off"), _rows(COLLAPSE), rollbacks_done=0, patch=guard.GuardPatch()).action == "none"


def test_mitigations() -> None:
    base = _config("rollback")
    assert guard.mitigation(
        base.model_copy(update={"guard": base.guard.model_copy(update={"mitigation": "stronger_filter"})})
    ) == guard.GuardPatch(filter_keep_ratio=base.algo.filter_keep_ratio / 2)
    starpo_s = guard.mitigation(
        base.model_copy(update={"guard": base.guard.model_copy(update={"mitigation": "starpo_s"})})
    )
    assert starpo_s.clip_high == 0.28 and starpo_s.kl_mode == "none"


def test_bad_rule_name_is_clear() -> None:
    with pytest.raises(ValueError, match=r"guard.rules: .*valid rule settings: .*std_collapse_fraction"):
        guard.rules(_config("warn", **{"guard.rules": {"nope": 1}}).guard)


def test_rollback_candidates_cover_the_target() -> None:
    config = _config("rollback")
    rows = _rows(COLLAPSE)
    decision = guard.decide(config, rows, rollbacks_done=0, patch=guard.GuardPatch())
    # What the flow protected from pruning after the previous iteration includes the chosen target.
    assert decision.rollback_to in guard.rollback_candidates(rows[:-1], guard.rules(config.guard))


def test_starpo_s_mitigation_takes_the_stabilisers_from_the_algo_preset() -> None:
    from ragen_tasks.presets.algos import load_algo_preset

    config = _config("rollback", **{"guard.mitigation": "starpo_s", "algo.kl_mode": "in_loss", "algo.clip_high": 0.2})
    patch = guard.mitigation(config)
    starpo_s = load_algo_preset("starpo-s")["algo"]
    assert patch.overrides() == {f"algo.{k}": starpo_s[k] for k in guard.STARPO_S_STABILISERS}
    patched = patch.apply(config)
    assert (patched.algo.kl_mode, patched.algo.clip_high) == ("none", 0.28)
    assert patched.algo.advantage == config.algo.advantage and patched.optim == config.optim  # stabilisers only


def test_patches_compose_and_round_trip_through_the_rows() -> None:
    first = guard.GuardPatch(lr=1e-3, kl_mode="none")
    both = first.then(guard.GuardPatch(lr=5e-4))
    assert both == guard.GuardPatch(lr=5e-4, kl_mode="none")
    assert guard.GuardPatch.from_overrides(both.overrides()) == both
    assert both.overrides() == {"optim.lr": 5e-4, "algo.kl_mode": "none"}
    with pytest.raises(ValueError, match="the guard sets only"):
        guard.GuardPatch.from_overrides({"optim.critic_lr": 1.0})


def test_judge_continues_the_guard_state_recorded_in_the_rows() -> None:
    config = _config("rollback", **{"guard.mitigation": "lower_lr", "guard.max_rollbacks": 2})
    rows: list[dict[str, Any]] = []
    for row in _rows(COLLAPSE):
        decision = guard.judge(config, rows, row)
        rows.append({**row, **decision.record()})
    assert [r["guard/action"] for r in rows] == ["none"] * 7 + ["rollback"]
    assert rows[-1]["guard/rollbacks"] == 1 and rows[-1]["guard/overrides"] == {"optim.lr": config.optim.lr / 2}
    # the next iteration continues from that state: one rollback done, the halved learning rate in force
    again = guard.judge(config, rows, {**rows[-1], "iteration": 8, "guard/signals": []})
    assert again.rollbacks == 1 and again.patch == guard.GuardPatch(lr=config.optim.lr / 2)

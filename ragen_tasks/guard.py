"""The Echo-Trap guard: turns the detector's signals into an action. Pure decisions, no I/O.

After every iteration the training flow calls ``decide`` with the run's metric history since the
last rollback (the detector in ``ragen_tasks.algos.echo_trap`` judges the LAST iteration) and the
guard config:

* ``off``: nothing; ``warn``: the signals are logged, published and recorded in the row;
* ``stop``: the run ends cleanly, naming the last healthy checkpoint;
* ``rollback``: the next iteration continues from the last healthy checkpoint's exact weights
  (and optimizer state), with a mitigation applied from then on: ``lower_lr`` halves the actor's
  learning rate, ``stronger_filter`` halves the uncertainty filter's keep ratio (keeps fewer,
  higher-variance groups), ``starpo_s`` switches to the StarPO-S stabilisers (no KL,
  clip-higher 0.28, filter 0.25). After ``max_rollbacks`` rollbacks a further firing stops the run.

"Healthy" is judged by rollouts, before the collapse began: a rule with patience k fires only
after k bad iterations, so the rollback target is the newest policy step whose iteration raised no
signal AND came before the onset of the firing (the first iteration of the rule's window). The
flow keeps every checkpoint that could become that target (``rollback_candidates``) from pruning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ragen_tasks.algos.echo_trap import EchoTrapRules, latest_signals
from ragen_tasks.config import GuardConfig, TrainConfig

Action = Literal["none", "warn", "stop", "rollback"]

#: StarPO-S stabilisers, as config overrides (the paper's settings; see presets/algos/starpo-s.yaml).
STARPO_S_OVERRIDES: dict[str, Any] = {
    "algo.kl_mode": "none",
    "algo.clip_low": 0.2,
    "algo.clip_high": 0.28,
    "algo.filter_keep_ratio": 0.25,
    "algo.filter_mode": "highest_std",
}


@dataclass(frozen=True)
class GuardDecision:
    action: Action
    signals: list[dict[str, Any]] = field(default_factory=list)  # EchoTrapSignal.as_dict() of the last iteration
    rollback_to: int | None = None  # checkpoint step to restore (rollback only)
    overrides: dict[str, Any] = field(default_factory=dict)  # config overrides in force from the next iteration
    message: str = ""


def rules(guard: GuardConfig) -> EchoTrapRules:
    """The detector thresholds: defaults with ``guard.rules`` applied (bad names fail clearly)."""
    try:
        return EchoTrapRules(**guard.rules)
    except TypeError as exc:
        known = sorted(EchoTrapRules.__dataclass_fields__)
        raise ValueError(f"guard.rules: {exc}; valid rule settings: {', '.join(known)}") from None


def mitigation(config: TrainConfig) -> dict[str, Any]:
    """Overrides for ``config.guard.mitigation``, computed from the config in force now."""
    kind = config.guard.mitigation
    if kind == "lower_lr":
        return {"optim.lr": config.optim.lr / 2}
    if kind == "stronger_filter":
        return {"algo.filter_keep_ratio": max(config.algo.filter_keep_ratio / 2, 0.05)}
    return dict(STARPO_S_OVERRIDES)


def since_last_rollback(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows after the last rollback: the detector and the healthy step judge only those (the
    collapsed stretch before a rollback is history, not the current policy's)."""
    starts = [i for i, row in enumerate(rows) if row.get("guard/action") == "rollback"]
    return list(rows[starts[-1] + 1 :] if starts else rows)


def _iteration(row: Mapping[str, Any], index: int) -> int:
    return int(row.get("iteration", index))


def onset(rows: Sequence[Mapping[str, Any]], signal: Mapping[str, Any]) -> int:
    """First iteration of the stretch that made ``signal`` fire: ``len(window)`` rows holding the
    signal's metric, counted back from the firing iteration."""
    seen = [
        _iteration(row, i)
        for i, row in enumerate(rows)
        if signal["metric"] in row and _iteration(row, i) <= int(signal["iteration"])
    ]
    if not seen:
        return int(signal["iteration"])
    return seen[-min(len(signal.get("window") or [0]), len(seen))]


def max_patience(rules: EchoTrapRules) -> int:
    """The longest window a rule needs before it fires."""
    return max(
        rules.std_collapse_patience, rules.entropy_patience, rules.think_patience, rules.format_error_patience, 1
    )


def rollback_candidates(rows: Sequence[Mapping[str, Any]], rules: EchoTrapRules) -> set[int]:
    """Policy steps a rollback decided after ``rows`` could target: the newest signal-free steps far
    enough back to precede any firing window. The flow protects them from pruning."""
    free = [int(row["policy/step"]) for row in rows if not row.get("guard/signals") and "policy/step" in row]
    return set(free[-(max_patience(rules) + 1) :])


def healthy_step(rows: Sequence[Mapping[str, Any]]) -> int | None:
    """Newest ``policy/step`` whose iteration raised no guard signal (rows in order)."""
    for row in reversed(rows):
        if not row.get("guard/signals") and "policy/step" in row:
            return int(row["policy/step"])
    return None


def decide(
    config: TrainConfig, rows: Sequence[Mapping[str, Any]], *, rollbacks_done: int, overrides: Mapping[str, Any]
) -> GuardDecision:
    """What to do after the last of ``rows`` (the history since the last rollback, in order).

    ``config`` is the config in force (base config + ``overrides``); ``overrides`` are those
    already applied; the decision's ``overrides`` are the ones in force from the next iteration.
    """
    guard = config.guard
    if guard.action == "off" or not rows:
        return GuardDecision("none", overrides=dict(overrides))
    signals = [s.as_dict() for s in latest_signals(list(rows), rules(guard))]
    if not signals:
        return GuardDecision("none", overrides=dict(overrides))
    fired = ", ".join(f"{s['rule']} ({s['message']})" for s in signals)
    iteration = rows[-1].get("iteration", len(rows) - 1)
    start = min(onset(rows, s) for s in signals)  # the collapse began here: roll back to before it
    healthy = healthy_step([row for i, row in enumerate(rows[:-1]) if _iteration(row, i) < start])
    if guard.action == "warn":
        return GuardDecision(
            "warn", signals, overrides=dict(overrides), message=f"Echo-Trap signals at iteration {iteration}: {fired}"
        )
    if guard.action == "rollback" and healthy is not None and rollbacks_done < guard.max_rollbacks:
        new_overrides = {**overrides, **mitigation(config)}
        return GuardDecision(
            "rollback",
            signals,
            rollback_to=healthy,
            overrides=new_overrides,
            message=f"Echo-Trap at iteration {iteration}: {fired}; rolling back to checkpoint "
            f"{healthy} with mitigation {guard.mitigation} ({rollbacks_done + 1}/{guard.max_rollbacks})",
        )
    why = (
        "no healthy checkpoint to roll back to"
        if guard.action == "rollback" and healthy is None
        else f"rollback limit {guard.max_rollbacks} reached"
        if guard.action == "rollback"
        else "guard.action=stop"
    )
    where = f"last healthy checkpoint: step {healthy}" if healthy is not None else "no healthy checkpoint yet"
    return GuardDecision(
        "stop",
        signals,
        rollback_to=healthy,
        overrides=dict(overrides),
        message=f"Echo-Trap at iteration {iteration}: {fired}; stopping ({why}); {where}",
    )

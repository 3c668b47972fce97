"""The Echo-Trap guard: turns the detector's signals into an action. Pure decisions, no I/O.

After every iteration the training flow calls ``judge`` with the run's committed metric rows and
the new iteration's row; it hands ``decide`` the rows since the last rollback (the detector in
``ragen_tasks.algos.echo_trap`` judges the LAST iteration), the config and the mitigations in force:

* ``off``: nothing; ``warn``: the signals are logged, published and recorded in the row;
* ``stop``: the run ends cleanly, naming the last healthy checkpoint;
* ``rollback``: the next iteration continues from the last healthy checkpoint's exact weights
  (and optimizer state), with a mitigation applied from then on (a typed ``GuardPatch``):
  ``lower_lr`` halves the actor's learning rate, ``stronger_filter`` halves the uncertainty
  filter's keep ratio (keeps fewer, higher-variance groups), ``starpo_s`` switches to the StarPO-S
  stabilisers of ``presets/algos/starpo-s.yaml`` (no KL, clip-higher 0.28, filter 0.25). After
  ``max_rollbacks`` rollbacks a further firing stops the run.

"Healthy" is judged by rollouts, before the collapse began: a rule with patience k fires only
after k bad iterations, so the rollback target is the newest policy step whose iteration raised no
signal AND came before the onset of the firing (the first iteration of the rule's window). The
flow keeps every checkpoint that could become that target (``rollback_candidates``) from pruning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragen_tasks.algos.echo_trap import EchoTrapRules, latest_signals
from ragen_tasks.config import FilterMode, GuardConfig, KlMode, TrainConfig, with_overrides
from ragen_tasks.presets.algos import load_algo_preset

Action = Literal["none", "warn", "stop", "rollback"]

#: The StarPO-S stabilisers the ``starpo_s`` mitigation switches on, with the values of
#: ``presets/algos/starpo-s.yaml`` (the one place they are written).
STARPO_S_STABILISERS = ("kl_mode", "clip_low", "clip_high", "filter_keep_ratio", "filter_mode")


class GuardPatch(BaseModel):
    """The settings the guard's mitigations changed, in force from the iteration after a rollback;
    None = the run's own value. Metric rows record it in dotted form (``guard/overrides``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float | None = Field(None, gt=0, description="optim.lr (lower_lr halves it)")
    filter_keep_ratio: float | None = Field(
        None, gt=0, le=1, description="algo.filter_keep_ratio (stronger_filter halves it; starpo_s sets it)"
    )
    kl_mode: KlMode | None = Field(None, description="algo.kl_mode (starpo_s)")
    clip_low: float | None = Field(None, gt=0, lt=1, description="algo.clip_low (starpo_s)")
    clip_high: float | None = Field(None, gt=0, description="algo.clip_high (starpo_s)")
    filter_mode: FilterMode | None = Field(None, description="algo.filter_mode (starpo_s)")

    KEYS: ClassVar[dict[str, str]] = {  # field -> the dotted config key it sets
        "lr": "optim.lr",
        "filter_keep_ratio": "algo.filter_keep_ratio",
        "kl_mode": "algo.kl_mode",
        "clip_low": "algo.clip_low",
        "clip_high": "algo.clip_high",
        "filter_mode": "algo.filter_mode",
    }

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any]) -> GuardPatch:
        """The patch a row recorded as ``guard/overrides``."""
        fields = {key: name for name, key in cls.KEYS.items()}  # dotted key -> field
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"guard/overrides {unknown}: the guard sets only {sorted(fields)}")
        return cls(**{fields[key]: value for key, value in overrides.items()})

    def overrides(self) -> dict[str, Any]:
        """The patch as dotted config keys (what rows record)."""
        return {key: getattr(self, name) for name, key in self.KEYS.items() if getattr(self, name) is not None}

    def then(self, later: GuardPatch) -> GuardPatch:
        """This patch with ``later``'s settings on top."""
        return self.model_copy(update=later.model_dump(exclude_none=True))

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` with the patched settings in force."""
        return with_overrides(config, self.overrides())


@dataclass(frozen=True)
class GuardDecision:
    action: Action
    signals: list[dict[str, Any]] = field(default_factory=list)  # EchoTrapSignal.as_dict() of the last iteration
    rollback_to: int | None = None  # checkpoint step to restore (rollback only)
    patch: GuardPatch = field(default_factory=GuardPatch)  # the mitigations in force from the next iteration
    rollbacks: int = 0  # rollbacks of the run, this one included
    message: str = ""

    def record(self) -> dict[str, Any]:
        """The decision as metric-row keys (``guard/...``): what the next iteration and a resume read back."""
        return {
            "guard/action": self.action,
            "guard/signals": self.signals,
            "guard/overrides": self.patch.overrides(),
            "guard/rollbacks": self.rollbacks,
        }


def rules(guard: GuardConfig) -> EchoTrapRules:
    """The detector thresholds: defaults with ``guard.rules`` applied (bad names fail clearly)."""
    try:
        return EchoTrapRules(**guard.rules)
    except TypeError as exc:
        known = sorted(EchoTrapRules.__dataclass_fields__)
        raise ValueError(f"guard.rules: {exc}; valid rule settings: {', '.join(known)}") from None


def mitigation(config: TrainConfig) -> GuardPatch:
    """The patch of ``config.guard.mitigation``, computed from the config in force now."""
    kind = config.guard.mitigation
    if kind == "lower_lr":
        return GuardPatch(lr=config.optim.lr / 2)
    if kind == "stronger_filter":
        return GuardPatch(filter_keep_ratio=max(config.algo.filter_keep_ratio / 2, 0.05))
    starpo_s = load_algo_preset("starpo-s")["algo"]
    return GuardPatch(**{name: starpo_s[name] for name in STARPO_S_STABILISERS})


def in_force(rows: Sequence[Mapping[str, Any]]) -> GuardPatch:
    """The patch in force after the committed ``rows`` (the last one's ``guard/overrides``)."""
    return GuardPatch.from_overrides(rows[-1].get("guard/overrides", {}) if rows else {})


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
    config: TrainConfig, rows: Sequence[Mapping[str, Any]], *, rollbacks_done: int, patch: GuardPatch
) -> GuardDecision:
    """What to do after the last of ``rows`` (the history since the last rollback, in order).

    ``config`` is the config in force (the run's config + ``patch``); ``patch`` holds the
    mitigations already applied; the decision's ``patch`` is the one in force from the next iteration.
    """
    guard = config.guard
    if guard.action == "off" or not rows:
        return GuardDecision("none", patch=patch, rollbacks=rollbacks_done)
    signals = [s.as_dict() for s in latest_signals(list(rows), rules(guard))]
    if not signals:
        return GuardDecision("none", patch=patch, rollbacks=rollbacks_done)
    fired = ", ".join(f"{s['rule']} ({s['message']})" for s in signals)
    iteration = rows[-1].get("iteration", len(rows) - 1)
    start = min(onset(rows, s) for s in signals)  # the collapse began here: roll back to before it
    healthy = healthy_step([row for i, row in enumerate(rows[:-1]) if _iteration(row, i) < start])
    if guard.action == "warn":
        return GuardDecision(
            "warn",
            signals,
            patch=patch,
            rollbacks=rollbacks_done,
            message=f"Echo-Trap signals at iteration {iteration}: {fired}",
        )
    if guard.action == "rollback" and healthy is not None and rollbacks_done < guard.max_rollbacks:
        return GuardDecision(
            "rollback",
            signals,
            rollback_to=healthy,
            patch=patch.then(mitigation(config)),
            rollbacks=rollbacks_done + 1,
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
        patch=patch,
        rollbacks=rollbacks_done,
        message=f"Echo-Trap at iteration {iteration}: {fired}; stopping ({why}); {where}",
    )


def judge(config: TrainConfig, rows: Sequence[Mapping[str, Any]], row: Mapping[str, Any]) -> GuardDecision:
    """The guard's decision on a new iteration's ``row``, given the run's own ``config`` and its
    committed ``rows`` before it (they hold the mitigations in force and the rollbacks so far)."""
    patch = in_force(rows)
    rollbacks = int(rows[-1].get("guard/rollbacks", 0)) if rows else 0
    return decide(patch.apply(config), [*since_last_rollback(rows), row], rollbacks_done=rollbacks, patch=patch)

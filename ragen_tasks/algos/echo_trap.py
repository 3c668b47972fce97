"""Echo-Trap detector: pure rules over the per-iteration health-metric history.

The RAGEN paper's "Echo Trap": in multi-turn RL the in-group reward variance dies first, then the
reward falls, gradient norms spike and the reasoning text disappears. This module only DETECTS; the
guard (training side) decides to warn, stop or roll back.

Input: ``history``, one dict per iteration in order, holding the namespaced floats of
``ragen_tasks.algos.health`` and the update (``rollout/in_group_std``, ``actor/grad_norm``,
``actor/entropy``, ``rollout/think_length``, ``rollout/format_error_rate``). An entry may carry an
``"iteration"`` key; otherwise its position in the list is its iteration. A rule ignores entries
that lack its metric (or hold NaN for it), except that a non-finite grad norm is itself a spike.

Rules (all thresholds in ``EchoTrapRules``; set a rule's main threshold to None to turn it off).
The "early level" of a metric is the mean of its first ``warmup`` values; rules that compare to it
start after those ``warmup`` values. Every rule looks only at entries up to the iteration it
judges (no look-ahead), so running it after each iteration fires at the same iteration as running
it once on the full history.

* ``in_group_std_collapse``: in-group reward std < ``std_collapse_fraction`` x early level for
  ``std_collapse_patience`` consecutive iterations.
* ``grad_norm_spike``: grad norm > ``grad_norm_spike_factor`` x median of the previous
  ``grad_norm_window`` values (needs ``median_min_history`` of them), or non-finite.
* ``entropy_collapse``: entropy < ``entropy_collapse_fraction`` x early level for
  ``entropy_patience`` consecutive iterations.
* ``entropy_jump``: entropy > ``entropy_jump_factor`` x median of the previous ``entropy_window``
  values (needs ``median_min_history`` of them).
* ``think_collapse``: think length < ``think_collapse_fraction`` x early level for
  ``think_patience`` consecutive iterations.
* ``format_error_rise``: format-error rate > early level + ``format_error_rise`` (absolute) for
  ``format_error_patience`` consecutive iterations.

A rule fires at EVERY iteration where its condition holds; ``first_signals`` keeps the onset of each.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

History = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class EchoTrapRules:
    """Thresholds of the detector's rules; None turns a rule off. See the module docstring."""

    warmup: int = 3  # iterations that define a metric's early level (mean of its first `warmup` values)
    median_min_history: int = 3  # previous values a running-median rule needs before it can fire
    # in-group reward std collapse
    std_metric: str = "rollout/in_group_std"
    std_collapse_fraction: float | None = 0.2
    std_collapse_patience: int = 3
    # gradient-norm spike vs running median
    grad_norm_metric: str = "actor/grad_norm"
    grad_norm_spike_factor: float | None = 5.0
    grad_norm_window: int = 10
    # entropy collapse (vs early level) and jump (vs running median)
    entropy_metric: str = "actor/entropy"
    entropy_collapse_fraction: float | None = 0.2
    entropy_patience: int = 2
    entropy_jump_factor: float | None = 3.0
    entropy_window: int = 10
    # reasoning collapse
    think_metric: str = "rollout/think_length"
    think_collapse_fraction: float | None = 0.25
    think_patience: int = 2
    # format errors rising
    format_error_metric: str = "rollout/format_error_rate"
    format_error_rise: float | None = 0.3
    format_error_patience: int = 2

    def __post_init__(self) -> None:
        for name in (
            "warmup",
            "std_collapse_patience",
            "grad_norm_window",
            "median_min_history",
            "entropy_patience",
            "entropy_window",
            "think_patience",
            "format_error_patience",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EchoTrapRules.{name}={getattr(self, name)} must be >= 1")
        if self.median_min_history > min(self.grad_norm_window, self.entropy_window):
            raise ValueError(
                f"EchoTrapRules.median_min_history={self.median_min_history} exceeds a running-median window "
                f"(grad_norm_window={self.grad_norm_window}, entropy_window={self.entropy_window}): the rule could "
                "never fire; lower it or widen the windows"
            )
        for name in ("std_collapse_fraction", "entropy_collapse_fraction", "think_collapse_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"EchoTrapRules.{name}={value} must lie in (0, 1), or be None to turn the rule off")
        for name in ("grad_norm_spike_factor", "entropy_jump_factor"):
            value = getattr(self, name)
            if value is not None and value <= 1:
                raise ValueError(f"EchoTrapRules.{name}={value} must be > 1, or be None to turn the rule off")
        if self.format_error_rise is not None and not 0 < self.format_error_rise < 1:
            raise ValueError(
                f"EchoTrapRules.format_error_rise={self.format_error_rise} must lie in (0, 1) (an absolute rise of a "
                "rate), or be None to turn the rule off"
            )


@dataclass(frozen=True)
class EchoTrapSignal:
    """One rule firing at one iteration, with its evidence."""

    rule: str  # e.g. "in_group_std_collapse"
    iteration: int  # the entry's "iteration" key, else its index in the history
    metric: str  # the metric the rule watches
    value: float  # the metric at that iteration
    reference: float  # the early level or the running median it was compared to
    threshold: float  # the bound that was crossed
    window: tuple[float, ...]  # the consecutive values that met the condition (patience rules) or the value
    message: str  # one human-readable line

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able) for logs, artifacts and reports."""
        out = asdict(self)
        out["window"] = list(self.window)
        return out


def _series(history: History, metric: str) -> list[tuple[int, float]]:
    """(iteration, value) of the entries holding ``metric``, in order (non-finite values included)."""
    out: list[tuple[int, float]] = []
    for index, entry in enumerate(history):
        if metric in entry and entry[metric] is not None:
            out.append((int(entry.get("iteration", index)), float(entry[metric])))
    return out


def _early_level_rule(
    history: History,
    *,
    rule: str,
    metric: str,
    warmup: int,
    patience: int,
    bound: Callable[[float], float],
    breached: Callable[[float, float], bool],
    describe: str,
) -> list[EchoTrapSignal]:
    """Fire when ``breached(value, bound(early))`` holds for ``patience`` consecutive post-warmup values."""
    series = [(it, v) for it, v in _series(history, metric) if math.isfinite(v)]
    if len(series) <= warmup:
        return []
    early = statistics.fmean(v for _, v in series[:warmup])
    threshold = bound(early)
    signals: list[EchoTrapSignal] = []
    streak: list[float] = []
    for it, v in series[warmup:]:
        streak = [*streak, v] if breached(v, threshold) else []
        if len(streak) >= patience:
            window = tuple(streak[-patience:])
            signals.append(
                EchoTrapSignal(
                    rule=rule,
                    iteration=it,
                    metric=metric,
                    value=v,
                    reference=early,
                    threshold=threshold,
                    window=window,
                    message=f"{metric}={v:.4g} {describe} {threshold:.4g} (early level {early:.4g}) "
                    f"for {patience} iteration(s) at iteration {it}",
                )
            )
    return signals


def _running_median_rule(
    history: History,
    *,
    rule: str,
    metric: str,
    factor: float,
    window: int,
    min_history: int,
    non_finite_fires: bool,
) -> list[EchoTrapSignal]:
    """Fire when a value exceeds ``factor`` x the median of the previous ``window`` finite values."""
    signals: list[EchoTrapSignal] = []
    previous: list[float] = []
    for it, v in _series(history, metric):
        if not math.isfinite(v):
            if non_finite_fires:
                ref = statistics.median(previous[-window:]) if previous else float("nan")
                signals.append(
                    EchoTrapSignal(
                        rule=rule,
                        iteration=it,
                        metric=metric,
                        value=v,
                        reference=ref,
                        threshold=factor * ref,
                        window=(v,),
                        message=f"{metric}={v} is not finite at iteration {it}",
                    )
                )
            continue
        recent = previous[-window:]
        if len(recent) >= min_history:
            median = statistics.median(recent)
            if median > 0 and v > factor * median:
                signals.append(
                    EchoTrapSignal(
                        rule=rule,
                        iteration=it,
                        metric=metric,
                        value=v,
                        reference=median,
                        threshold=factor * median,
                        window=(v,),
                        message=f"{metric}={v:.4g} > {factor:g} x running median {median:.4g} at iteration {it}",
                    )
                )
        previous.append(v)
    return signals


def detect_echo_trap(history: History, rules: EchoTrapRules | None = None) -> list[EchoTrapSignal]:
    """Run every enabled rule over ``history``; signals sorted by (iteration, rule).

    Args:
        history: one mapping per iteration, in order, of namespaced metric name -> float (see the
            module docstring); an optional ``"iteration"`` key names the iteration.
        rules: thresholds; None = ``EchoTrapRules()`` defaults.

    Returns:
        every firing of every rule (a rule whose condition persists fires at each such iteration).
    """
    r = rules if rules is not None else EchoTrapRules()
    signals: list[EchoTrapSignal] = []
    if r.std_collapse_fraction is not None:
        frac = r.std_collapse_fraction
        signals += _early_level_rule(
            history,
            rule="in_group_std_collapse",
            metric=r.std_metric,
            warmup=r.warmup,
            patience=r.std_collapse_patience,
            bound=lambda e: frac * e,
            breached=operator.lt,
            describe="<",
        )
    if r.grad_norm_spike_factor is not None:
        signals += _running_median_rule(
            history,
            rule="grad_norm_spike",
            metric=r.grad_norm_metric,
            factor=r.grad_norm_spike_factor,
            window=r.grad_norm_window,
            min_history=r.median_min_history,
            non_finite_fires=True,
        )
    if r.entropy_collapse_fraction is not None:
        efrac = r.entropy_collapse_fraction
        signals += _early_level_rule(
            history,
            rule="entropy_collapse",
            metric=r.entropy_metric,
            warmup=r.warmup,
            patience=r.entropy_patience,
            bound=lambda e: efrac * e,
            breached=operator.lt,
            describe="<",
        )
    if r.entropy_jump_factor is not None:
        signals += _running_median_rule(
            history,
            rule="entropy_jump",
            metric=r.entropy_metric,
            factor=r.entropy_jump_factor,
            window=r.entropy_window,
            min_history=r.median_min_history,
            non_finite_fires=False,
        )
    if r.think_collapse_fraction is not None:
        tfrac = r.think_collapse_fraction
        signals += _early_level_rule(
            history,
            rule="think_collapse",
            metric=r.think_metric,
            warmup=r.warmup,
            patience=r.think_patience,
            bound=lambda e: tfrac * e,
            breached=operator.lt,
            describe="<",
        )
    if r.format_error_rise is not None:
        rise = r.format_error_rise
        signals += _early_level_rule(
            history,
            rule="format_error_rise",
            metric=r.format_error_metric,
            warmup=r.warmup,
            patience=r.format_error_patience,
            bound=lambda e: e + rise,
            breached=operator.gt,
            describe=">",
        )
    return sorted(signals, key=lambda s: (s.iteration, s.rule))


def latest_signals(history: History, rules: EchoTrapRules | None = None) -> list[EchoTrapSignal]:
    """The signals that fire at the LAST entry of ``history`` (what a per-iteration guard acts on)."""
    if not history:
        return []
    last = history[-1]
    last_it = int(last.get("iteration", len(history) - 1))
    return [s for s in detect_echo_trap(history, rules) if s.iteration == last_it]


def first_signals(signals: Sequence[EchoTrapSignal]) -> dict[str, EchoTrapSignal]:
    """The earliest signal of each rule (the onsets to mark on plots)."""
    out: dict[str, EchoTrapSignal] = {}
    for s in sorted(signals, key=lambda s: s.iteration):
        out.setdefault(s.rule, s)
    return out

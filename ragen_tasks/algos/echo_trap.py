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
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

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


@dataclass(frozen=True)
class _Rule:
    """One row of the rule table (see ``_rule_table``)."""

    name: str
    kind: Literal["fraction_of_early", "rise_over_early", "times_median"]  # how the threshold applies
    metric: str
    threshold: float | None  # the fraction, rise or factor; None turns the rule off
    span: int  # patience (early-level rules) or running-median window
    non_finite_fires: bool = False  # times_median: a non-finite value is itself a firing


def _rule_table(r: EchoTrapRules) -> tuple[_Rule, ...]:
    """The six rules of the module docstring, as data."""
    # fmt: off
    return (
        #     name                     kind                 metric                 threshold                    span
        _Rule("in_group_std_collapse", "fraction_of_early", r.std_metric,          r.std_collapse_fraction,     r.std_collapse_patience),
        _Rule("grad_norm_spike",       "times_median",      r.grad_norm_metric,    r.grad_norm_spike_factor,    r.grad_norm_window, non_finite_fires=True),
        _Rule("entropy_collapse",      "fraction_of_early", r.entropy_metric,      r.entropy_collapse_fraction, r.entropy_patience),
        _Rule("entropy_jump",          "times_median",      r.entropy_metric,      r.entropy_jump_factor,       r.entropy_window),
        _Rule("think_collapse",        "fraction_of_early", r.think_metric,        r.think_collapse_fraction,   r.think_patience),
        _Rule("format_error_rise",     "rise_over_early",   r.format_error_metric, r.format_error_rise,         r.format_error_patience),
    )
    # fmt: on


def _early_level_rule(history: History, rule: _Rule, threshold: float, warmup: int) -> list[EchoTrapSignal]:
    """Fire when the value is below ``threshold`` x the early level (``fraction_of_early``) or above
    the early level + ``threshold`` (``rise_over_early``) for ``rule.span`` consecutive post-warmup values."""
    series = [(it, v) for it, v in _series(history, rule.metric) if math.isfinite(v)]
    if len(series) <= warmup:
        return []
    early = statistics.fmean(v for _, v in series[:warmup])
    below = rule.kind == "fraction_of_early"
    bound = threshold * early if below else early + threshold
    signals: list[EchoTrapSignal] = []
    streak: list[float] = []
    for it, v in series[warmup:]:
        streak = [*streak, v] if (v < bound if below else v > bound) else []
        if len(streak) >= rule.span:
            signals.append(
                EchoTrapSignal(
                    rule=rule.name,
                    iteration=it,
                    metric=rule.metric,
                    value=v,
                    reference=early,
                    threshold=bound,
                    window=tuple(streak[-rule.span :]),
                    message=f"{rule.metric}={v:.4g} {'<' if below else '>'} {bound:.4g} (early level {early:.4g}) "
                    f"for {rule.span} iteration(s) at iteration {it}",
                )
            )
    return signals


def _running_median_rule(history: History, rule: _Rule, factor: float, min_history: int) -> list[EchoTrapSignal]:
    """Fire when a value exceeds ``factor`` x the median of the previous ``rule.span`` finite values."""
    metric, window = rule.metric, rule.span
    signals: list[EchoTrapSignal] = []
    previous: list[float] = []
    for it, v in _series(history, metric):
        if not math.isfinite(v):
            if rule.non_finite_fires:
                ref = statistics.median(previous[-window:]) if previous else float("nan")
                signals.append(
                    EchoTrapSignal(
                        rule=rule.name,
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
                        rule=rule.name,
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
    for rule in _rule_table(r):
        if rule.threshold is None:
            continue
        if rule.kind == "times_median":
            signals += _running_median_rule(history, rule, rule.threshold, r.median_min_history)
        else:
            signals += _early_level_rule(history, rule, rule.threshold, r.warmup)
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

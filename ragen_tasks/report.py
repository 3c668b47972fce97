"""The run report: one static HTML file with learning curves, Echo-Trap panels and sample
trajectories (rendered boards and the agent's reasoning, turn by turn).

Inputs are plain data: the per-iteration metric history (list of flat dicts with namespaced keys,
as the training flow records them), the guard's fired signals, and a few trajectories. Plots are
PNG images embedded as base64, so the file can be copied or attached anywhere. The page is the
Jinja template ``templates/report.html.j2`` (autoescaped).
"""

from __future__ import annotations

import base64
import fnmatch
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from ragen_tasks.data.trajectory import Trajectory

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("ragen_tasks", "templates"), autoescape=True, undefined=jinja2.StrictUndefined
)

# (title, metric keys plotted together). Keys missing from the history are skipped; a ``*`` stands
# for one path segment (an env name) and expands to every matching key present.
PANELS: list[tuple[str, list[str]]] = [
    ("Success rate (rollouts)", ["rollout/success", "rollout/*/success"]),  # per env in a mixture
    ("Trajectory reward (rollouts)", ["rollout/reward_mean"]),
    ("Held-out evaluation success (-1 = before RL)", ["eval/*/success"]),
    ("In-group reward std (Echo Trap: collapses first)", ["rollout/in_group_std", "filter/kept_in_group_std_mean"]),
    ("Policy entropy", ["actor/entropy"]),
    ("Gradient norm (pre-clip)", ["actor/grad_norm"]),
    ("Response length (tokens)", ["rollout/response_length"]),
    ("Think length (chars per turn)", ["rollout/think_length"]),
    ("Format error rate", ["rollout/format_error_rate"]),
]


def _expand(patterns: Sequence[str], present: set[str]) -> list[str]:
    """Panel keys with each ``*`` pattern replaced by the matching keys present (one segment per ``*``)."""
    keys: list[str] = []
    for pattern in patterns:
        if "*" not in pattern:
            keys.append(pattern)
            continue
        depth = pattern.count("/")
        keys += sorted(k for k in present if k.count("/") == depth and fnmatch.fnmatchcase(k, pattern))
    return keys


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in history:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(float(value)):
            xs.append(int(row["iteration"]))
            ys.append(float(value))
    return xs, ys


def _plot_png(
    title: str, keys: Sequence[str], history: Sequence[Mapping[str, Any]], signals: Sequence[Mapping[str, Any]]
) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [(key, *_series(history, key)) for key in keys]
    lines = [line for line in lines if line[1]]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(5.2, 3.0), dpi=100)
    for key, xs, ys in lines:
        ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, label=key)
    for signal in signals:  # where the Echo-Trap guard fired
        ax.axvline(int(signal["iteration"]), color="crimson", linestyle="--", linewidth=0.9, alpha=0.7)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("iteration", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _results_rows(summary: Mapping[str, Any]) -> list[dict[str, str]]:
    """Per game: held-out success before RL (the warm start) and after, RL's gain (two-proportion z and
    the paired exact McNemar p on the same seeds), random play and the ceiling at the agent's budget on
    the same seeds, formatted for the results table."""
    before, after = summary.get("eval_before_rl", {}), summary.get("eval_after_rl", {})
    reference, gain = summary.get("reference", {}), summary.get("rl_gain_z", {})
    paired = summary.get("rl_gain_paired", {})

    def rate(value: Any) -> str:
        return "-" if value is None else f"{float(value):.3f}"

    return [
        {
            "game": env,
            "before": rate(before[env].get("success")),
            "after": rate(after.get(env, {}).get("success")),
            "z": "-" if env not in gain else f"{float(gain[env]):+.2f}",
            "paired_p": "-" if env not in paired else f"{float(paired[env]['p']):.2g}",
            "random": rate(reference.get(env, {}).get("random")),
            "ceiling": rate(reference.get(env, {}).get("ceiling")),
            "seeds": str(int(before[env].get("episodes", 0))),
        }
        for env in sorted(before)
    ]


def write_report(
    path: Path,
    *,
    title: str,
    history: Sequence[Mapping[str, Any]],
    signals: Sequence[Mapping[str, Any]] = (),
    samples: Sequence[Trajectory] = (),
    summary: Mapping[str, Any] | None = None,
) -> Path:
    """Write the HTML report to ``path`` (atomically: temp file, then rename) and return it."""
    present = {k for row in history for k in row}
    plots = [(t, png) for t, keys in PANELS if (png := _plot_png(t, _expand(keys, present), history, signals))]
    page = _TEMPLATES.get_template("report.html.j2").render(
        title=title,
        summary=summary,
        results=_results_rows(summary) if summary else [],
        summary_json=json.dumps(summary, indent=2, default=str) if summary else "",
        signals=[
            {"iteration": s["iteration"], "rule": str(s.get("rule")), "message": str(s.get("message", ""))}
            for s in signals
        ],
        plots=plots,
        samples=samples,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path

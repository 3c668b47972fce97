"""The run report: one static HTML file with learning curves, Echo-Trap panels and sample
trajectories (rendered boards and the agent's reasoning, turn by turn).

Inputs are plain data: the per-iteration metric history (list of flat dicts with namespaced keys,
as the training flow records them), the guard's fired signals, and a few trajectories. Plots are
PNG images embedded as base64, so the file can be copied or attached anywhere.
"""

from __future__ import annotations

import base64
import fnmatch
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ragen_tasks.data.trajectory import Trajectory

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


def _trajectory_html(traj: Trajectory) -> str:
    head = (
        f"<h3>{html.escape(traj.env_name)} seed {traj.seed} (group {traj.group_id}): reward {traj.reward:.2f}, "
        f"{'success' if traj.success else 'no success'}, {traj.num_turns} turns, status {html.escape(traj.status)}</h3>"
    )
    rows = []
    for k in range(traj.num_turns):
        rows.append(
            "<tr>"
            f"<td><pre>{html.escape(traj.turn_observations[k])}</pre></td>"
            f"<td><pre class='resp'>{html.escape(traj.turn_responses[k])}</pre></td>"
            f"<td>{html.escape(' | '.join(traj.turn_actions[k]) or '-')}</td>"
            f"<td>{traj.turn_rewards[k]:+.2f}{'' if traj.turn_format_ok[k] else ' (format penalty)'}</td>"
            "</tr>"
        )
    table = "<table><tr><th>board shown</th><th>agent response</th><th>actions run</th><th>reward</th></tr>"
    return head + table + "".join(rows) + "</table>"


def _results_html(summary: Mapping[str, Any]) -> str:
    """Per game: held-out success before RL (the warm start) and after, RL's z, random play and the
    ceiling at the agent's budget on the same seeds."""
    before, after = summary.get("eval_before_rl", {}), summary.get("eval_after_rl", {})
    reference, gain = summary.get("reference", {}), summary.get("rl_gain_z", {})

    def rate(value: Any) -> str:
        return "-" if value is None else f"{float(value):.3f}"

    rows = [
        f"<tr><td>{html.escape(env)}</td><td>{rate(before[env].get('success'))}</td>"
        f"<td>{rate(after.get(env, {}).get('success'))}</td>"
        f"<td>{'-' if env not in gain else f'{float(gain[env]):+.2f}'}</td>"
        f"<td>{rate(reference.get(env, {}).get('random'))}</td><td>{rate(reference.get(env, {}).get('ceiling'))}</td>"
        f"<td>{int(before[env].get('episodes', 0))}</td></tr>"
        for env in sorted(before)
    ]
    head = (
        "<h2>Held-out success per game</h2><table><tr><th>game</th><th>before RL (warm start)</th>"
        "<th>after RL</th><th>z (RL gain)</th><th>random play</th><th>ceiling at this budget</th><th>seeds</th></tr>"
    )
    return head + "".join(rows) + "</table>"


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
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1200px} img{margin:4px;border:1px solid #ddd}"
        " table{border-collapse:collapse;margin-bottom:1.5em} td,th{border:1px solid #ccc;padding:4px;vertical-align:top;"
        "font-size:12px} pre{margin:0;font-family:monospace} pre.resp{white-space:pre-wrap;max-width:420px}"
        " .sig{color:crimson}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if summary:
        parts.append(_results_html(summary))
        parts.append(f"<h2>Summary</h2><pre>{html.escape(json.dumps(summary, indent=2, default=str))}</pre>")
    if signals:
        parts.append("<h2 class='sig'>Echo-Trap guard signals</h2><ul>")
        for s in signals:
            parts.append(
                f"<li class='sig'>iteration {s['iteration']}: <b>{html.escape(str(s.get('rule')))}</b> "
                f"{html.escape(str(s.get('message', '')))}</li>"
            )
        parts.append("</ul>")
    parts.append("<h2>Learning curves</h2><div>")
    for panel_title, keys in PANELS:
        png = _plot_png(panel_title, _expand(keys, present), history, signals)
        if png:
            parts.append(f"<img alt='{html.escape(panel_title)}' src='data:image/png;base64,{png}'>")
    parts.append("</div>")
    if samples:
        parts.append("<h2>Sample trajectories (last iteration)</h2>")
        parts.extend(_trajectory_html(t) for t in samples)
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(parts), encoding="utf-8")
    tmp.replace(path)
    return path

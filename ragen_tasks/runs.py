"""End of a run: ``summary.json`` and the HTML report, from what the store holds.

``summary.json`` (in the run folder) holds the preset, iterations, the final checkpoint, and the
held-out evaluation of the policy BEFORE RL (checkpoint 0, after the warm start) and AFTER RL
(the final checkpoint), per env, so the learning it shows is RL's; beside them, per env, the
game's reference points on the same seeds (ceiling at the agent's budget, random play), and RL's
gain in success over the warm start twice over: the one-sided two-proportion z (``rl_gain_z``) and,
as both evaluations play the same seeds, the paired exact McNemar test (``rl_gain_paired``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ragen_tasks import pipeline
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.evaluation import one_sided_z, pair_outcomes, reference_points
from ragen_tasks.report import write_report

log = logging.getLogger(__name__)


def _samples(run: pipeline.Run, iteration: int, per_env: int = 2) -> list[Trajectory]:
    """A success and a failure per env from the iteration's rollouts (whatever exists)."""
    if iteration < 0 or not run.store.has_manifest(run.run_id, iteration, "rollouts"):
        return []
    trajectories, _ = run.store.read_trajectories(run.run_id, iteration, "rollouts")
    picked: list[Trajectory] = []
    for env in sorted({t.env_name for t in trajectories}):
        mine = [t for t in trajectories if t.env_name == env]
        wins = [t for t in mine if t.success]
        losses = [t for t in mine if not t.success]
        picked.extend((wins[:1] + losses[:1] + mine)[:per_env])
    return picked


def write_run_report(run: pipeline.Run, summary: dict[str, Any] | None = None) -> Path:
    rows = pipeline.history(run)
    if run.store.has_manifest(run.run_id, 0, "eval", "initial"):  # the before-RL point, plotted at iteration -1
        initial = run.store.read_json(run.run_id, 0, "eval", "initial")[0]
        rows = [{"iteration": -1, **pipeline.flatten_eval(initial)}, *rows]
    signals = [s for row in rows for s in row.get("guard/signals", []) or []]
    last = rows[-1]["iteration"] if rows else -1
    path = write_report(
        run.run_dir / "report.html",
        title=f"RAGEN run {run.run_id}",
        history=rows,
        signals=signals,
        samples=_samples(run, last),
        summary=summary,
    )
    publish_run_files(run)
    return path


def finish_run(
    run: pipeline.Run, *, warm_start: dict[str, Any], stopped: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Evaluate before/after RL, write ``summary.json`` and ``report.html``; return the summary."""
    rows = pipeline.history(run)
    final_step = int(rows[-1]["policy/next_step"]) if rows else 0
    if stopped and stopped.get("last_healthy_step") is not None:
        # A run the guard stopped hands on its last healthy checkpoint, not the collapsed one.
        stopped = {**stopped, "collapsed_step": final_step}
        final_step = int(stopped["last_healthy_step"])
    initial = pipeline.initial_eval(run)
    before = initial["envs"]
    final: dict[str, Any] = {}
    if rows:  # the final policy's held-out evaluation (a no-op if the last iteration already ran it)
        name = "eval" if final_step == int(rows[-1]["policy/next_step"]) else "final"
        final = pipeline.evaluate(run, len(rows) - 1, final_step, name=name)
    after: dict[str, dict[str, float]] = dict(final.get("envs", {}))
    config = run.config
    reference = {  # one spec per game name: evaluation aggregates by name
        spec.name: reference_points(spec, config.agent, seeds=config.eval.seeds, seed_offset=config.eval.seed_offset)
        for spec in {spec.name: spec for spec in reversed(config.envs)}.values()
    }
    summary: dict[str, Any] = {
        "run_id": run.run_id,
        "preset": config.preset,
        "iterations": len(rows),
        "final_checkpoint": str(run.checkpoint_path(final_step)),
        "store": run.store.uri(run.run_id),
        "warm_start": warm_start,
        "eval_before_rl": before,
        "eval_after_rl": after,
        "final_eval": after,
        "reference": reference,
        "rl_gain_z": {
            env: one_sided_z(b["success"], b["episodes"], after[env]["success"], after[env]["episodes"])
            for env, b in before.items()
            if env in after
        },
        "rl_gain_paired": rl_gain_paired(initial.get("per_seed", {}), final.get("per_seed", {})),
    }
    if stopped:
        summary["stopped"] = stopped
    run.run_dir.mkdir(parents=True, exist_ok=True)
    summary["report"] = str(run.run_dir / "report.html") if run.is_local else f"{run.uri}/report.html"
    tmp = run.run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(run.run_dir / "summary.json")
    write_run_report(run, summary)  # publishes both files to an s3:// store
    return summary


def rl_gain_paired(
    before: Mapping[str, Sequence[Mapping[str, Any]]], after: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, dict[str, float]]:
    """RL's gain per env, paired seed by seed on the held-out seeds both evaluations played:
    ``{env: {"seeds", "gains" (solved after RL only), "losses" (before only), "p"}}``, p the exact
    one-sided McNemar p of "RL solves more" (``evaluation.PairedOutcomes.p_second_better``). Envs
    whose evaluations kept no per-seed outcomes are left out."""
    out = {}
    for env in sorted(set(before) & set(after)):
        pair = pair_outcomes(before[env], after[env], env, names=("evaluation before RL", "evaluation after RL"))
        out[env] = {
            "seeds": pair.seeds,
            "gains": pair.second_only,
            "losses": pair.first_only,
            "p": pair.p_second_better(),
        }
    return out


RUN_FILES = ("summary.json", "report.html")


def publish_run_files(run: pipeline.Run) -> None:
    """On an s3:// store, copy ``summary.json`` and ``report.html`` from the local scratch into the
    run's folder in the store: a pod's scratch is gone when the pod is."""
    if run.is_local:
        return
    for name in RUN_FILES:
        path = run.run_dir / name
        if path.is_file():
            run.store.put_object(f"{run.run_id}/{name}", path.read_bytes())


def stored_summary(run: pipeline.Run) -> dict[str, Any] | None:
    """The run's ``summary.json``: from the run folder (local store) or the store (s3://), if written."""
    path = run.run_dir / "summary.json"
    if run.is_local:
        return json.loads(path.read_text()) if path.is_file() else None
    data = run.store.get_object(f"{run.run_id}/summary.json")
    return None if data is None else dict(json.loads(data))

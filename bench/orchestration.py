"""Where an iteration's wall time goes: Prefect, the data plane, or compute (issue 7's benchmark).

Runs the training flow (real Prefect temporary API, real store, real GX) for a few iterations of a
preset and splits each iteration's wall time, from the timings the flow and the stages record:

* compute     = rollout (model load + multi-turn rollout) + the PPO update itself
* data plane  = everything else inside the stage functions: store reads/writes and manifests,
                Great Expectations validation, freshness, filtering, checkpoint save/load
* Prefect     = task-call wall time minus the stage functions' own wall time (task submission,
                state tracking) + the flow's per-iteration bookkeeping (guard, the record-iteration
                commit, artifacts, logging)

An iteration's wall time runs from its start to the next iteration's start (the flow stamps each),
so nothing between two iterations is missed; the last iteration has no successor and is left out.

Shares are the mean over the steady-state iterations: all but the first (iteration 0 also pays
one-off costs such as building Great Expectations' context, reported separately) and but those that
ran the periodic held-out evaluation (the run's last iteration always does: its extra time is
evaluation rollouts, i.e. compute that the stage timings do not split out, so it is left out rather
than counted as orchestration).

Usage::

    python bench/orchestration.py [--preset default] [--iterations 4] [--set key=value ...] [--store DIR]

``--store``: run in that store root (default: a temporary folder) under ``--run-id`` (default
``bench-orchestration``); a store that already holds the preset's warm start takes it from the
cache, so repeated measurements skip it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--store", default=None, help="store root (default: a temporary folder)")
    parser.add_argument("--run-id", default="bench-orchestration")
    args = parser.parse_args()

    from flows.train import train
    from ragen_tasks import pipeline
    from ragen_tasks.presets import parse_override

    overrides = {".".join(k): v for k, v in map(parse_override, args.overrides)}
    overrides.update({"iterations": args.iterations, "eval.every": 10_000})  # no mid-run eval: iterations only
    with tempfile.TemporaryDirectory() as tmp:
        root = args.store or tmp
        t0 = time.perf_counter()
        summary = train(preset=args.preset, overrides=overrides, run_id=args.run_id, store_root=root)
        total = time.perf_counter() - t0
        rows = pipeline.history(pipeline.open_existing_run(str(Path(root) / args.run_id)))

    shares = []
    # An iteration's whole wall time: from its start to the next iteration's start, so its own commit
    # (record-iteration), artifacts, logging and guard count too. The last row has no successor.
    starts = [row["timing/iteration_start_unix"] for row in rows]
    for row, start, next_start in zip(rows[:-1], starts[:-1], starts[1:], strict=True):
        stage_walls = {  # the stage functions' own wall times
            "generate_tasks": row.get("timing/generate_tasks_s"),
            "rollout": row["timing/rollout_s"],
            "filter_and_validate": row["timing/filter_s"],
            "update": row["timing/update_stage_s"],
        }
        task_walls = {k: row.get(f"timing/{k}_task_s", 0.0) for k in stage_walls}
        iteration = next_start - start
        compute = row["timing/rollout_compute_s"] + row["timing/update_s"]
        inside = sum(v for v in stage_walls.values() if v is not None)
        # A stage without an inner timer (generate_tasks in rows recorded before it had one) counts
        # wholly as data plane through its task wall (conservative for Prefect).
        prefect = sum(task_walls[k] - v for k, v in stage_walls.items() if v is not None) + (
            iteration - sum(task_walls.values())
        )
        data = iteration - compute - prefect
        shares.append(
            {
                "iteration_s": iteration,
                "compute_s": compute,
                "data_s": data,
                "prefect_s": prefect,
                "inside_stages_s": inside,
            }
        )

    evaluated = [any(k.startswith("eval/") for k in row) for row in rows[: len(shares)]]
    first = shares[0]  # iteration 0 pays one-off costs (GX context build)
    steady = [s for s, ev in zip(shares[1:], evaluated[1:], strict=True) if not ev] or shares

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in steady)

    it_s = mean("iteration_s")
    steady_rows = [r for r, ev in zip(rows[1 : len(shares)], evaluated[1:], strict=True) if not ev] or rows
    # where the non-compute time goes (means over the steady-state iterations, seconds)
    timing_keys = sorted({k for r in steady_rows for k in r if k.startswith("timing/") and not k.endswith("_unix")})
    breakdown = {
        k.removeprefix("timing/"): round(statistics.fmean(r.get(k, 0.0) for r in steady_rows), 4) for k in timing_keys
    }
    result = {
        "preset": args.preset,
        "iterations": len(rows),
        "first_iteration": {k: round(v, 3) for k, v in first.items()},
        "steady_state_iterations": len(steady),
        "iteration_s": round(it_s, 3),
        "compute_share": round(mean("compute_s") / it_s, 4),
        "data_plane_share": round(mean("data_s") / it_s, 4),
        "prefect_share": round(mean("prefect_s") / it_s, 4),
        "orchestration_plus_data_share": round((mean("data_s") + mean("prefect_s")) / it_s, 4),
        "whole_run_s": round(total, 1),
        "timings_s": breakdown,
        "summary_eval_after_rl": summary.get("eval_after_rl"),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

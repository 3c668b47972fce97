"""Echo-Trap guard benchmark: when does the detector fire vs when does success drop, and what does
rollback buy at the end of the run?

For each seed the collapse preset is trained twice through the real training flow (in one process,
one temporary Prefect API): ``collapse-grpo`` with ``guard.action=off`` and ``collapse-grpo-rollback``
(the same run, guard in rollback mode with its mitigation). Runs are
sequential (the CPU is shared). For the ``off`` run the detector is replayed over the recorded
history (it never looks ahead, so this is where ``warn`` would have fired).

* fired: first iteration where any rule fires (and which rules);
* success drop: first iteration whose rollout success is below ``drop_fraction`` x the success of
  iteration 0 (the warm-started policy, before any update) and stays below it for the rest of the
  run or at least ``drop_patience`` iterations;
* final success: held-out evaluation (greedy, fixed seeds) of the final policy, and the rollout
  success of the last iteration.

Usage::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/echo_trap.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def success_drop(rows: list[dict[str, Any]], *, fraction: float, patience: int) -> int | None:
    """First iteration whose rollout success < ``fraction`` x iteration 0's, for ``patience``
    iterations in a row (or until the end of the run)."""
    values = [row.get("rollout/success") for row in rows]
    if not values or values[0] is None:
        return None
    bound = fraction * float(values[0])
    for k in range(1, len(values)):
        window = values[k : k + patience]
        if all(v is not None and float(v) < bound for v in window):
            return int(rows[k]["iteration"])
    return None


def first_firing(rows: list[dict[str, Any]], rules: Any) -> tuple[int | None, list[str]]:
    """Replay the detector over the history: (first iteration that fired, rules that fired there)."""
    from ragen_tasks.algos.echo_trap import detect_echo_trap

    signals = detect_echo_trap(rows, rules)
    if not signals:
        return None, []
    first = signals[0].iteration
    return first, sorted({s.rule for s in signals if s.iteration == first})


def run_one(
    preset: str, seed: int, action: str, root: Path, extra: dict[str, Any], *, drop_fraction: float, drop_patience: int
) -> dict[str, Any]:
    from flows.train import train
    from ragen_tasks import guard, pipeline

    run_id = f"{preset}-s{seed}-{action}"
    t0 = time.perf_counter()
    summary = train(
        preset=preset,
        overrides={"seed": seed, "optim.seed": seed, "guard.action": action, **extra},
        run_id=run_id,
        store_root=str(root),
    )
    wall = time.perf_counter() - t0
    run = pipeline.open_existing_run(str(root / run_id))
    rows = pipeline.history(run)
    env = next(iter(summary["eval_after_rl"]))
    stopped = summary.get("stopped") or {}
    eval_healthy = None  # a stopped run's deliverable is its last healthy checkpoint: evaluate that too
    if stopped.get("last_healthy_checkpoint"):
        per_env, _ = pipeline.evaluate_checkpoint(run.config, Path(stopped["last_healthy_checkpoint"]))
        eval_healthy = per_env[env]["success"]
    if action == "off":
        fired, fired_rules = first_firing(rows, guard.rules(run.config.guard))
    else:
        firing = [row for row in rows if row.get("guard/signals")]
        fired = int(firing[0]["iteration"]) if firing else None
        fired_rules = sorted({s["rule"] for s in firing[0]["guard/signals"]}) if firing else []
    return {
        "seed": seed,
        "action": action,
        "wall_s": round(wall, 1),
        "iterations": len(rows),
        "fired": fired,
        "fired_rules": fired_rules,
        "success_drop": success_drop(rows, fraction=drop_fraction, patience=drop_patience),
        "rollout_success": [row.get("rollout/success") for row in rows],
        "actions": [row.get("guard/action") for row in rows],
        "rollbacks": int(rows[-1].get("guard/rollbacks", 0)) if rows else 0,
        "stopped": stopped.get("iteration"),
        "eval_healthy": eval_healthy,
        "eval_before": summary["eval_before_rl"][env]["success"],
        "eval_after": summary["eval_after_rl"][env]["success"],
        "last_rollout_success": rows[-1].get("rollout/success") if rows else None,
    }


def main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("ragen_tasks").setLevel(logging.WARNING)
    root = Path(args.store or tempfile.mkdtemp(prefix="echo-trap-"))
    extra = dict(json.loads(args.set)) if args.set else {}
    results = []
    t0 = time.perf_counter()
    for seed in args.seeds:
        for action in args.actions:
            result = run_one(
                args.rollback_preset if action == "rollback" else args.preset,
                seed,
                action,
                root,
                extra,
                drop_fraction=args.drop_fraction,
                drop_patience=args.drop_patience,
            )
            results.append(result)
            print(json.dumps(result), flush=True)
    total = time.perf_counter() - t0
    print(
        "\n| seed | guard | detector fired (rules) | success dropped | rollbacks | stopped at | held-out success: "
        "final policy | last healthy ckpt (stopped runs) | last rollout success | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['seed']} | {r['action']} | {r['fired']} ({', '.join(r['fired_rules']) or '-'}) | "
            f"{r['success_drop']} | {r['rollbacks']} | {r['stopped']} | {r['eval_after']:.3f} | {r['eval_healthy']} | {r['last_rollout_success']:.3f} | "
            f"{r['wall_s']:.0f} |"
        )
    for action in args.actions:
        mine = [r for r in results if r["action"] == action]
        print(
            f"mean held-out success after RL, guard {action}: {statistics.fmean(r['eval_after'] for r in mine):.3f} "
            f"(before RL {statistics.fmean(r['eval_before'] for r in mine):.3f}); "
            f"mean last rollout success {statistics.fmean(r['last_rollout_success'] for r in mine):.3f}"
        )
    print(f"total wall {total:.0f} s; store {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="collapse-grpo")
    parser.add_argument("--rollback-preset", default="collapse-grpo-rollback", help="preset of the rollback runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--actions", nargs="+", default=["off", "rollback"])
    parser.add_argument("--store", default=None, help="store root (default: a temp folder)")
    parser.add_argument("--set", default=None, help="extra overrides as JSON, e.g. '{\"iterations\": 10}'")
    parser.add_argument("--drop-fraction", type=float, default=0.5)
    parser.add_argument("--drop-patience", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(args)

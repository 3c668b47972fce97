"""Sharded rollouts: wall time of one rollout batch with ``rollout.shards`` = 1 vs N local processes.

``play_checkpoint`` on the tiny preset (random init) over ``--groups`` x ``--group-size`` tasks of
``--env``; each configuration ``--repeats`` times, best and median wall seconds, and the CPU seconds
(user + system, this process and its shard processes) of the best run: on a shared host the wall
time follows the other load, the CPU time is the work. A process shard
pays its start-up on every call (spawn, import torch + transformers, load the checkpoint), so the
table also gives the start-up alone: a batch of one task per shard. Also checks that N shards give
the one-engine tokens (log-probs to float rounding, see hf_engine's "Batch composition").

    HF_HUB_OFFLINE=1 .venv/bin/python bench/rollout_shards.py [--shards 1 2] [--groups 16] [--group-size 8] [--threads T]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ragen_tasks.config import EnvSpec
from ragen_tasks.models import ensure_preset
from ragen_tasks.pipeline.policy import play_checkpoint
from ragen_tasks.presets import load_config
from ragen_tasks.rollout.loop import make_group_tasks


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its ended children (the shard processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--env", default="frozen_lake")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the stage (split among shards)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    folder = ensure_preset("tiny", Path(tempfile.mkdtemp(prefix="ragen-bench-")))
    specs = [EnvSpec(name=args.env)]
    tasks = make_group_tasks(specs, args.groups, args.group_size, seed=0, iteration=0)
    kwargs = {"temperature": 1.0, "seed": 0, "policy_version": 0, "weights_fingerprint": "bench"}
    print(f"torch threads={torch.get_num_threads()}  tasks={len(tasks)} ({args.env})  repeats={args.repeats}")
    print(
        "| shards | batch wall s (best) | median | CPU s (best run) | start-up only: wall s, CPU s (1 task per shard) | same tokens as 1 shard |"
    )
    print("|---|---|---|---|---|---|")
    reference = None
    for n in args.shards:
        config = load_config("tiny-base", {"envs": [s.model_dump() for s in specs], "rollout.shards": n})
        walls, cpus = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), cpu_seconds()
            trajectories = play_checkpoint(config, folder, tasks, **kwargs)
            walls.append(time.perf_counter() - t0)
            cpus.append(cpu_seconds() - c0)
        one_each = [tasks[g * args.group_size] for g in range(min(n, args.groups))]
        t0, c0 = time.perf_counter(), cpu_seconds()
        play_checkpoint(config, folder, one_each, **kwargs)
        startup, startup_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        reference = reference or [t.input_ids for t in trajectories]
        same = [t.input_ids for t in trajectories] == reference
        best = walls.index(min(walls))
        print(
            f"| {n} | {walls[best]:.2f} | {statistics.median(walls):.2f} | {cpus[best]:.2f} "
            f"| {startup:.2f}, {startup_cpu:.2f} | {same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

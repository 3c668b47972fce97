"""The update on 1 vs 2 data-parallel ranks on this CPU, the same work: tokens/s.

One rank uses ``--threads`` threads in this process; N ranks run under torchrun with
``--threads / N`` threads each (the same cores). Each setting runs ``--rounds`` updates of the
``small`` preset on the spread batch of ``bench/update.py`` (32 episodes, 170-590 tokens, GRPO, one
minibatch of 32, micro-batches of 8 rows) and keeps the best. The ranks' startup (torchrun, imports,
process group) is reported apart: in the pipeline it is paid once per update stage.
Run: .venv/bin/python bench/update_ranks.py [--ranks 2] [--threads 2] [--rounds 3] [--backend torch]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update import preset_model, spread_batch

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.update import ppo_update


def best_update(backend: str, rounds: int) -> dict[str, float]:
    """The fastest of ``rounds`` updates (after one warm-up) on this process's ranks."""
    module = preset_model("small")
    optim = OptimConfig(backend=backend, zero_stage=2, lr=1e-5, minibatch_size=32, micro_batch_size=8)
    actor = make_train_model(module, make_optimizer(module, lr=optim.lr, weight_decay=0.0), optim)
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    batch, generator = spread_batch(), torch.Generator().manual_seed(0)
    ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=generator)
    runs = [ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=generator) for _ in range(rounds)]
    return min(runs, key=lambda m: m["timing/update_s"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="torch", choices=["torch", "deepspeed"])
    p.add_argument("--rank-out", help=argparse.SUPPRESS)  # set when this script runs as a rank
    args = p.parse_args()
    if args.rank_out:
        from ragen_tasks.training.distributed import exit_finished_rank, init_from_env

        ranks = init_from_env()
        result = best_update(args.backend, args.rounds)
        if ranks.is_main:
            Path(args.rank_out).write_text(json.dumps(result))
        exit_finished_rank()

    torch.set_num_threads(args.threads)
    one = best_update(args.backend, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(args.threads // args.ranks, 1))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
        cmd += [__file__, "--backend", args.backend, "--rounds", str(args.rounds), "--rank-out", str(out)]
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        many = json.loads(out.read_text())
    print(f"small preset, {args.backend} backend, {args.threads} threads in all, best of {args.rounds} updates")
    print("| ranks | threads per rank | update s | tokens/s | vs 1 rank |")
    print("|---|---|---|---|---|")
    for n, m in ((1, one), (args.ranks, many)):
        print(
            f"| {n} | {args.threads // n} | {m['timing/update_s']:.2f} | {m['perf/tokens_per_s']:.0f} | "
            f"{one['timing/update_s'] / m['timing/update_s']:.2f}x |"
        )
    print(f"{args.ranks}-rank launch, warm-up and {args.rounds} updates: {wall:.1f} s wall")


if __name__ == "__main__":
    main()

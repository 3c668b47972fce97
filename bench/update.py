"""Update-stage throughput on this CPU: tokens/s and achieved FLOP/s vs the measured torch.mm peak.

FLOP/s = 6 x params x tokens / update time (forward + backward of the training pass). The no-grad
old-log-prob pass (another 2 x params x tokens) is NOT counted, so the fraction is conservative:
a perfectly efficient update would show 75% of the matmul peak.

The machine is shared and noisy, so every configuration and the fp32 ``torch.mm`` peak (1024^3)
are measured in interleaved rounds and the best of each is kept; ratios come from one run.
Run: .venv/bin/python bench/update.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import torch
from transformers import Qwen2ForCausalLM

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.synthetic import synthetic_trajectories
from ragen_tasks.data.token_batch import collate
from ragen_tasks.models.presets import PRESETS, qwen2_model
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.update import ppo_update


def mm_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 8) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def preset_model(name: str) -> Qwen2ForCausalLM:
    """The preset's architecture (vocab 1024) with a seeded random init; no tokenizer needed."""
    return qwen2_model(replace(PRESETS[name], max_position_embeddings=1024), vocab_size=PRESETS[name].vocab_size)


def setup(name: str, amp: str, micro: int) -> dict[str, Any]:
    actor_m = preset_model(name)
    optim = OptimConfig.model_validate({"lr": 1e-5, "minibatch_size": 32, "micro_batch_size": micro, "amp_dtype": amp})
    actor = make_train_model(actor_m, make_optimizer(actor_m, lr=optim.lr, weight_decay=0.0), optim)
    return {
        "actor": actor,
        "optim": optim,
        "params": sum(p.numel() for p in actor_m.parameters()),
        "gen": torch.Generator().manual_seed(0),
        "best": None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    batch = collate(
        synthetic_trajectories(n_groups=8, group_size=4, vocab=1000, turns=4, prompt_len=48, resp_len=40, obs_len=24)
    )  # 32 trajectories x 280 tokens
    configs = {(n, a, m): setup(n, a, m) for n in ("tiny", "small") for a in ("float32", "bfloat16") for m in (8, 32)}
    peak32 = peak16 = 0.0
    for c in configs.values():  # warm-up
        ppo_update(batch, actor=c["actor"], algo=algo, optim=c["optim"], generator=c["gen"])
    for _ in range(args.rounds):
        peak32 = max(peak32, mm_gflops(torch.float32))
        peak16 = max(peak16, mm_gflops(torch.bfloat16))
        for c in configs.values():
            m = ppo_update(batch, actor=c["actor"], algo=algo, optim=c["optim"], generator=c["gen"])
            if c["best"] is None or m["timing/update_s"] < c["best"]["timing/update_s"]:
                c["best"] = m
    print(
        f"torch.mm best-of-{args.rounds} peak ({args.threads} threads): fp32 {peak32:.0f} GFLOP/s, "
        f"bf16 {peak16:.0f} GFLOP/s; batch {batch.batch_size} x {batch.seq_len} tokens, minibatch 32"
    )
    print("| model | params | compute | micro | update s | tokens/s | GFLOP/s (6NT) | % fp32 mm peak | bf16 speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, amp, micro), c in configs.items():
        b = c["best"]
        gflops = 6 * c["params"] * b["perf/tokens"] / b["timing/update_s"] / 1e9
        base = configs[(name, "float32", micro)]["best"]["timing/update_s"]
        print(
            f"| {name} | {c['params'] / 1e6:.2f}M | {amp} | {micro} | {b['timing/update_s']:.2f} | "
            f"{b['perf/tokens_per_s']:.0f} | {gflops:.1f} | {100 * gflops / peak32:.0f}% | "
            f"{base / b['timing/update_s']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()

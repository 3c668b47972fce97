"""Update-stage throughput on this CPU: tokens/s and achieved FLOP/s vs the measured torch.mm peak.

FLOP/s = 6 x params x tokens / update time (forward + backward of the training pass), tokens = real
(unpadded) tokens. The no-grad old-log-prob pass (another 2 x params x tokens) is NOT counted in that
column, so it is conservative: a perfectly efficient update would show 75% of the matmul peak; the
``8NT`` column counts it (all the model work the update stage does).

Batches: ``uniform`` (32 trajectories of one length, the earlier runs' batch) and ``spread`` (32
multi-turn episodes of 1-5 turns with varied responses: lengths as real episodes spread). Micro-
batching: ``rows N`` = at most N trajectories per forward/backward (sorted by length first);
``tokens N`` = packed by a token budget of N padded tokens (``optim.micro_batch_tokens``).

The machine is shared and noisy, so every configuration and the fp32 ``torch.mm`` peak (1024^3)
are measured in interleaved rounds and the best of each is kept; ratios come from one run.
Run: .venv/bin/python bench/update.py [--threads 2] [--rounds 3] [--models tiny,small]
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
from ragen_tasks.data.token_batch import TokenBatch, collate
from ragen_tasks.models.presets import PRESETS, qwen2_model
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.update import ppo_update


def mm_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 8, *, k: int | None = None, m: int | None = None) -> float:
    """GFLOP/s of ``torch.mm`` of (n, k) @ (k, m); square n^3 by default (the peak)."""
    k, m = k or n, m or n
    a, b = torch.randn(n, k, dtype=dtype), torch.randn(k, m, dtype=dtype)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n * k * m * reps / (time.perf_counter() - t) / 1e9


def shape_ceiling(name: str, tokens: int = 2048) -> float:
    """fp32 GFLOP/s of the preset's own linear layers on ``tokens`` rows, weighted by their FLOPs: what
    a matmul of this model's width reaches on this CPU (the q/k/v/o, MLP and vocabulary projections)."""
    spec = PRESETS[name]
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    kv = h * spec.num_kv_heads // spec.num_heads
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h), (h, v)]  # per layer, + the head once
    flops = [2 * tokens * a * b for a, b in shapes]
    seconds = [
        f / (mm_gflops(torch.float32, tokens, 4, k=a, m=b) * 1e9) for f, (a, b) in zip(flops, shapes, strict=True)
    ]
    return sum(flops) / sum(seconds) / 1e9


def preset_model(name: str) -> Qwen2ForCausalLM:
    """The preset's architecture (vocab 1024) with a seeded random init; no tokenizer needed."""
    return qwen2_model(replace(PRESETS[name], max_position_embeddings=1024), vocab_size=PRESETS[name].vocab_size)


def spread_batch() -> TokenBatch:
    """32 episodes whose lengths spread like real multi-turn ones: 8 groups of 4, 1-5 turns, responses
    of 16-64 tokens, a 120-token prompt, 30-token observations (about 170 to 590 tokens)."""
    rows = []
    for g, (turns, resp) in enumerate([(1, 16), (1, 48), (2, 32), (2, 64), (3, 24), (3, 48), (4, 40), (5, 64)]):
        rows += synthetic_trajectories(1, 4, seed=g, vocab=1000, turns=turns, prompt_len=120, resp_len=resp, obs_len=30)
    return collate(rows)


def uniform_batch() -> TokenBatch:
    """32 trajectories x 280 tokens (4 turns of 40 + 24 after a 48-token prompt)."""
    return collate(
        synthetic_trajectories(n_groups=8, group_size=4, vocab=1000, turns=4, prompt_len=48, resp_len=40, obs_len=24)
    )


def setup(name: str, amp: str, micro: str) -> dict[str, Any]:
    actor_m = preset_model(name)
    kind, _, size = micro.partition(" ")
    rows, budget = (int(size), None) if kind == "rows" else (32, int(size))
    optim = OptimConfig.model_validate(
        {"lr": 1e-5, "minibatch_size": 32, "micro_batch_size": rows, "micro_batch_tokens": budget, "amp_dtype": amp}
    )
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
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--micro", default="rows 32,rows 8,tokens 4096", help="comma-separated 'rows N' / 'tokens N'")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    batches = {"uniform": uniform_batch(), "spread": spread_batch()}
    configs = {
        (n, a, m): setup(n, a, m)
        for n in args.models.split(",")
        for a in ("float32", "bfloat16")
        for m in args.micro.split(",")
    }
    best: dict[tuple[str, ...], dict[str, float]] = {}
    peak32 = peak16 = 0.0
    ceilings = dict.fromkeys(args.models.split(","), 0.0)
    for c in configs.values():  # warm-up
        ppo_update(batches["spread"], actor=c["actor"], algo=algo, optim=c["optim"], generator=c["gen"])
    for _ in range(args.rounds):
        peak32 = max(peak32, mm_gflops(torch.float32))
        peak16 = max(peak16, mm_gflops(torch.bfloat16))
        ceilings = {n: max(g, shape_ceiling(n)) for n, g in ceilings.items()}
        for key, c in configs.items():
            for bname, batch in batches.items():
                m = ppo_update(batch, actor=c["actor"], algo=algo, optim=c["optim"], generator=c["gen"])
                if (bname, *key) not in best or m["timing/update_s"] < best[(bname, *key)]["timing/update_s"]:
                    best[(bname, *key)] = m
    lengths = batches["spread"].lengths.float()
    print(
        f"torch.mm best-of-{args.rounds} peak ({args.threads} threads): fp32 {peak32:.0f} GFLOP/s, "
        f"bf16 {peak16:.0f} GFLOP/s. Batches: uniform 32 x {batches['uniform'].seq_len} tokens; spread 32 rows "
        f"of {lengths.min():.0f}-{lengths.max():.0f} tokens (mean {lengths.mean():.0f}); one minibatch of 32"
    )
    for n, g in ceilings.items():
        print(
            f"{n}: its own fp32 linear shapes on 2048 rows reach {g:.0f} GFLOP/s = {100 * g / peak32:.0f}% of the peak"
        )
    print(
        "| batch | model | params | compute | micro-batches | update s | tokens/s | GFLOP/s (6NT) "
        "| % fp32 mm peak (6NT) | % (8NT) | vs rows 32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (bname, name, amp, micro), b in best.items():
        params = configs[(name, amp, micro)]["params"]
        gflops = 6 * params * b["perf/tokens"] / b["timing/update_s"] / 1e9
        base = best[(bname, name, amp, "rows 32")]["timing/update_s"] if (bname, name, amp, "rows 32") in best else 0
        print(
            f"| {bname} | {name} | {params / 1e6:.2f}M | {amp} | {micro} | {b['timing/update_s']:.2f} | "
            f"{b['perf/tokens_per_s']:.0f} | {gflops:.1f} | {100 * gflops / peak32:.0f}% | "
            f"{100 * gflops * 8 / 6 / peak32:.0f}% | {base / b['timing/update_s']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()

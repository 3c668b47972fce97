"""Cost of the StarPO math per update batch, vs a plain-Python reference, on CPU.

For a batch of B trajectories of T tokens (about half of them policy tokens):
* GAE: ``gae_advantages`` (policy tokens packed left, chunked matmul scan) vs a torch loop over
  token columns (our first version) and a per-row plain-Python loop over lists;
* GRPO scores + StarPO-S filtering for N trajectories in N/8 groups;
* PPO policy loss forward + backward (token-mean, decoupled clip) and entropy from (B, T, V) logits.
Reports median wall time over repeats and the GAE ratios (measured in the same run). On a
shared, oversubscribed CPU run with OMP_NUM_THREADS=1: OpenMP threads spinning on busy cores
inflate every op ~30x and hide the comparison.

    OMP_NUM_THREADS=1 .venv/bin/python bench/algos.py [--batch 64] [--tokens 1024] [--vocab 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ragen_tasks.algos import (
    entropy_from_logits,
    filter_groups,
    gae_advantages,
    grpo_scores,
    ppo_policy_loss,
    token_level_rewards,
)


def gae_python(r: list[float], v: list[float], m: list[float], gamma: float, lam: float) -> list[float]:
    adv = [0.0] * len(r)
    next_v = next_a = 0.0
    for i in reversed(range(len(r))):
        if m[i] != 1:
            continue
        a = r[i] + gamma * next_v - v[i] + gamma * lam * next_a
        adv[i] = a
        next_v, next_a = v[i], a
    return adv


def gae_column_loop(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """The first implementation: vectorised over B, one Python step per token column (kept as baseline)."""
    mb = m.bool()
    zero = torch.zeros(r.shape[0], dtype=v.dtype)
    next_v, next_a, cols = zero, zero, []
    for i in range(r.shape[1] - 1, -1, -1):
        a = torch.where(mb[:, i], r[:, i] + gamma * next_v - v[:, i] + gamma * lam * next_a, zero)
        cols.append(a)
        next_v = torch.where(mb[:, i], v[:, i], next_v)
        next_a = torch.where(mb[:, i], a, next_a)
    return torch.stack(cols[::-1], dim=1)


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    b, t = args.batch, args.tokens
    mask = (torch.rand(b, t) < 0.5).float()
    mask[:, -1] = 1.0
    rewards = token_level_rewards(torch.randn(b), mask)
    values = torch.randn(b, t)

    ours = timed(lambda: gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False), args.repeats)
    column = timed(lambda: gae_column_loop(rewards, values, mask, 0.99, 0.95), args.repeats)
    rows = [(rewards[i].tolist(), values[i].tolist(), mask[i].tolist()) for i in range(b)]
    ref = timed(lambda: [gae_python(r, v, m, 0.99, 0.95) for r, v, m in rows], args.repeats)

    n = b * 16
    scores = torch.randint(0, 3, (n,)).float()
    gids = torch.arange(n) // 8
    grpo_t = timed(lambda: grpo_scores(scores, gids), args.repeats)
    filt_t = timed(lambda: filter_groups(scores, gids, 0.25, "highest_std"), args.repeats)

    old = -torch.rand(b, t)
    adv = torch.randn(b, t)

    def ppo_step() -> None:
        lp = (old + 0.1 * torch.randn(b, t)).requires_grad_(True)
        loss, _ = ppo_policy_loss(lp, old, adv, mask)
        loss.backward()

    ppo_t = timed(ppo_step, args.repeats)
    logits = torch.randn(8, t, args.vocab)
    ent_t = timed(lambda: entropy_from_logits(logits), args.repeats)

    print(f"B={b} T={t} V={args.vocab} threads={torch.get_num_threads()} repeats={args.repeats} (median)")
    print(f"gae_advantages (B={b}, T={t}, packed + chunked matmul): {ours * 1e3:8.1f} ms")
    print(f"torch loop over token columns (first version):   {column * 1e3:8.1f} ms   ratio x{column / ours:.1f}")
    print(f"plain python loop per row (lists, same input):   {ref * 1e3:8.1f} ms   ratio x{ref / ours:.1f}")
    print(f"grpo_scores (N={n}, groups of 8):     {grpo_t * 1e3:8.2f} ms")
    print(f"filter_groups (N={n}, keep 0.25):     {filt_t * 1e3:8.2f} ms")
    print(f"ppo_policy_loss fwd+bwd (B={b}, T={t}): {ppo_t * 1e3:8.1f} ms")
    print(f"entropy_from_logits (8, {t}, {args.vocab}): {ent_t * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

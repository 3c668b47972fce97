"""Plain-Python loop references and random inputs for the algos tests (no vectorisation, no tricks)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def random_mask(gen: torch.Generator, b: int, t: int, p: float = 0.6) -> Tensor:
    """(B, T) 0/1 float mask with at least one 1 per row, prompt-like 0s first and obs gaps inside."""
    m = (torch.rand(b, t, generator=gen) < p).float()
    m[:, 0] = 0.0  # a prompt token
    for i in range(b):
        if m[i].sum() == 0:
            m[i, int(torch.randint(1, t, (1,), generator=gen))] = 1.0
    return m


def with_garbage(x: Tensor, mask: Tensor, gen: torch.Generator, nan: bool = True) -> Tensor:
    """Copy of x with random huge values (and NaN if asked) where mask == 0."""
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) * 1e3
    if nan:
        noise[::2] = float("nan")
    return torch.where(mask.bool(), x, noise)


def gae_loop(
    r: list[float], v: list[float], m: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """GAE over the positions with m == 1 only, in plain Python."""
    idx = [i for i, x in enumerate(m) if x == 1]
    adv = [0.0] * len(r)
    ret = [0.0] * len(r)
    next_v, next_a = 0.0, 0.0
    for i in reversed(idx):
        delta = r[i] + gamma * next_v - v[i]
        a = delta + gamma * lam * next_a
        adv[i] = a
        ret[i] = a + v[i]
        next_v, next_a = v[i], a
    return adv, ret


def std_unbiased(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))

"""Advantage estimators vs plain loops, hand-computed cases, mask invariance and edge cases."""

from __future__ import annotations

import pytest
import torch

from ragen_tasks.algos import (
    batch_norm_advantages,
    gae_advantages,
    group_stats,
    grpo_advantages,
    grpo_scores,
    masked_whiten,
    token_level_rewards,
)
from ragen_tasks.algos.advantages import _discounted_reverse_cumsum
from tests.algos._ref import gae_loop, random_mask, std_unbiased, with_garbage


@pytest.mark.parametrize("seed", range(25))
def test_gae_matches_loop_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 4, 17
    mask = random_mask(gen, b, t)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    gamma = float(torch.rand(1, generator=gen))
    lam = float(torch.rand(1, generator=gen))
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    for i in range(b):
        ref_a, ref_r = gae_loop(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam)
        torch.testing.assert_close(adv[i], torch.tensor(ref_a, dtype=torch.float64))
        torch.testing.assert_close(ret[i], torch.tensor(ref_r, dtype=torch.float64))


def test_gae_hand_computed_bridges_observation_tokens() -> None:
    # tokens: [prompt, a, obs, b]; reward 1 on b; gamma=0.5, lam=0.5
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.2, 9.0, 0.4]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    # b: delta = 1 + 0 - 0.4 = 0.6 ; a: delta = 0 + 0.5*0.4 - 0.2 = 0.0, A = 0 + 0.25*0.6 = 0.15
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.15, 0.0, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.35, 0.0, 1.0]]))


@pytest.mark.parametrize("seed", range(10))
def test_gae_gamma_lam_one_terminal_reward_is_r_minus_v(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 3, 12
    mask = random_mask(gen, b, t)
    r = torch.randn(b, generator=gen, dtype=torch.float64)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv, ret = gae_advantages(token_level_rewards(r, mask), values, mask, gamma=1.0, lam=1.0, whiten=False)
    expected = (r.unsqueeze(1) - values) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, r.unsqueeze(1).expand(b, t) * mask)


@pytest.mark.parametrize("seed", range(10))
def test_gae_mask_invariance(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 3, 10
    mask = random_mask(gen, b, t)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    clean = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    dirty = gae_advantages(with_garbage(rewards, mask, gen), with_garbage(values, mask, gen), mask, gamma=0.9, lam=0.8)
    for c, d in zip(clean, dirty, strict=True):
        torch.testing.assert_close(c, d)
        assert torch.isfinite(d).all()
        assert (d[mask == 0] == 0).all()


def test_gae_whitening_is_masked() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = random_mask(gen, 5, 9)
    rewards = torch.randn(5, 9, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95, whiten=True)
    sel = adv[mask == 1]
    assert abs(float(sel.mean())) < 1e-6
    assert abs(float(sel.std()) - 1.0) < 1e-4
    raw, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95, whiten=False)
    torch.testing.assert_close(adv, masked_whiten(raw, mask))


def test_gae_rejects_bad_input() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="values"):
        gae_advantages(x, torch.zeros(2, 4), x, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(x, x, x, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="0/1"):
        gae_advantages(x, x, torch.full((2, 3), 0.5), gamma=1.0, lam=1.0)


def _grpo_loop(scores: list[float], gids: list[int], scale: bool, level: str, eps: float) -> list[float]:
    out = []
    batch_std = std_unbiased(scores)
    for s, g in zip(scores, gids, strict=True):
        grp = [x for x, h in zip(scores, gids, strict=True) if h == g]
        sd = std_unbiased(grp)
        if len(grp) < 2 or max(grp) == min(grp):
            out.append(0.0)
            continue
        c = s - sum(grp) / len(grp)
        if scale:
            c = c / ((sd if level == "group" else batch_std) + eps)
        out.append(c)
    return out


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize(("scale", "level"), [(True, "group"), (True, "batch"), (False, "group")])
def test_grpo_matches_loop_reference(seed: int, scale: bool, level: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 12
    gids = torch.randint(0, 4, (n,), generator=gen) * 7  # sparse, unsorted ids, maybe singletons
    scores = torch.randint(0, 3, (n,), generator=gen).double() * 0.5  # ties -> zero-variance groups
    got = grpo_scores(scores, gids, scale_by_std=scale, std_level=level, eps=1e-6)  # type: ignore[arg-type]
    ref = _grpo_loop(scores.tolist(), gids.tolist(), scale, level, 1e-6)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))


def test_grpo_hand_computed_and_edge_cases() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 3.0])
    gids = torch.tensor([0, 0, 1, 1, 2])  # group 1 zero-variance, group 2 singleton
    adv = grpo_scores(scores, gids, eps=0.0)
    # group 0: mean .5, unbiased std = sqrt(0.5) -> +-0.5/0.7071 = +-0.7071
    torch.testing.assert_close(adv, torch.tensor([0.70710678, -0.70710678, 0.0, 0.0, 0.0]))
    dr = grpo_scores(scores, gids, scale_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))
    # zero-variance group gives exactly 0 even when the mean is not representable
    tricky = torch.tensor([0.1, 0.1, 0.1])
    assert (grpo_scores(tricky, torch.zeros(3, dtype=torch.long)) == 0).all()


def test_grpo_broadcast_and_mask_invariance() -> None:
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(gen, 6, 8)
    scores = torch.randn(6, generator=gen)
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = grpo_advantages(scores, gids, mask)
    per_traj = grpo_scores(scores, gids)
    torch.testing.assert_close(adv, per_traj.unsqueeze(1) * mask)
    assert (adv[mask == 0] == 0).all()


def test_group_stats() -> None:
    unique, mean, std, counts = group_stats(torch.tensor([1.0, 2.0, 3.0, 5.0]), torch.tensor([5, 2, 5, 9]))
    assert unique.tolist() == [2, 5, 9]
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0, 5.0]))
    torch.testing.assert_close(std, torch.tensor([0.0, 2.0**0.5, 0.0]))
    assert counts.tolist() == [1, 2, 1]


@pytest.mark.parametrize("seed", range(10))
def test_batch_norm_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 7, 5)
    scores = torch.randn(7, generator=gen, dtype=torch.float64)
    adv = batch_norm_advantages(scores, mask, eps=0.0)
    xs = scores.tolist()
    mu, sd = sum(xs) / len(xs), std_unbiased(xs)
    ref = torch.tensor([[(x - mu) / sd * float(mk) for mk in row] for x, row in zip(xs, mask.tolist(), strict=True)])
    torch.testing.assert_close(adv, ref.double())


def test_batch_norm_degenerate_is_zero() -> None:
    mask = torch.ones(3, 4)
    assert (batch_norm_advantages(torch.full((3,), 0.1), mask) == 0).all()
    assert (batch_norm_advantages(torch.tensor([2.0]), torch.ones(1, 4)) == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_gae_long_sequences_cross_chunks(seed: int) -> None:
    """T well above the 256-column chunk of the vectorised recursion."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 2, 700
    mask = random_mask(gen, b, t, p=0.8)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.999, lam=0.97, whiten=False)
    for i in range(b):
        ref_a, ref_r = gae_loop(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), 0.999, 0.97)
        torch.testing.assert_close(adv[i], torch.tensor(ref_a, dtype=torch.float64))
        torch.testing.assert_close(ret[i], torch.tensor(ref_r, dtype=torch.float64))


@pytest.mark.parametrize("length", [1, 2, 3, 7, 9, 10])
@pytest.mark.parametrize("c", [0.0, 0.5, 1.0])
def test_discounted_reverse_cumsum_small_chunks(length: int, c: float) -> None:
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, generator=gen, dtype=torch.float64)
    got = _discounted_reverse_cumsum(x, c, chunk=3)
    ref = [[sum(c ** (j - k) * x[i, j].item() for j in range(k, length)) for k in range(length)] for i in range(3)]
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))


def test_gae_float32_and_empty_rows() -> None:
    mask = torch.tensor([[0, 0, 0], [0, 1, 1]])
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    values = torch.tensor([[5.0, 5.0, 5.0], [0.0, 0.5, 1.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.5, 1.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 2.0]]))

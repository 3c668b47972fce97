"""Policy / value losses vs loops, on-policy gradient, asymmetric clip, dual clip, aggregation, masks."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_tasks.algos import (
    aggregate_loss,
    entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)
from tests.algos._ref import random_mask, with_garbage


def _ppo_token_loop(lp: float, old: float, a: float, lo: float, hi: float, c: float | None) -> float:
    ratio = math.exp(lp - old)
    clipped = min(max(ratio, 1 - lo), 1 + hi)
    pg = max(-a * ratio, -a * clipped)
    if c is not None and a < 0:
        pg = min(pg, -a * c)
    return pg


def _agg_loop(mat: list[list[float]], mask: list[list[float]], agg: str) -> float:
    rows = [[x for x, m in zip(r, mr, strict=True) if m == 1] for r, mr in zip(mat, mask, strict=True)]
    rows = [r for r in rows if r]
    if agg == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat)
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / len(rows)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ppo_loss_matches_loop(seed: int, agg: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 3, 9
    mask = random_mask(gen, b, t)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    c = 3.0 if seed % 2 else None
    loss, metrics = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=c, agg=agg)  # type: ignore[arg-type]
    mat = [
        [_ppo_token_loop(lp[i, j].item(), old[i, j].item(), adv[i, j].item(), 0.2, 0.28, c) for j in range(t)]
        for i in range(b)
    ]
    assert loss.item() == pytest.approx(_agg_loop(mat, mask.tolist(), agg), rel=1e-9, abs=1e-12)
    n = mask.sum().item()
    ratio = (lp - old).exp()
    high = sum(1 for i in range(b) for j in range(t) if mask[i, j] == 1 and adv[i, j] > 0 and ratio[i, j] > 1.28)
    low = sum(1 for i in range(b) for j in range(t) if mask[i, j] == 1 and adv[i, j] < 0 and ratio[i, j] < 0.8)
    assert metrics["actor/clipfrac_high"].item() == pytest.approx(high / n)
    assert metrics["actor/clipfrac_low"].item() == pytest.approx(low / n)


def test_on_policy_gradient_is_minus_a_over_num_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = random_mask(gen, 4, 10)
    old = -torch.rand(4, 10, generator=gen, dtype=torch.float64)
    lp = old.clone().requires_grad_(True)
    adv = torch.randn(4, 10, generator=gen, dtype=torch.float64)
    loss, metrics = ppo_policy_loss(lp, old, adv, mask, agg="token-mean")
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, -adv * mask / mask.sum())
    assert metrics["actor/clipfrac_high"].item() == 0.0
    assert metrics["actor/clipfrac_low"].item() == 0.0
    assert metrics["actor/approx_kl"].item() == pytest.approx(0.0, abs=1e-12)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(1.0)


def test_asymmetric_clipping() -> None:
    # one token per row: ratio swept across [0.5, 1.5], A = +1 and A = -1
    ratios = torch.linspace(0.5, 1.5, 101, dtype=torch.float64)
    old = torch.zeros(101, 1, dtype=torch.float64)
    mask = torch.ones(101, 1)
    for sign in (1.0, -1.0):
        lp = ratios.log().unsqueeze(1).clone().requires_grad_(True)
        adv = torch.full((101, 1), sign, dtype=torch.float64)
        loss, _ = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-sum")
        loss.backward()
        assert lp.grad is not None
        has_grad = lp.grad.squeeze(1) != 0
        if sign > 0:  # positive advantage: clipped (no gradient) only above 1 + eps_high
            assert torch.equal(has_grad, ratios <= 1.28)
        else:  # negative advantage: clipped only below 1 - eps_low
            assert torch.equal(has_grad, ratios >= 0.8)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    old = torch.zeros(1, 1)
    lp = torch.tensor([[math.log(10.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0]])
    loss, metrics = ppo_policy_loss(lp, old, adv, torch.ones(1, 1), dual_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/clipfrac_dual"].item() == 1.0
    loss.backward()
    assert lp.grad is not None and lp.grad.item() == 0.0
    no_dual, _ = ppo_policy_loss(lp, old, adv, torch.ones(1, 1))
    assert no_dual.item() == pytest.approx(10.0, rel=1e-5)


def test_policy_loss_mask_invariance_values_and_grads() -> None:
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(gen, 3, 8)
    old = -torch.rand(3, 8, generator=gen, dtype=torch.float64)
    base = old + 0.3 * torch.randn(3, 8, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    ent = torch.rand(3, 8, generator=gen, dtype=torch.float64)
    results = []
    for dirty in (False, True):
        lp = (with_garbage(base, mask, gen, nan=False) if dirty else base).clone().requires_grad_(True)
        o = with_garbage(old, mask, gen) if dirty else old
        a = with_garbage(adv, mask, gen) if dirty else adv
        e = with_garbage(ent, mask, gen) if dirty else ent
        loss, metrics = ppo_policy_loss(lp, o, a, mask, dual_clip_c=2.0, entropy=e, entropy_coef=0.01)
        loss.backward()
        assert lp.grad is not None
        results.append((loss.detach(), lp.grad * mask, metrics))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for key, value in results[0][2].items():
        torch.testing.assert_close(value, results[1][2][key], msg=key)


def test_entropy_bonus_lowers_loss() -> None:
    mask = torch.ones(2, 3)
    z = torch.zeros(2, 3)
    ent = torch.full((2, 3), 2.0)
    base, _ = ppo_policy_loss(z, z, torch.ones(2, 3), mask)
    with_bonus, m = ppo_policy_loss(z, z, torch.ones(2, 3), mask, entropy=ent, entropy_coef=0.1)
    assert with_bonus.item() == pytest.approx(base.item() - 0.2)
    assert m["actor/entropy"].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="entropy"):
        ppo_policy_loss(z, z, z, mask, entropy_coef=0.1)


def test_aggregate_denominator_for_grad_accumulation() -> None:
    gen = torch.Generator().manual_seed(1)
    mask = random_mask(gen, 6, 5)
    mat = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        full = aggregate_loss(mat, mask, agg)  # type: ignore[arg-type]
        denom = mask.sum().item() if agg == "token-mean" else 6.0
        parts = sum(aggregate_loss(mat[i : i + 2], mask[i : i + 2], agg, denominator=denom) for i in (0, 2, 4))  # type: ignore[arg-type]
        torch.testing.assert_close(full, parts)


def test_aggregate_hand_computed() -> None:
    mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="agg"):
        aggregate_loss(mat, mask, "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(10))
def test_value_loss_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 3, 6)
    v = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    old = v + torch.randn(3, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    loss, metrics = value_loss(v, old, g, mask, clip_range=0.5)
    mat, clipped = [], 0
    for i in range(3):
        row = []
        for j in range(6):
            vi, oi, gi = v[i, j].item(), old[i, j].item(), g[i, j].item()
            outside = abs(vi - oi) > 0.5  # the prediction left the band around the old one
            vc = (oi + 0.5 if vi > oi else oi - 0.5) if outside else vi
            e1, e2 = (vi - gi) ** 2, (vc - gi) ** 2
            row.append(0.5 * max(e1, e2))
            clipped += int(mask[i, j] == 1 and outside and e2 > e1)
        mat.append(row)
    assert loss.item() == pytest.approx(_agg_loop(mat, mask.tolist(), "token-mean"))
    assert metrics["critic/vf_clipfrac"].item() == pytest.approx(clipped / mask.sum().item())
    dirty, _ = value_loss(with_garbage(v, mask, gen), with_garbage(old, mask, gen), with_garbage(g, mask, gen), mask)
    torch.testing.assert_close(dirty, loss)


def test_value_clipfrac_counts_no_token_inside_the_band() -> None:
    # independent float32 predictions, old predictions and returns; the tokens whose prediction stays
    # within c of the old one are not clipped, whatever the round-off of v - v_old
    gen = torch.Generator().manual_seed(0)
    v, old, g = (torch.randn(128, 128, generator=gen) for _ in range(3))  # (B, T) each
    inside = ((v - old).abs() < 0.5).float()  # (B, T) 1 = prediction within the band
    loss, metrics = value_loss(v, old, g, inside, clip_range=0.5)
    assert inside.sum() > 1000
    assert metrics["critic/vf_clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(0.5 * (((v - g) ** 2) * inside).sum().item() / inside.sum().item(), rel=1e-5)


def test_value_loss_hand_computed_and_unclipped() -> None:
    v, old, g = torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]])
    loss, m = value_loss(v, old, g, torch.ones(1, 1), clip_range=0.5)
    assert loss.item() == pytest.approx(2.0)  # max(4, 0.25) / 2
    assert m["critic/vf_clipfrac"].item() == 0.0
    v2 = torch.tensor([[0.0]])
    loss2, m2 = value_loss(v2, torch.tensor([[2.0]]), g, torch.ones(1, 1), clip_range=0.5)
    assert loss2.item() == pytest.approx(0.5 * 1.5**2)
    assert m2["critic/vf_clipfrac"].item() == 1.0
    loss3, _ = value_loss(v2, torch.tensor([[2.0]]), g, torch.ones(1, 1), clip_range=None)
    assert loss3.item() == 0.0


def test_entropy_and_logprobs_from_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    ent = entropy_from_logits(logits)
    p = logits.softmax(-1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    uniform = entropy_from_logits(torch.zeros(1, 1, 4))
    assert uniform.item() == pytest.approx(math.log(4))
    masked = torch.tensor([[[0.0, float("-inf"), 0.0]]])
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2))
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    lp = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(lp, logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1))

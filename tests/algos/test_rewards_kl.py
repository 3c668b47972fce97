"""Reward placement and KL estimators."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_tasks.algos import (
    kl_estimate,
    kl_in_reward,
    kl_loss,
    last_token_index,
    token_level_rewards,
    turn_level_rewards,
)
from tests.algos._ref import random_mask, with_garbage


@pytest.mark.parametrize("seed", range(20))
def test_token_level_rewards_on_last_policy_token(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 5, 11)
    r = torch.randn(5, generator=gen)
    out = token_level_rewards(r, mask)
    for i in range(5):
        last = max(j for j in range(11) if mask[i, j] == 1)
        expected = [r[i].item() if j == last else 0.0 for j in range(11)]
        assert out[i].tolist() == pytest.approx(expected)
    assert last_token_index(mask).tolist() == [max(j for j in range(11) if mask[i, j]) for i in range(5)]


def test_token_level_rewards_hand_case_and_errors() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 0, 0, 0]])
    out = token_level_rewards(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 2.0, 0], [0, 0, -1.0, 0, 0, 0]]
    with pytest.raises(ValueError, match="row 1 has no policy token"):
        token_level_rewards(torch.tensor([1.0, 1.0]), torch.tensor([[0, 1], [0, 0]]))
    with pytest.raises(ValueError, match="scores"):
        token_level_rewards(torch.tensor([1.0]), mask)


def test_turn_level_rewards() -> None:
    # [p, a, a, o, b, o, c]: turns end at 3, 5, 7; second row has one turn and padding
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 0, 0, 0]])
    turn_rewards = torch.tensor([[0.5, -0.1, 1.0], [2.0, float("nan"), 7.0]])
    turn_ends = torch.tensor([[3, 5, 7], [4, 0, 99]])
    valid = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = turn_level_rewards(turn_rewards, turn_ends, valid, mask)
    assert out[0].tolist() == pytest.approx([0, 0, 0.5, 0, -0.1, 0, 1.0])
    assert out[1].tolist() == pytest.approx([0, 0, 0, 2.0, 0, 0, 0])
    with pytest.raises(ValueError, match="response_mask 0"):
        turn_level_rewards(turn_rewards, torch.tensor([[4, 5, 7], [4, 0, 0]]), valid, mask)


@pytest.mark.parametrize("seed", range(10))
def test_kl_estimators_match_formulas(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(2, 6, generator=gen, dtype=torch.float64) * 4
    ref = -torch.rand(2, 6, generator=gen, dtype=torch.float64) * 4
    for est, fn in (
        ("k1", lambda a, b: a - b),
        ("k2", lambda a, b: 0.5 * (a - b) ** 2),
        ("k3", lambda a, b: math.exp(b - a) - (b - a) - 1),
    ):
        got = kl_estimate(lp, ref, est)  # type: ignore[arg-type]
        ref_vals = [[fn(lp[i, j].item(), ref[i, j].item()) for j in range(6)] for i in range(2)]
        torch.testing.assert_close(got, torch.tensor(ref_vals, dtype=torch.float64))
    assert (kl_estimate(lp, ref, "k3") >= 0).all()


def test_k1_k3_unbiased_on_samples() -> None:
    # samples from p = Cat([.7, .3]), ref q = Cat([.5, .5]); true KL(p||q)
    p, q = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    true_kl = float((p * (p / q).log()).sum())
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    lp, lq = p.log()[x].unsqueeze(0).double(), q.log()[x].unsqueeze(0).double()
    assert kl_estimate(lp, lq, "k1").mean().item() == pytest.approx(true_kl, abs=3e-3)
    assert kl_estimate(lp, lq, "k3").mean().item() == pytest.approx(true_kl, abs=3e-3)


def test_kl_in_reward_and_loss_are_masked() -> None:
    gen = torch.Generator().manual_seed(4)
    mask = random_mask(gen, 3, 7)
    lp = -torch.rand(3, 7, generator=gen, dtype=torch.float64)
    ref = -torch.rand(3, 7, generator=gen, dtype=torch.float64)
    rew = token_level_rewards(torch.randn(3, generator=gen, dtype=torch.float64), mask)
    out, m = kl_in_reward(rew, lp, ref, mask, kl_coef=0.1, estimator="k1")
    torch.testing.assert_close(out, rew - 0.1 * (lp - ref) * mask)
    out2, m2 = kl_in_reward(rew, with_garbage(lp, mask, gen), with_garbage(ref, mask, gen), mask, kl_coef=0.1)
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(m["actor/reward_kl"], m2["actor/reward_kl"])
    loss, lm = kl_loss(lp, ref, mask, estimator="k2")
    assert loss.item() == pytest.approx(float((0.5 * (lp - ref) ** 2 * mask).sum() / mask.sum()))
    loss2, _ = kl_loss(with_garbage(lp, mask, gen), with_garbage(ref, mask, gen), mask, estimator="k2")
    torch.testing.assert_close(loss, loss2)
    assert "actor/kl_loss" in lm

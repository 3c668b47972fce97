"""Property-based checks (Hypothesis): invariances the math must have for any input."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_tasks.algos import filter_groups, gae_advantages, grpo_scores, ppo_policy_loss, token_level_rewards

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

rewards_and_groups = st.integers(min_value=1, max_value=20).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, -1.0, 10.0]), min_size=n, max_size=n),
        st.lists(st.integers(min_value=0, max_value=5), min_size=n, max_size=n),
        st.permutations(list(range(n))),
    )
)


@SETTINGS
@given(data=rewards_and_groups, ratio=st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0]))
def test_filter_is_permutation_invariant_and_keeps_whole_groups(
    data: tuple[list[float], list[int], list[int]], ratio: float
) -> None:
    rewards, gids, perm = data
    r, g = torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids)
    p = torch.tensor(perm)
    kept, metrics = filter_groups(r, g, ratio, "highest_std")
    kept_p, _ = filter_groups(r[p], g[p], ratio, "highest_std")
    assert set(g[kept].tolist()) == set(g[p][kept_p].tolist())
    assert kept.tolist() == sorted(kept.tolist())
    kept_groups = set(g[kept].tolist())
    assert kept.tolist() == [i for i, x in enumerate(gids) if x in kept_groups]  # whole groups only
    assert metrics["filter/kept_in_group_std_mean"] >= metrics["filter/in_group_std_mean"] - 1e-12
    if ratio == 1.0:
        assert kept.tolist() == list(range(len(rewards)))


@SETTINGS
@given(data=rewards_and_groups, shift=st.floats(-5, 5), scale=st.floats(0.1, 10))
def test_grpo_is_shift_and_scale_invariant(
    data: tuple[list[float], list[int], list[int]], shift: float, scale: float
) -> None:
    rewards, gids, _ = data
    r, g = torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids)
    base = grpo_scores(r, g, eps=0.0)
    moved = grpo_scores(r * scale + shift, g, eps=0.0)
    torch.testing.assert_close(base, moved, atol=1e-6, rtol=1e-6)
    for gid in set(gids):  # each group's advantages sum to zero
        assert abs(float(base[g == gid].sum())) < 1e-9


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    t=st.integers(2, 24),
)
def test_gae_gamma_lam_one_returns_equal_terminal_reward(seed: int, b: int, t: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=gen) < 0.5).float()
    mask[:, -1] = 1.0
    r = torch.randn(b, generator=gen, dtype=torch.float64)
    v = torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv, ret = gae_advantages(token_level_rewards(r, mask), v, mask, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(ret, r.unsqueeze(1) * mask)
    torch.testing.assert_close(adv, (r.unsqueeze(1) - v) * mask)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), lo=st.floats(0.05, 0.5), hi=st.floats(0.05, 0.5))
def test_ppo_loss_never_below_unclipped_pessimism(seed: int, lo: float, hi: float) -> None:
    """The clipped surrogate is a pessimistic bound: loss >= the unclipped surrogate, token by token."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(2, 6, generator=gen, dtype=torch.float64)
    lp = old + torch.randn(2, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 6)
    loss, m = ppo_policy_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi)
    unclipped = (-adv * (lp - old).exp()).mean()
    assert loss.item() >= unclipped.item() - 1e-12
    assert 0.0 <= m["actor/clipfrac_low"].item() + m["actor/clipfrac_high"].item() <= 1.0

"""Uncertainty-based group filtering (StarPO-S)."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_tasks.algos import filter_groups, num_groups_kept
from tests.algos._ref import std_unbiased


def _filter_loop(rewards: list[float], gids: list[int], ratio: float, mode: str) -> list[int]:
    groups = sorted(set(gids))
    stds = {g: std_unbiased([r for r, h in zip(rewards, gids, strict=True) if h == g]) for g in groups}
    if mode == "nonzero_std":
        kept = {g for g in groups if stds[g] > 0}
    else:
        k = max(1, math.ceil(round(ratio * len(groups), 9)))
        sign = -1 if mode == "highest_std" else 1
        kept = set(sorted(groups, key=lambda g: (sign * stds[g], g))[:k])
    return [i for i, g in enumerate(gids) if g in kept]


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("mode", ["highest_std", "lowest_std", "nonzero_std"])
def test_filter_matches_loop(seed: int, mode: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 24
    gids = torch.randint(0, 9, (n,), generator=gen) * 3
    rewards = torch.randint(0, 3, (n,), generator=gen).double()  # many ties, some zero-std groups
    ratio = [0.25, 0.5, 0.3, 1.0, 0.1][seed % 5]
    kept, metrics = filter_groups(rewards, gids, ratio, mode)  # type: ignore[arg-type]
    assert kept.dtype == torch.int64
    assert kept.tolist() == _filter_loop(rewards.tolist(), gids.tolist(), ratio, mode)
    assert metrics["filter/kept_trajectories"] == kept.numel()


def test_keep_ratio_one_keeps_everything_and_ties_are_by_id() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    gids = torch.tensor([3, 3, 1, 1, 2, 2, 0, 0])  # groups 3, 1, 0 have equal std; 2 zero std
    kept, m = filter_groups(rewards, gids, 1.0, "highest_std")
    assert kept.tolist() == list(range(8))
    kept, m = filter_groups(rewards, gids, 0.5, "highest_std")  # 2 of 4 groups: ids 0 and 1 win the tie
    assert kept.tolist() == [2, 3, 6, 7]
    assert m["filter/kept_groups"] == 2
    assert m["filter/kept_in_group_std_mean"] == pytest.approx(math.sqrt(0.5))
    assert m["filter/zero_std_group_fraction"] == pytest.approx(0.25)
    kept, _ = filter_groups(rewards, gids, 0.25, "lowest_std")
    assert kept.tolist() == [4, 5]
    kept, _ = filter_groups(rewards, gids, 0.25, "nonzero_std")
    assert kept.tolist() == [0, 1, 2, 3, 6, 7]
    # same input permuted -> same kept groups
    perm = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    kept_p, _ = filter_groups(rewards[perm], gids[perm], 0.5, "highest_std")
    assert sorted(gids[perm][kept_p].unique().tolist()) == [0, 1]


def test_num_groups_kept() -> None:
    assert num_groups_kept(0.3, 10) == 3
    assert num_groups_kept(0.25, 10) == 3
    assert num_groups_kept(0.01, 10) == 1
    assert num_groups_kept(1.0, 7) == 7
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="keep_ratio"):
            num_groups_kept(bad, 4)
    with pytest.raises(ValueError, match="mode"):
        filter_groups(torch.zeros(2), torch.zeros(2, dtype=torch.long), 0.5, "random")  # type: ignore[arg-type]


def test_empty_batch() -> None:
    kept, m = filter_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0.25, "highest_std")
    assert kept.tolist() == [] and m["filter/groups"] == 0.0 and m["filter/kept_fraction"] == 0.0

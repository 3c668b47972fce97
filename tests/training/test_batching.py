"""The minibatch plan: token-balanced shards, micro-batches packed by length, equal counts per rank."""

from __future__ import annotations

import pytest
import torch

from ragen_tasks.training.batching import micro_batches, rank_plan, shard_rows

LENGTHS = torch.tensor([100, 10, 90, 20, 80, 30, 70, 40])  # (B,) real tokens per row


def _tokens(rows: torch.Tensor) -> int:
    return int(LENGTHS[rows].sum())


def test_shards_balance_tokens_not_rows_and_cover_every_row_once() -> None:
    rows = torch.arange(8)
    shards = shard_rows(rows, LENGTHS, 2)
    assert sorted(torch.cat(shards).tolist()) == list(range(8))
    assert abs(_tokens(shards[0]) - _tokens(shards[1])) <= 10  # 220 vs 220 possible; LPT gets within a row
    skewed = torch.tensor([500, 10, 10, 10, 10, 10, 10, 10])
    long_first = shard_rows(rows, skewed, 2)
    assert long_first[0].tolist() == [0] and len(long_first[1]) == 7  # one long row = seven short ones
    assert [len(s) for s in shard_rows(torch.tensor([3]), LENGTHS, 2)] == [1, 0]


def test_micro_batches_pack_by_length_within_rows_and_token_budget() -> None:
    rows = torch.arange(8)
    by_rows = micro_batches(rows, LENGTHS, max_rows=3)
    assert [m.tolist() for m in by_rows] == [[0, 2, 4], [6, 7, 5], [3, 1]]  # longest first
    packed = micro_batches(rows, LENGTHS, max_rows=8, max_tokens=200)
    for m in packed:  # padded size = rows x longest row, within the budget (or one row alone)
        assert len(m) == 1 or len(m) * int(LENGTHS[m].max()) <= 200
    assert sorted(torch.cat(packed).tolist()) == list(range(8))
    assert [len(m) for m in micro_batches(rows, LENGTHS, max_rows=8, max_tokens=50)] == [1, 1, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batches(rows, LENGTHS, max_rows=2, max_tokens=0)


def test_every_rank_runs_the_same_number_of_micro_batches() -> None:
    rows = torch.tensor([0, 1, 3, 5, 7])  # a minibatch of 5 rows
    plans = [rank_plan(rows, LENGTHS, world_size=2, rank=r, max_rows=1) for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    real = [m.rows for plan in plans for m in plan if not m.padding]
    assert sorted(torch.cat(real).tolist()) == [0, 1, 3, 5, 7]  # each row trained once, by one rank
    # 100 tokens on rank 0 (row 0) vs 10 + 20 + 30 + 40 on rank 1: rank 0 pads with the shortest row
    assert [m.padding for m in plans[0]] == [False, True, True, True]
    assert all(m.rows.tolist() == [1] for m in plans[0][1:])
    lonely = rank_plan(torch.tensor([2]), LENGTHS, world_size=3, rank=2, max_rows=4)
    assert len(lonely) == 1 and lonely[0].padding and lonely[0].rows.tolist() == [2]  # a rank without rows
    assert not any(m.padding for m in rank_plan(rows, LENGTHS, world_size=1, rank=0, max_rows=2))

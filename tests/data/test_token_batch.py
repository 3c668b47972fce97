"""Collation: right padding, masks, alignment, and clear errors on bad trajectories."""

from dataclasses import fields, replace

import pyarrow as pa
import pytest
import torch

from ragen_tasks.data.synthetic import synthetic_trajectories
from ragen_tasks.data.token_batch import collate, collate_table
from ragen_tasks.data.trajectory import to_table


def test_collate_pads_right_and_keeps_masks():
    trajs = synthetic_trajectories(n_groups=2, group_size=2)
    short = replace(
        trajs[1],
        input_ids=trajs[1].input_ids[:-4],
        response_mask=trajs[1].response_mask[:-4],
        loss_mask=trajs[1].loss_mask[:-4],
        rollout_logprobs=trajs[1].rollout_logprobs[:-4],
        turn_starts=trajs[1].turn_starts[:1],
        turn_ends=trajs[1].turn_ends[:1],
        turn_rewards=[0.5],
        turn_actions=[[]],
        turn_format_ok=[True],
        turn_think=[""],
        turn_responses=[""],
        turn_observations=[""],
        reward=0.5,
    )
    trajs[1] = short
    b = collate(trajs, pad_id=5)
    assert b.input_ids.shape == (4, max(t.num_tokens for t in trajs))
    n = short.num_tokens
    assert b.lengths[1] == n and b.attention_mask[1, :n].all() and not b.attention_mask[1, n:].any()
    assert torch.equal(b.input_ids[1, :n], torch.tensor(short.input_ids))
    assert (b.input_ids[1, n:] == 5).all() and (b.loss_mask[1, n:] == 0).all()
    for i, traj in enumerate(trajs):  # every row: its own tokens, log-probs only where it sampled
        m = traj.num_tokens
        assert torch.equal(b.input_ids[i, :m], torch.tensor(traj.input_ids))
        expected = torch.tensor(traj.rollout_logprobs, dtype=torch.float32) * torch.tensor(traj.response_mask)
        assert torch.equal(b.rollout_logprobs[i, :m], expected) and not b.rollout_logprobs[i, m:].any()
        assert torch.equal(b.loss_mask[i, :m], torch.tensor(traj.loss_mask, dtype=torch.float32))
    assert torch.equal(b.response_mask[0], torch.tensor(trajs[0].response_mask, dtype=torch.float32))
    assert b.rewards.tolist() == pytest.approx([t.reward for t in trajs])
    assert b.group_ids.tolist() == [0, 0, 1, 1]
    sub = b.select(torch.tensor([1]))
    assert sub.seq_len == n and sub.batch_size == 1


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="0 trajectories"):
        collate([])
    t = synthetic_trajectories(1, 1)[0]
    no_loss = replace(t, loss_mask=[0] * t.num_tokens)
    with pytest.raises(ValueError, match="loss_mask is all 0"):
        collate([no_loss])
    bad = replace(t, loss_mask=t.loss_mask[:-1])
    with pytest.raises(ValueError, match="len\\(loss_mask\\)"):
        collate([bad])


def test_collate_table_equals_collate_of_the_trajectories():
    """A stored batch (an Arrow table, here also a row subset of one) collates to the same tensors
    as its trajectories do."""
    trajs = synthetic_trajectories(n_groups=3, group_size=2)
    trajs[1] = replace(trajs[1], rollout_logprobs=[v - 0.123456789 for v in trajs[1].rollout_logprobs])
    for rows in (list(range(len(trajs))), [4, 1, 2]):
        subset = [trajs[i] for i in rows]
        expected = collate(subset, pad_id=7)
        got = collate_table(to_table(trajs).take(rows), pad_id=7)
        for f in fields(expected):
            a, b = getattr(expected, f.name), getattr(got, f.name)
            if a is None:  # an optional field neither collate gives
                assert b is None, f.name
                continue
            assert a.dtype == b.dtype and torch.equal(a, b), f.name


def test_collate_table_rejects_bad_input_like_collate():
    t = synthetic_trajectories(1, 1)[0]
    with pytest.raises(ValueError, match="0 trajectories"):
        collate_table(to_table([t]).slice(0, 0))
    cases = [
        (replace(t, loss_mask=[0] * t.num_tokens), "loss_mask is all 0"),
        (replace(t, loss_mask=[1, *t.loss_mask[1:]]), "loss_mask\\[0\\]=1"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            collate_table(to_table([t, bad]))
    table = to_table([t])
    misaligned = table.set_column(
        table.schema.get_field_index("response_mask"),
        "response_mask",
        pa.array([t.response_mask[:-1]], type=pa.list_(pa.int8())),
    )
    with pytest.raises(ValueError, match="len\\(response_mask\\)"):
        collate_table(misaligned)


def test_length_bucketed_batches_cover_every_row_once_per_epoch_with_less_padding():
    import itertools

    from ragen_tasks.data.token_batch import length_bucketed_batches

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 500, (1000,), generator=generator)  # (B,)
    batches = length_bucketed_batches(lengths, 32, torch.Generator().manual_seed(1))
    epoch: list[torch.Tensor] = []
    while sum(b.numel() for b in epoch) < 1000:  # one epoch; the last minibatch of a pool may be short
        epoch.append(next(batches))
    rows = torch.cat(epoch)
    assert sorted(rows.tolist()) == list(range(1000))  # each row exactly once per epoch
    assert max(b.numel() for b in epoch) == 32

    def padded(batches_: list[torch.Tensor]) -> int:  # tokens computed: every row padded to its batch's longest
        return sum(int(lengths[b].max()) * b.numel() for b in batches_)

    shuffled = list(torch.randperm(1000, generator=torch.Generator().manual_seed(2)).split(32))
    assert padded(epoch) < 0.8 * padded(shuffled)
    again = list(itertools.islice(length_bucketed_batches(lengths, 32, torch.Generator().manual_seed(1)), 5))
    assert all(torch.equal(a, b) for a, b in zip(again, epoch[:5], strict=True))  # seeded

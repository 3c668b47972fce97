"""Collation: right padding, masks, alignment, and clear errors on bad trajectories."""

from dataclasses import replace

import pytest
import torch

from ragen_tasks.data.token_batch import collate
from ragen_tasks.training.resume_harness import synthetic_trajectories


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
    b = collate(trajs, pad_id=0)
    assert b.input_ids.shape == (4, max(t.num_tokens for t in trajs))
    n = short.num_tokens
    assert b.lengths[1] == n and b.attention_mask[1, :n].all() and not b.attention_mask[1, n:].any()
    assert torch.equal(b.input_ids[1, :n], torch.tensor(short.input_ids))
    assert (b.input_ids[1, n:] == 0).all() and (b.loss_mask[1, n:] == 0).all()
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

"""Collate trajectories into the padded tensors the update step trains on.

One row per trajectory, RIGHT padded to the longest trajectory (training never generates, so left
padding buys nothing and right padding keeps position ids = 0..T-1 for every row).

Alignment convention (shared with ``ragen_tasks.training``): every per-token tensor is indexed by
the token it describes. ``rollout_logprobs[b, t]`` is ``log p(input_ids[b, t] | input_ids[b, :t])``,
so it is produced by the logits at position ``t - 1``; column 0 therefore never carries a loss
(token 0 is always a prompt token, checked here).

Tensors of a :class:`TokenBatch` (B trajectories, T = longest trajectory):

=================== ========= ======= ============================================================
name                shape     dtype   meaning
=================== ========= ======= ============================================================
input_ids           (B, T)    int64   prompt + sampled response ids + fed observation ids; pad_id after the end
attention_mask      (B, T)    int64   1 = real token, 0 = right padding
response_mask       (B, T)    float32 1 = token the policy sampled; 0 = prompt / observation / pad
loss_mask           (B, T)    float32 1 = token trained on (== response_mask unless observations are trained on)
rollout_logprobs    (B, T)    float32 log p(token) under the sampling policy where response_mask = 1, else 0
rewards             (B,)      float32 trajectory reward (sum of turn rewards incl. format penalties)
group_ids           (B,)      int64   trajectories with the same id share the initial state
lengths             (B,)      int64   number of real tokens (sum of attention_mask)
policy_versions     (B,)      int64   policy version that sampled each trajectory
=================== ========= ======= ============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ragen_tasks.data.trajectory import Trajectory


@dataclass(frozen=True)
class TokenBatch:
    """Padded tensors for B trajectories; see the module docstring for every field."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64, 1 = real token
    response_mask: torch.Tensor  # (B, T) float32, 1 = sampled by the policy
    loss_mask: torch.Tensor  # (B, T) float32, 1 = trained on
    rollout_logprobs: torch.Tensor  # (B, T) float32, 0 where response_mask = 0
    rewards: torch.Tensor  # (B,) float32 trajectory reward
    group_ids: torch.Tensor  # (B,) int64
    lengths: torch.Tensor  # (B,) int64
    policy_versions: torch.Tensor  # (B,) int64

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens in the batch."""
        return int(self.lengths.sum().item())

    def select(self, index: torch.Tensor) -> TokenBatch:
        """Rows ``index`` (a 1-D long tensor of row numbers), trimmed to their longest row."""
        t = int(self.lengths[index].max().item()) if index.numel() else 0
        out = {}
        for f in fields(self):
            value: torch.Tensor = getattr(self, f.name)
            value = value[index]
            out[f.name] = value[:, :t] if value.dim() == 2 else value
        return TokenBatch(**out)

    def to(self, device: torch.device | str) -> TokenBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(trajectories: list[Trajectory], *, pad_id: int = 0) -> TokenBatch:
    """list[Trajectory] -> right-padded :class:`TokenBatch`.

    Raises ValueError naming the trajectory and field if a trajectory is internally inconsistent,
    if it has no trained token, or if its first token is trained on (it has no context to be
    predicted from).
    """
    if not trajectories:
        raise ValueError("collate: got 0 trajectories; pass at least one")
    for traj in trajectories:
        traj.check()
        if traj.num_tokens == 0:
            raise ValueError(f"trajectory {traj.traj_id}: input_ids is empty")
        if traj.loss_mask[0]:
            raise ValueError(
                f"trajectory {traj.traj_id}: loss_mask[0]=1 but token 0 has no context; "
                "every trajectory must start with at least one prompt token"
            )
        if not any(traj.loss_mask):
            raise ValueError(
                f"trajectory {traj.traj_id}: loss_mask is all 0 (no token to train on); drop it before collating"
            )
    b = len(trajectories)
    t = max(traj.num_tokens for traj in trajectories)
    input_ids = torch.full((b, t), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, t), dtype=torch.int64)
    response_mask = torch.zeros((b, t), dtype=torch.float32)
    loss_mask = torch.zeros((b, t), dtype=torch.float32)
    rollout_logprobs = torch.zeros((b, t), dtype=torch.float32)
    for i, traj in enumerate(trajectories):
        n = traj.num_tokens
        input_ids[i, :n] = torch.tensor(traj.input_ids, dtype=torch.int64)
        attention_mask[i, :n] = 1
        response_mask[i, :n] = torch.tensor(traj.response_mask, dtype=torch.float32)
        loss_mask[i, :n] = torch.tensor(traj.loss_mask, dtype=torch.float32)
        rollout_logprobs[i, :n] = torch.tensor(traj.rollout_logprobs, dtype=torch.float32) * response_mask[i, :n]
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        rewards=torch.tensor([traj.reward for traj in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([traj.group_id for traj in trajectories], dtype=torch.int64),
        lengths=torch.tensor([traj.num_tokens for traj in trajectories], dtype=torch.int64),
        policy_versions=torch.tensor([traj.policy_version for traj in trajectories], dtype=torch.int64),
    )

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
turn_advantages     (B, T)    float32 on each sampled token, the advantage of the turn it was sampled in
                                      (``with_turn_advantages``; ``algo.advantage`` turn_td / turn_q); None until given
=================== ========= ======= ============================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ragen_tasks.data.trajectory import TOKEN_FIELDS, Trajectory


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
    turn_advantages: torch.Tensor | None = None  # (B, T) float32, its turn's advantage; None until given

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
            value: torch.Tensor | None = getattr(self, f.name)
            if value is not None:  # an optional field not given stays None
                value = value[index]
                out[f.name] = value[:, :t] if value.dim() == 2 else value
        return TokenBatch(**out)

    def to(self, device: torch.device | str) -> TokenBatch:
        return replace(
            self,
            **{f.name: getattr(self, f.name).to(device) for f in fields(self) if getattr(self, f.name) is not None},
        )


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
    lengths = np.array([traj.num_tokens for traj in trajectories], dtype=np.int64)  # (B,)
    total = int(lengths.sum())
    flat = {  # each (total,): the trajectories' lists concatenated
        name: np.fromiter(chain.from_iterable(getattr(traj, name) for traj in trajectories), dtype, total)
        for name, dtype in _TOKEN_DTYPES.items()
    }
    return _padded_batch(
        [traj.traj_id for traj in trajectories],
        lengths,
        flat,
        rewards=np.array([traj.reward for traj in trajectories]),
        group_ids=np.array([traj.group_id for traj in trajectories]),
        policy_versions=np.array([traj.policy_version for traj in trajectories]),
        pad_id=pad_id,
    )


def collate_table(table: pa.Table, *, pad_id: int = 0) -> TokenBatch:
    """The same :class:`TokenBatch` as ``collate(from_table(table))``, straight from an
    ``ARROW_SCHEMA`` table (a stored batch) without building a Python object per token.

    Checks what padding needs (token lists aligned, a trained token in every row, none at position
    0), with the same errors as :func:`collate`; a stored batch's other invariants are the batch
    validation's job (Great Expectations ran on it before it was committed for training).
    """
    if table.num_rows == 0:
        raise ValueError("collate_table: got 0 trajectories; pass at least one")
    traj_ids = table.column("traj_id").to_pylist()
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy().astype(np.int64)  # (B,)
    for name in TOKEN_FIELDS[1:]:
        other = pc.list_value_length(table.column(name)).to_numpy()  # (B,)
        for row in np.flatnonzero(other != lengths)[:1]:
            raise ValueError(f"trajectory {traj_ids[row]}: len({name})={other[row]} != len(input_ids)={lengths[row]}")
    flat = {  # each (total,): the rows' lists concatenated (zero-copy where the type already matches)
        name: pc.list_flatten(table.column(name)).to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        for name, dtype in _TOKEN_DTYPES.items()
    }
    return _padded_batch(
        traj_ids,
        lengths,
        flat,
        rewards=table.column("reward").to_numpy(),
        group_ids=table.column("group_id").to_numpy(),
        policy_versions=table.column("policy_version").to_numpy(),
        pad_id=pad_id,
    )


# The per-token fields a TokenBatch holds, with the dtype of their flat (concatenated) form.
_TOKEN_DTYPES: dict[str, type[np.int64 | np.float32]] = {
    "input_ids": np.int64,
    "response_mask": np.float32,
    "loss_mask": np.float32,
    "rollout_logprobs": np.float32,
}


def _padded_batch(
    traj_ids: list[str],
    lengths: np.ndarray,
    flat: dict[str, np.ndarray],
    *,
    rewards: np.ndarray,
    group_ids: np.ndarray,
    policy_versions: np.ndarray,
    pad_id: int,
) -> TokenBatch:
    """Check and pad B trajectories given as ``lengths`` (B,) and, per field of ``_TOKEN_DTYPES``,
    ``flat[name]`` (sum of lengths,): the rows' lists concatenated in row order."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # (B,) first token of each row
    loss = flat["loss_mask"]  # (total,)
    for row in np.flatnonzero(lengths == 0)[:1]:
        raise ValueError(f"trajectory {traj_ids[row]}: input_ids is empty")
    for row in np.flatnonzero(loss[starts] != 0)[:1]:
        raise ValueError(
            f"trajectory {traj_ids[row]}: loss_mask[0]=1 but token 0 has no context; "
            "every trajectory must start with at least one prompt token"
        )
    trained = np.add.reduceat(loss != 0, starts)  # (B,) tokens with loss (every row is non-empty here)
    for row in np.flatnonzero(trained == 0)[:1]:
        raise ValueError(
            f"trajectory {traj_ids[row]}: loss_mask is all 0 (no token to train on); drop it before collating"
        )
    b, t = len(lengths), int(lengths.max())
    # (B, T) True on each row's real tokens. Its True cells in row-major order are the rows' tokens
    # concatenated, so one masked assignment per field fills every row (instead of one per row).
    # Padding is done in numpy, single-threaded: these copies are small, and a torch parallel region
    # stalls for a scheduler slice whenever another process holds the other core (as the Prefect
    # server does right after a task boundary in the train flow).
    real = np.arange(t)[None, :] < lengths[:, None]

    def padded(name: str, pad: float) -> torch.Tensor:
        """(B, T) field ``name``, right padded with ``pad``."""
        out = np.full((b, t), pad, dtype=_TOKEN_DTYPES[name])
        out[real] = flat[name]  # (total,) in row-major order of ``real``
        return torch.from_numpy(out)

    response_mask = padded("response_mask", 0.0)
    return TokenBatch(
        input_ids=padded("input_ids", pad_id),
        attention_mask=torch.from_numpy(real.astype(np.int64)),
        response_mask=response_mask,
        loss_mask=padded("loss_mask", 0.0),
        rollout_logprobs=padded("rollout_logprobs", 0.0) * response_mask,
        rewards=torch.tensor(rewards, dtype=torch.float32),  # copies: the inputs may be read-only Arrow memory
        group_ids=torch.tensor(group_ids, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        policy_versions=torch.tensor(policy_versions, dtype=torch.int64),
    )


def with_turn_advantages(batch: TokenBatch, turn_advantages: torch.Tensor, turn_spans: torch.Tensor) -> TokenBatch:
    """``batch`` with each turn's advantage on the tokens the policy sampled in that turn (0 on every
    other token).

    Args:
        turn_advantages: (B, K) float, the advantage of each row's turn k (padding turns: any value,
            they have no span).
        turn_spans: (B, K, 2) int64, ``[start, end)`` of turn k's sampled tokens in the row
            (``Trajectory.turn_starts`` / ``turn_ends``); a padding turn is ``[0, 0)``.
    """
    b, k = turn_advantages.shape
    if tuple(turn_spans.shape) != (b, k, 2) or b != batch.batch_size:
        raise ValueError(
            f"turn_advantages {tuple(turn_advantages.shape)} and turn_spans {tuple(turn_spans.shape)} must be "
            f"(B, K) and (B, K, 2) with B = {batch.batch_size}, the batch's rows"
        )
    positions = torch.arange(batch.seq_len)  # (T,)
    inside = (positions >= turn_spans[..., :1]) & (positions < turn_spans[..., 1:])  # (B, K, T) token in turn k
    per_token = torch.where(inside, turn_advantages.to(torch.float32).unsqueeze(-1), 0.0).sum(dim=1)  # (B, T)
    return replace(batch, turn_advantages=per_token * batch.response_mask)


def length_bucketed_batches(
    lengths: torch.Tensor, batch_size: int, generator: torch.Generator, *, pool: int = 8
) -> Iterator[torch.Tensor]:
    """Endless minibatches of row indices, each row once per epoch, rows of similar length together.

    lengths: (B,) tokens per row. Each epoch shuffles the rows, sorts each pool of ``pool x
    batch_size`` shuffled rows by length, cuts it into minibatches and shuffles the minibatch
    order: a minibatch pads to its own longest row, so grouping similar lengths cuts the padding
    while the rows and the order of minibatches stay random.
    """
    n = int(lengths.numel())
    if n < 1 or batch_size < 1:
        raise ValueError(f"length_bucketed_batches: need rows ({n}) and batch_size >= 1 ({batch_size})")
    while True:
        order = torch.randperm(n, generator=generator)  # (B,)
        batches: list[torch.Tensor] = []
        for start in range(0, n, pool * batch_size):
            chunk = order[start : start + pool * batch_size]
            chunk = chunk[torch.argsort(lengths[chunk], stable=True)]  # shortest first within the pool
            batches.extend(chunk[i : i + batch_size] for i in range(0, chunk.numel(), batch_size))
        for k in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[k]

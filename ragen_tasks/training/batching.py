"""How a minibatch is cut for the update: shards per data-parallel rank, micro-batches per rank.

Pure functions over row indices and row lengths (no model, no process group), so every rank
computes the same plan for every rank from the same batch, and the plan can be tested alone.

- **Shards are balanced by tokens, not rows**: rows go longest first to the rank holding the fewest
  tokens so far (the longest-processing-time rule), so one rank does not wait on another's long
  episodes. With at least as many rows as ranks, every rank gets a row.
- **Micro-batches are packed by length**: a rank's rows are sorted longest first and cut into
  micro-batches of at most ``max_rows`` rows and, with ``max_tokens``, at most ``max_tokens``
  padded tokens (rows x the micro-batch's longest row). A micro-batch pads only to its own longest
  row, so sorting removes most padding; the token budget keeps the work per micro-batch even
  (many short rows, or few long ones).
- **Every rank runs the same number of micro-batches**: DDP and ZeRO issue collectives per
  backward (ZeRO-2 reduces every micro-batch's gradients, ZeRO-3 gathers weights in every
  forward), so a rank short of micro-batches runs padding ones: a real row whose loss is
  multiplied by 0 (it adds nothing to the gradient, the metrics or the token count).

A row's gradient contribution does not depend on which micro-batch or rank holds it (every loss
carries the whole minibatch's denominator), so any plan gives the same gradient up to float
summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of one rank."""

    rows: Tensor  # (b,) int64 row indices into the collated batch
    padding: bool = False  # True: only keeps the ranks in step; its loss is multiplied by 0


def shard_rows(rows: Tensor, lengths: Tensor, world_size: int) -> list[Tensor]:
    """Split ``rows`` ((n,) indices into the batch) over ``world_size`` ranks, balanced by tokens.

    ``lengths``: (B,) real tokens of every row of the batch. Returns one (n_r,) index tensor per
    rank (some empty when n < world_size). Deterministic: ties go to the lower rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    row_lengths = [int(n) for n in lengths[rows].tolist()]
    # longest first; equal lengths keep their order in ``rows`` (a stable sort), so shards are reproducible
    order = sorted(range(len(row_lengths)), key=lambda i: -row_lengths[i])
    tokens = [0] * world_size
    counts = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        rank = min(range(world_size), key=lambda r: (tokens[r], counts[r], r))
        shards[rank].append(int(rows[i]))
        tokens[rank] += row_lengths[i]
        counts[rank] += 1
    return [torch.tensor(s, dtype=torch.long) for s in shards]


def micro_batches(rows: Tensor, lengths: Tensor, *, max_rows: int, max_tokens: int | None = None) -> list[Tensor]:
    """Cut ``rows`` ((n,) indices) into micro-batches, longest rows first.

    A micro-batch holds at most ``max_rows`` rows and, when ``max_tokens`` is set, at most
    ``max_tokens`` padded tokens (its row count x its longest row); a row longer than the budget
    gets a micro-batch of its own. ``lengths``: (B,) real tokens of every row of the batch.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 (or None for no token budget)")
    row_lengths = [int(n) for n in lengths[rows].tolist()]
    order = sorted(range(len(row_lengths)), key=lambda i: -row_lengths[i])
    out: list[list[int]] = []
    longest = 0  # the current micro-batch's longest row: its padded width (rows arrive longest first)
    for i in order:
        current = out[-1] if out else None
        fits = (
            current is not None
            and len(current) < max_rows
            and (max_tokens is None or (len(current) + 1) * longest <= max_tokens)
        )
        if fits:
            assert current is not None
            current.append(int(rows[i]))
        else:
            out.append([int(rows[i])])
            longest = row_lengths[i]
    return [torch.tensor(m, dtype=torch.long) for m in out]


def rank_plan(
    rows: Tensor,
    lengths: Tensor,
    *,
    world_size: int,
    rank: int,
    max_rows: int,
    max_tokens: int | None = None,
) -> list[MicroBatch]:
    """Rank ``rank``'s micro-batches of the minibatch ``rows``: its token-balanced shard
    (``shard_rows``) cut by ``micro_batches``, then padded to the largest count any rank has.

    ``rows``: (n,) indices into the batch, n >= 1; ``lengths``: (B,) real tokens per row. A padding
    micro-batch holds one real row, the minibatch's shortest (a real row keeps every kernel's inputs
    valid; the shortest costs least)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if rows.numel() == 0:
        raise ValueError("rank_plan: the minibatch has no rows")
    plans = [
        micro_batches(shard, lengths, max_rows=max_rows, max_tokens=max_tokens)
        for shard in shard_rows(rows, lengths, world_size)
    ]
    mine = [MicroBatch(m) for m in plans[rank]]
    filler = rows[lengths[rows].argmin()].reshape(1)  # the cheapest real row of the minibatch
    steps = max(len(p) for p in plans)
    return mine + [MicroBatch(filler, padding=True)] * (steps - len(mine))

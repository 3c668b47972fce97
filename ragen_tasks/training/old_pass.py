"""The no-grad passes before an update (``old_pass``): what the models said about the batch before
it changes them. Micro-batches are sharded over the data-parallel ranks like the training step's
(``batching.rank_plan``), and the ranks' outputs summed, so every rank holds every row's values."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ragen_tasks.data.token_batch import TokenBatch
from ragen_tasks.training.backend import TrainModel
from ragen_tasks.training.batching import MicroBatch, rank_plan
from ragen_tasks.training.critic import token_logprobs
from ragen_tasks.training.distributed import SINGLE, all_reduce


@dataclass(frozen=True)
class OldPass:
    """What the models said about the batch before this update (no grad); all (B, T), 0 on padding."""

    logprobs: Tensor  # log p_old(token t | < t) under the actor, where a token is sampled or trained on
    ref_logprobs: Tensor | None  # the same under the reference model; None without a KL term
    values: Tensor | None  # critic V(state before token t); None without a critic


def old_pass(
    batch: TokenBatch,
    actor: TrainModel,
    critic: TrainModel | None,
    ref_model: nn.Module | None,
    micro: int,
    max_tokens: int | None = None,
) -> OldPass:
    """The no-grad passes over ``batch`` (micro-batches of ``micro`` rows / ``max_tokens`` padded
    tokens, sharded over the ranks): the actor's log-probs, the reference's (when given; every rank
    runs it whole, it is not data-parallel) and the critic's values (when given)."""
    actor.module.eval()
    logprobs = _forward_logprobs(actor.forward_module, batch, micro, actor, max_tokens)
    ref_logprobs = _forward_logprobs(ref_model, batch, micro, None, max_tokens) if ref_model is not None else None
    values = None
    if critic is not None:
        critic.module.eval()
        values = _forward_values(critic, batch, micro, max_tokens)
    return OldPass(logprobs, ref_logprobs, values)


def _rank_micro_batches(
    batch: TokenBatch, ctx: TrainModel | None, micro: int, max_tokens: int | None
) -> list[MicroBatch]:
    """This rank's micro-batches of a no-grad pass over the whole batch (one rank without ``ctx``)."""
    ranks = ctx.ranks if ctx is not None else SINGLE
    rows = torch.arange(batch.batch_size)
    return rank_plan(
        rows, batch.lengths, world_size=ranks.world_size, rank=ranks.rank, max_rows=micro, max_tokens=max_tokens
    )


@torch.no_grad()
def _forward_logprobs(
    model: nn.Module, batch: TokenBatch, micro: int, ctx: TrainModel | None = None, max_tokens: int | None = None
) -> Tensor:
    """(B, T) log p(token) under ``model`` (no grad). With ``ctx`` on several ranks, each rank runs
    its shard of the rows and the ranks' outputs are summed (every row is computed by one rank)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    for micro_batch in _rank_micro_batches(batch, ctx, micro, max_tokens):
        mb = batch.select(micro_batch.rows)
        with ctx.forward_context() if ctx is not None else contextlib.nullcontext():
            # (b, t) log p(token t | < t) wherever a token is sampled or trained on (0 elsewhere)
            logp, _ = token_logprobs(
                model, mb.input_ids, mb.attention_mask, positions=(mb.loss_mask + mb.response_mask) > 0
            )
        if not micro_batch.padding:
            out[micro_batch.rows, : mb.seq_len] = logp * mb.attention_mask
    return all_reduce(out) if ctx is not None else out


@torch.no_grad()
def _forward_values(critic: TrainModel, batch: TokenBatch, micro: int, max_tokens: int | None = None) -> Tensor:
    """(B, T) critic values V(state before token t) (no grad), sharded over the ranks like the log-probs."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    for micro_batch in _rank_micro_batches(batch, critic, micro, max_tokens):
        mb = batch.select(micro_batch.rows)
        with critic.forward_context():
            values = critic.forward_module(mb.input_ids, mb.attention_mask).float()  # (b, t)
        if not micro_batch.padding:
            out[micro_batch.rows, : mb.seq_len] = values * mb.attention_mask
    return all_reduce(out)

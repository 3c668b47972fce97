"""The critic (value model) and the two forward passes the update needs.

The critic is a copy of the policy's base transformer with a scalar head (PPO / GAE). It has its
own optimizer and learning rate (``OptimConfig.critic_lr``); value clipping lives in the loss.

Alignment (same as ``ragen_tasks.data.token_batch``): per-token outputs are indexed by the token
they describe. ``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` and
``values[b, t] = V(input_ids[b, :t])``, the value of the state in which token t was sampled; both
come from position ``t - 1`` of the network, and column 0 is 0.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ragen_tasks.algos.losses import entropy_from_logits, logprobs_from_logits


class ValueModel(nn.Module):
    """A base transformer (no LM head) + a linear value head: (B, T) ids -> (B, T) values."""

    def __init__(self, base: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.base = base
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: no initial bias in the advantages
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # input_ids, attention_mask: (B, T); attention_mask 1 = real token
        mask = model_attention_mask(attention_mask)
        hidden = self.base(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, T, H)
        v = self.head(hidden).squeeze(-1).float()  # (B, T): V of the prefix ending at t
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # (B, T): aligned to tokens


def model_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The mask to hand the transformer for a (B, T) batch (``attention_mask`` 1 = real token).

    None when every row is right-padded (real tokens first, then only pads: a ``TokenBatch``'s
    layout). Causal attention alone then keeps every real token from the pads, which all come after
    it, and position ids count from 0 in each row either way, so the real tokens' outputs equal the
    masked pass's; without a mask, SDPA's causal kernel skips the score blocks above the diagonal
    that a mask would have it compute and discard (bench/RESULTS.md, "Training passes without the
    padding mask"). What the pads' own columns hold changes, and every consumer masks them out.
    Any other layout (left padding) keeps its mask.
    """
    right_padded = bool((attention_mask[:, :-1] >= attention_mask[:, 1:]).all())
    return None if right_padded else attention_mask


def make_critic(actor: nn.Module) -> ValueModel:
    """A critic initialised from a deep copy of the actor's base model (weights included)."""
    base: nn.Module = copy.deepcopy(getattr(actor, "base_model"))  # noqa: B009 (HF attribute, untyped)
    hidden = int(getattr(actor, "config").hidden_size)  # noqa: B009
    return ValueModel(base, hidden).to(next(actor.parameters()).device)


def make_reference(actor: nn.Module) -> nn.Module:
    """A frozen copy of the actor for the KL term (build it only when KL is on)."""
    ref = copy.deepcopy(actor).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Aligned per-token log-probs (and entropies) of ``input_ids`` under ``model``.

    input_ids, attention_mask: (B, T), any padding (a right-padded batch runs without the mask:
    ``model_attention_mask``). Returns ``(logprobs (B, T), entropy (B, T) or None)`` where
    column t describes token t (predicted by the logits at t - 1) and column 0 is 0.
    ``entropy_grad=False`` computes the entropy without building its autograd graph (a metric
    only, not a loss term).

    ``positions``: (B, T) bool, True = column t is wanted; None = every column. The model projects
    onto the vocabulary only at the columns some row wants (its own ``logits_to_keep``; on a small
    model the projection and the softmax are a large share of the pass, and the prompt's columns
    are never wanted); a column no row wants is 0.
    """
    if positions is None:
        positions = torch.ones_like(input_ids, dtype=torch.bool)
    # (K,) network positions whose logits predict a wanted token (position j predicts token j + 1)
    keep = positions[:, 1:].any(dim=0).nonzero().squeeze(1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)  # (B, T)
    entropy_out = torch.zeros_like(out) if with_entropy else None
    if keep.numel() == 0:
        return out, entropy_out
    pred = model(
        input_ids=input_ids, attention_mask=model_attention_mask(attention_mask), use_cache=False, logits_to_keep=keep
    ).logits  # (B, K, V): column k predicts token keep[k] + 1
    out[:, keep + 1] = logprobs_from_logits(pred, input_ids[:, keep + 1]).float()
    if entropy_out is not None:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy_out[:, keep + 1] = entropy_from_logits(pred.float())
    return out, entropy_out

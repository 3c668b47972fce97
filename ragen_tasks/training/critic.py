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
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        v = self.head(hidden).squeeze(-1).float()  # (B, T): V of the prefix ending at t
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # (B, T): aligned to tokens


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


def token_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T, V) float32 logits aligned to tokens: row t predicts token t (row 0 unused)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    logits = logits.float()
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)


def gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids) from aligned logits: (B, T, V), (B, T) -> (B, T); column 0 is garbage-free 0."""
    logp = torch.gather(logits, -1, input_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logp[:, 0] = 0.0
    return logp

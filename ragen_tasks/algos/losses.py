"""Losses for StarPO: PPO clipped surrogate (decoupled clip, dual clip), value loss, entropy.

Every loss returns ``(loss, metrics)``: ``loss`` is a scalar tensor with gradients and ``metrics``
is a dict of detached scalar tensors with namespaced keys (``actor/...``, ``critic/...``), so the
caller syncs once per step. Metrics are token means over the mask whatever the aggregation mode.
Token-level inputs are (B, T); masked (0) positions never influence a loss, a gradient or a metric.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ragen_tasks.algos.masked import check_mask, check_same_shape, masked_mean

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

# log-ratios are clamped to this range before exp() so one wild token cannot give inf/NaN.
LOG_RATIO_CLAMP = 20.0


def aggregate_loss(loss_mat: Tensor, loss_mask: Tensor, agg: LossAgg, *, denominator: float | None = None) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    Modes:
      * ``"token-mean"``: sum over mask-1 tokens / number of mask-1 tokens (every token weighs the same).
      * ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean (every sequence
        weighs the same, whatever its length).
      * ``"seq-mean-token-sum"``: mean over sequences of each sequence's token sum (Dr. GRPO style).

    Rows without any mask-1 token contribute nothing and are not counted as sequences.

    Args:
        loss_mat: (B, T) float, per-token loss.
        loss_mask: (B, T) 0/1; 1 = token trained on.
        agg: aggregation mode, one of the three above.
        denominator: override the divisor: the number of tokens (token-mean) or of sequences
            (seq-mean-*) of the WHOLE minibatch when it is split into micro-batches for gradient
            accumulation, so the accumulated gradient equals the one of the full minibatch.
            None = this call's own count (at least 1).

    Returns:
        scalar tensor.
    """
    m = check_mask(loss_mask, "loss_mask", tuple(loss_mat.shape))
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (B, T), got shape {tuple(loss_mat.shape)}")
    if denominator is not None and denominator <= 0:
        raise ValueError(f"denominator={denominator} must be > 0 (a token or sequence count)")
    masked = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    if agg == "token-mean":
        count = float(m.sum().item()) if denominator is None else denominator
        return masked.sum() / max(count, 1.0)
    tokens_per_seq = m.sum(dim=1)  # (B,)
    has_tokens = tokens_per_seq > 0
    if agg == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / tokens_per_seq.clamp(min=1).to(masked.dtype)
    elif agg == "seq-mean-token-sum":
        per_seq = masked.sum(dim=1)
    else:
        raise ValueError(f"agg={agg!r}: expected 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum'")
    n_seq = float(has_tokens.sum().item()) if denominator is None else denominator
    return per_seq.sum() / max(n_seq, 1.0)


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    agg: LossAgg = "token-mean",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with decoupled clip (StarPO-S: 0.2 / 0.28), optional dual clip.

    Per token, with ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to [-20, 20]):
    ``pg = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))``; with dual clip and
    ``A < 0`` it is further capped: ``pg = min(pg, -A * dual_clip_c)``. The loss is
    ``aggregate(pg) - entropy_coef * aggregate(entropy)``.

    Args:
        logprobs: (B, T) float, log-probs of the taken tokens under the policy being trained
            (gradients flow through these only).
        old_logprobs: (B, T) float, log-probs under the policy that sampled (constant).
        advantages: (B, T) float, per-token advantages (constant).
        loss_mask: (B, T) 0/1; 1 = token trained on.
        clip_low: eps_low, ratio clipped below at ``1 - clip_low`` for negative advantages; in (0, 1).
        clip_high: eps_high, ratio clipped above at ``1 + clip_high`` for positive advantages; > 0.
        dual_clip_c: dual-clip constant (> 1) bounding the loss of negative-advantage tokens with a
            huge ratio; None = off.
        agg: aggregation mode, see ``aggregate_loss``.
        entropy: (B, T) float per-token entropy of the policy (``entropy_from_logits``), or None.
            Needed when ``entropy_coef > 0``; also reported as ``actor/entropy`` when given.
        entropy_coef: entropy bonus coefficient (>= 0).
        denominator: see ``aggregate_loss`` (gradient accumulation over micro-batches).

    Returns:
        ``(loss, metrics)`` with metrics (detached scalars, token means over the mask):
        ``actor/pg_loss``; ``actor/clipfrac_high`` (A > 0 and ratio > 1 + clip_high, the high clip is
        active); ``actor/clipfrac_low`` (A < 0 and ratio < 1 - clip_low); ``actor/clipfrac_dual``
        (dual clip active); ``actor/approx_kl`` (k3 estimate of KL(old || new)); ``actor/ratio_mean``;
        ``actor/ratio_max``; ``actor/entropy`` when ``entropy`` is given.
    """
    check_same_shape(logprobs, "logprobs", old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask)
    if not 0 < clip_low < 1:
        raise ValueError(f"clip_low={clip_low} must lie in (0, 1): the ratio is clipped below at 1 - clip_low")
    if clip_high <= 0:
        raise ValueError(f"clip_high={clip_high} must be > 0: the ratio is clipped above at 1 + clip_high")
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1 (or None to turn dual clip off)")
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef={entropy_coef} must be >= 0")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy: pass entropy=entropy_from_logits(logits)")
    m = check_mask(loss_mask, "loss_mask")
    zeros = torch.zeros_like(logprobs)
    adv = torch.where(m, advantages.detach(), zeros)
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), zeros).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # (B, T); exactly 1 on masked positions
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual_active = torch.zeros_like(m)
    if dual_clip_c is not None:
        pg_dual = -adv * dual_clip_c
        dual_active = (adv < 0) & (pg > pg_dual)
        pg = torch.where(adv < 0, torch.minimum(pg, pg_dual), pg)
    pg_loss = aggregate_loss(pg, m, agg, denominator=denominator)
    loss = pg_loss
    metrics: dict[str, Tensor] = {}
    if entropy is not None:
        check_same_shape(logprobs, "logprobs", entropy=entropy)
        ent_agg = aggregate_loss(entropy, m, agg, denominator=denominator)
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent_agg
        metrics["actor/entropy"] = masked_mean(entropy.detach(), m)
    with torch.no_grad():
        r = ratio.detach()
        high = (adv > 0) & (r > 1.0 + clip_high)
        low = (adv < 0) & (r < 1.0 - clip_low)
        neg_lr = -log_ratio.detach()
        approx_kl = torch.exp(-neg_lr) - 1.0 + neg_lr  # k3 of KL(old || new) with samples from old
        metrics.update(
            {
                "actor/pg_loss": pg_loss.detach(),
                "actor/clipfrac_high": masked_mean(high.to(r.dtype), m),
                "actor/clipfrac_low": masked_mean(low.to(r.dtype), m),
                "actor/clipfrac_dual": masked_mean(dual_active.to(r.dtype), m),
                "actor/approx_kl": masked_mean(approx_kl, m),
                "actor/ratio_mean": masked_mean(r, m),
                "actor/ratio_max": torch.where(m, r, torch.zeros_like(r)).max() if m.any() else r.new_zeros(()),
            }
        )
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip_range: float | None = 0.5,
    agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss with value clipping: ``0.5 * max((V - G)^2, (clip(V, V_old +- c) - G)^2)``.

    Args:
        values: (B, T) float, current critic predictions (gradients flow).
        old_values: (B, T) float, predictions of the critic at rollout time (constant).
        returns: (B, T) float, regression targets G (``gae_advantages``' returns; constant).
        loss_mask: (B, T) 0/1; 1 = token trained on.
        clip_range: c > 0; None = plain squared error.
        agg, denominator: see ``aggregate_loss``.

    Returns:
        ``(loss, metrics)`` with ``critic/vf_loss``, ``critic/vf_clipfrac`` (fraction of tokens where
        the clipped error is the larger one), ``critic/vpred_mean``, ``critic/return_mean``.
    """
    check_same_shape(values, "values", old_values=old_values, returns=returns, loss_mask=loss_mask)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"clip_range={clip_range} must be > 0 (or None for no value clipping)")
    m = check_mask(loss_mask, "loss_mask")
    zeros = torch.zeros_like(values)
    v = torch.where(m, values, zeros)
    g = torch.where(m, returns.detach(), zeros)
    err = (v - g) ** 2
    if clip_range is None:
        vf = 0.5 * err
        clipped_wins = torch.zeros_like(m)
    else:
        v_old = torch.where(m, old_values.detach(), zeros)
        # clamp(V, V_old - c, V_old + c) is V itself inside the band, so a token counts as clipped
        # only when V left it (V_old + (V - V_old).clamp(-c, c) rounds, and can differ from V inside)
        v_clip = torch.clamp(v, v_old - clip_range, v_old + clip_range)
        err_clip = (v_clip - g) ** 2
        vf = 0.5 * torch.maximum(err, err_clip)
        clipped_wins = err_clip > err
    loss = aggregate_loss(vf, m, agg, denominator=denominator)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": masked_mean(clipped_wins.to(vf.dtype), m),
            "critic/vpred_mean": masked_mean(v.detach(), m),
            "critic/return_mean": masked_mean(g, m),
        }
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position.

    Args:
        logits: (B, T, V) float, unnormalised scores over the vocabulary.

    Returns:
        (B, T) float, ``-sum(p * log p)`` with ``log p = log_softmax(z)`` (stable; -inf logits allowed).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    # where(): a -inf logit has p = 0 and contributes 0 (not 0 * -inf = NaN)
    plogp = torch.where(probs > 0, probs * logp, torch.zeros_like(logp))
    return -plogp.sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under the logits at the same position.

    The caller aligns the shift: ``logits[:, t]`` must be the distribution that produced
    ``labels[:, t]`` (for a causal LM, logits of position t - 1 predict token t).

    Args:
        logits: (B, T, V) float.
        labels: (B, T) int token ids in [0, V).

    Returns:
        (B, T) float log-probabilities.
    """
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be (B, T, V) and labels {tuple(labels.shape)} must be (B, T)"
        )
    logp = torch.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)

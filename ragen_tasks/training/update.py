"""One PPO/GRPO update of the policy (and critic) on a collated batch: the update stage's one path.

In order (CleanRL style):

1. advantages that need no model (GRPO, batch-normalised); with ``algo.drop_zero_advantage``
   (StarPO-S), trajectories whose advantage is 0 everywhere (zero-variance groups carry no signal)
   are dropped BEFORE any forward pass, which also drops their tokens from the loss denominator;
2. no-grad forward passes: old log-probs of the actor, reference log-probs (only when a KL term is
   on), values (only with a critic);
3. token rewards (+ KL in the reward) -> GAE advantages and returns (when the critic is on);
4. ``ppo_epochs`` x minibatches of whole trajectories (shuffled with the seeded ``generator``);
   each minibatch is split into micro-batches whose losses use the minibatch's denominator, so the
   accumulated gradient equals the full minibatch's;
5. clip grad norm (pre-clip norm recorded); a non-finite norm skips the step and counts it;
   ``max_consecutive_skips`` in a row raise ``NonFiniteUpdateError``;
6. metrics: a flat dict of floats with namespaced keys.

The math comes from ``ragen_tasks.algos``; nothing here re-implements it. The model, its
optimizer and the batch are passed in (see ``backend.make_train_model``); there is no trainer class.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict

import torch
from torch import nn

from ragen_tasks.algos.advantages import batch_norm_advantages, gae_advantages, grpo_advantages
from ragen_tasks.algos.kl import kl_in_reward, kl_loss
from ragen_tasks.algos.losses import ppo_policy_loss, value_loss
from ragen_tasks.algos.rewards import token_level_rewards
from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.token_batch import TokenBatch
from ragen_tasks.training.backend import TrainModel
from ragen_tasks.training.critic import token_logprobs

log = logging.getLogger(__name__)


class NonFiniteUpdateError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@torch.no_grad()
def _forward_logprobs(model: nn.Module, batch: TokenBatch, micro: int, ctx: TrainModel | None = None) -> torch.Tensor:
    """(B, T) log p(token) under ``model`` (no grad), computed micro-batch by micro-batch."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    for start in range(0, batch.batch_size, micro):
        rows = torch.arange(start, min(start + micro, batch.batch_size))
        mb = batch.select(rows)
        with ctx.forward_context() if ctx is not None else contextlib.nullcontext():
            # (b, t) log p(token t | < t) wherever a token is sampled or trained on (0 elsewhere)
            logp, _ = token_logprobs(
                model, mb.input_ids, mb.attention_mask, positions=(mb.loss_mask + mb.response_mask) > 0
            )
        out[rows, : mb.seq_len] = logp * mb.attention_mask
    return out


@torch.no_grad()
def _forward_values(critic: TrainModel, batch: TokenBatch, micro: int) -> torch.Tensor:
    """(B, T) critic values V(state before token t) (no grad)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    for start in range(0, batch.batch_size, micro):
        rows = torch.arange(start, min(start + micro, batch.batch_size))
        mb = batch.select(rows)
        with critic.forward_context():
            out[rows, : mb.seq_len] = critic.module(mb.input_ids, mb.attention_mask).float() * mb.attention_mask
    return out


def _denominator(loss_mask: torch.Tensor, agg: str) -> float:
    """Token count (token-mean) or sequence count (seq-mean-*) of a whole minibatch."""
    if agg == "token-mean":
        return max(float(loss_mask.sum()), 1.0)
    return max(float((loss_mask.sum(dim=1) > 0).sum()), 1.0)


def ppo_update(
    batch: TokenBatch,
    *,
    actor: TrainModel,
    algo: AlgoConfig,
    optim: OptimConfig,
    generator: torch.Generator,
    critic: TrainModel | None = None,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    """Update ``actor`` (and ``critic``) on ``batch``; return metrics (floats, namespaced keys).

    ``critic`` is required for ``algo.advantage == "gae"`` and ignored otherwise; ``ref_model`` is
    required when ``algo.kl_mode != "none"``. ``generator`` (CPU) drives the minibatch shuffle: save
    its state in checkpoints for exact resume.
    """
    t0 = time.perf_counter()
    if algo.advantage == "gae" and critic is None:
        raise ValueError(
            "algo.advantage='gae' needs a critic: pass critic=make_train_model(make_critic(actor), ...) "
            "or set algo.advantage to 'grpo' / 'batch_norm'"
        )
    if algo.kl_mode != "none" and ref_model is None:
        raise ValueError(
            f"algo.kl_mode={algo.kl_mode!r} needs ref_model=make_reference(actor), or set algo.kl_mode='none'"
        )
    if algo.kl_mode == "in_reward" and algo.advantage != "gae":
        raise ValueError(
            f"algo.kl_mode='in_reward' shapes token rewards, which only GAE uses; with "
            f"algo.advantage={algo.advantage!r} use kl_mode='in_loss'"
        )
    metrics: dict[str, float] = {"batch/trajectories": float(batch.batch_size)}
    micro = optim.micro_batch_size
    device = batch.input_ids.device

    # 1. model-free advantages first, so rows without signal can be dropped before any forward pass
    # (B, T) the trajectory's advantage on every trained token, 0 where loss_mask = 0. loss_mask is
    # response_mask unless agent.loss_on_observations also trains on observation tokens.
    advantages: torch.Tensor | None = None
    if algo.advantage == "grpo":
        advantages = grpo_advantages(
            batch.rewards, batch.group_ids, batch.loss_mask, scale_by_std=algo.grpo_scale_by_std
        )
    elif algo.advantage == "batch_norm":
        advantages = batch_norm_advantages(batch.rewards, batch.loss_mask)
    if advantages is not None:
        keep = ((advantages * batch.loss_mask) != 0).any(dim=1).nonzero().squeeze(1)  # (B',) rows with signal
        metrics["batch/zero_adv_rows"] = float(batch.batch_size - keep.numel())
        if algo.drop_zero_advantage:
            metrics["batch/skipped_zero_adv"] = float(batch.batch_size - keep.numel())
            if keep.numel() == 0:
                log.info("every trajectory has zero advantage: nothing to train on")
                metrics["timing/update_s"] = time.perf_counter() - t0
                return metrics
            advantages = advantages[keep][:, : int(batch.lengths[keep].max())]
            batch = batch.select(keep)

    # 2. no-grad forward passes on the kept rows
    actor.module.eval()
    old_logprobs = _forward_logprobs(actor.module, batch, micro, actor)  # (B, T)
    ref_logprobs = (
        _forward_logprobs(ref_model, batch, micro) if ref_model is not None and algo.kl_mode != "none" else None
    )
    rmask = batch.response_mask  # (B, T) 1 = token sampled by the policy
    lmask = batch.loss_mask  # (B, T) 1 = token trained on
    diff = (old_logprobs - batch.rollout_logprobs).abs() * rmask
    metrics["actor/rollout_logprob_diff_max"] = float(diff.max())

    # 3. token rewards -> GAE (critic)
    returns = old_values = None
    if algo.advantage == "gae":
        assert critic is not None
        critic.module.eval()
        old_values = _forward_values(critic, batch, micro)  # (B, T)
        rewards = token_level_rewards(batch.rewards, rmask)  # (B, T): R on the last sampled token
        if algo.kl_mode == "in_reward":
            assert ref_logprobs is not None
            rewards, kl_metrics = kl_in_reward(
                rewards, old_logprobs, ref_logprobs, rmask, kl_coef=algo.kl_coef, estimator=algo.kl_estimator
            )
            metrics.update({k: float(v) for k, v in kl_metrics.items()})
        advantages, returns = gae_advantages(rewards, old_values, rmask, gamma=algo.gamma, lam=algo.lam)
    assert advantages is not None
    metrics["batch/adv_mean"] = float((advantages * lmask).sum() / lmask.sum())

    # 4-5. epochs x minibatches x micro-batches
    actor.module.train()
    if critic is not None:
        critic.module.train()
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    steps = skipped = 0
    tokens = 0
    for _epoch in range(optim.ppo_epochs):
        order = torch.randperm(batch.batch_size, generator=generator)
        for mb_start in range(0, batch.batch_size, optim.minibatch_size):
            mb_rows = order[mb_start : mb_start + optim.minibatch_size]
            denom = _denominator(lmask[mb_rows], algo.loss_agg)
            mb_metrics: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=device))
            n_micro = (mb_rows.numel() + micro - 1) // micro
            for i in range(n_micro):
                rows = mb_rows[i * micro : (i + 1) * micro]
                mb = batch.select(rows)
                t = mb.seq_len
                adv, old_lp = advantages[rows, :t], old_logprobs[rows, :t]  # (b, t)
                weight = float(rows.numel()) / mb_rows.numel()  # metric weight of this micro-batch
                last = i == n_micro - 1
                with actor.forward_context():  # entropy: for the bonus, else as a metric on micro-batch 0
                    logprobs, entropy = token_logprobs(
                        actor.module,
                        mb.input_ids,
                        mb.attention_mask,
                        with_entropy=algo.entropy_coef > 0 or i == 0,
                        entropy_grad=algo.entropy_coef > 0,
                        positions=mb.loss_mask > 0,
                    )  # (b, t) real where loss_mask = 1, the only tokens the losses read
                loss, m = ppo_policy_loss(
                    logprobs,
                    old_lp,
                    adv,
                    mb.loss_mask,
                    clip_low=algo.clip_low,
                    clip_high=algo.clip_high,
                    dual_clip_c=algo.dual_clip_c,
                    agg=algo.loss_agg,
                    entropy=entropy,
                    entropy_coef=algo.entropy_coef,
                    denominator=denom,
                )
                if algo.kl_mode == "in_loss":
                    assert ref_logprobs is not None
                    kl, km = kl_loss(
                        logprobs,
                        ref_logprobs[rows, :t],
                        mb.loss_mask,
                        estimator=algo.kl_estimator,
                        agg=algo.loss_agg,
                        denominator=denom,
                    )
                    loss = loss + algo.kl_coef * kl
                    m.update(km)
                actor.backward(loss, last_micro_batch=last)
                for k, v in m.items():
                    if k == "actor/entropy":  # computed on the first micro-batch only unless it is in the loss
                        mb_metrics[k] = v.detach()
                    elif k != "actor/ratio_max":
                        mb_metrics[k] = mb_metrics[k] + weight * v.detach()
                    else:
                        mb_metrics[k] = torch.maximum(mb_metrics[k], v.detach())
                if critic is not None:
                    assert returns is not None and old_values is not None
                    with critic.forward_context():
                        values = critic.module(mb.input_ids, mb.attention_mask).float()  # (b, t)
                    vloss, vm = value_loss(
                        values,
                        old_values[rows, :t],
                        returns[rows, :t],
                        mb.loss_mask,
                        clip_range=algo.value_clip,
                        agg=algo.loss_agg,
                        denominator=denom,
                    )
                    critic.backward(vloss, last_micro_batch=last)
                    for k, v in vm.items():
                        mb_metrics[k] = mb_metrics[k] + weight * v.detach()
                tokens += int(mb.lengths.sum())
            grad_norm, stepped = actor.step()
            mb_metrics["actor/grad_norm"] = torch.tensor(grad_norm)
            if critic is not None:
                c_norm, c_stepped = critic.step()
                mb_metrics["critic/grad_norm"] = torch.tensor(c_norm)
                stepped = stepped and c_stepped
            if stepped:
                steps += 1
                actor.consecutive_skips = 0
            else:
                skipped += 1
                actor.consecutive_skips += 1
                log.warning(
                    "non-finite gradient norm (actor %s): optimizer step skipped (%d in a row)",
                    grad_norm,
                    actor.consecutive_skips,
                )
                if actor.consecutive_skips >= optim.max_consecutive_skips:
                    raise NonFiniteUpdateError(
                        f"{actor.consecutive_skips} optimizer steps in a row had a non-finite gradient norm "
                        f"(optim.max_consecutive_skips={optim.max_consecutive_skips}): the loss or the model has "
                        "diverged; lower optim.lr, check the batch's rewards / log-probs, or roll back to the last checkpoint"
                    )
            if steps + skipped == 1:  # the first minibatch is on-policy: its clip fractions must be 0
                metrics["actor/first_clipfrac"] = float(
                    mb_metrics["actor/clipfrac_low"] + mb_metrics["actor/clipfrac_high"]
                )
            for k, v in mb_metrics.items():
                sums[k] += float(v)
                counts[k] += 1

    # 6. metrics
    metrics.update({k: sums[k] / counts[k] for k in sums})
    elapsed = time.perf_counter() - t0
    metrics.update(
        {
            "actor/steps": float(steps),
            "actor/skipped_steps": float(skipped),
            "timing/update_s": elapsed,
            "perf/tokens": float(tokens),
            "perf/tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        }
    )
    return metrics

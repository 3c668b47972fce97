"""One PPO/GRPO update of the policy (and critic) on a collated batch: the update stage's one path.

In paper order (CleanRL style), as ``ppo_update`` reads:

1. advantages that need no model (GRPO, batch-normalised, the per-turn ones against the game's
   optimal values, which the caller put in the batch: ``turn_values.turn_advantages_batch``) first;
   with ``algo.drop_zero_advantage`` (StarPO-S), trajectories whose advantage is 0 everywhere
   (zero-variance groups carry no signal) are dropped BEFORE any forward pass, which also drops
   their tokens from the loss denominator;
2. no-grad forward passes (``old_pass``, in its own module): old log-probs of the actor, reference
   log-probs (only when a KL term is on), values (only with a critic);
3. advantages that need them: token rewards (+ KL in the reward) -> GAE advantages and returns;
4. ``ppo_epochs`` x minibatches of whole trajectories (shuffled with the seeded ``generator``),
   each one ``minibatch_step``: micro-batches (this rank's token-balanced shard, packed by length:
   ``batching``) whose losses use the minibatch's denominator, so the gradient accumulated and
   averaged over the ranks equals the full minibatch's, then one optimizer step (pre-clip grad norm
   recorded; a non-finite norm skips the step, and ``max_consecutive_skips`` in a row raise
   ``NonFiniteUpdateError``); with ``algo.demo_loss_coef`` > 0 each step's gradient also holds
   that times the warm start's loss on ``algo.demo_episodes`` demonstration episodes (``demos``);
5. metrics: a flat dict of floats with namespaced keys.

The estimators are a registry keyed by ``algo.advantage`` (``ADVANTAGES``), all with one signature.
The math comes from ``ragen_tasks.algos``; nothing here re-implements it. The model, its
optimizer and the batch are passed in (see ``backend.make_train_model``); there is no trainer class.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ragen_tasks.algos.advantages import batch_norm_advantages, gae_advantages, grpo_advantages
from ragen_tasks.algos.kl import kl_in_reward, kl_loss
from ragen_tasks.algos.losses import ppo_policy_loss, value_loss
from ragen_tasks.algos.rewards import token_level_rewards
from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.token_batch import TokenBatch
from ragen_tasks.training.backend import TrainModel
from ragen_tasks.training.batching import MicroBatch, rank_plan
from ragen_tasks.training.critic import token_logprobs
from ragen_tasks.training.distributed import all_reduce
from ragen_tasks.training.old_pass import OldPass, old_pass

log = logging.getLogger(__name__)


class NonFiniteUpdateError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class DivergedUpdateError(NonFiniteUpdateError):
    """An update left non-finite weights, or weights beyond ``optim.max_weight_abs``."""


@torch.no_grad()
def diverged_weights(modules: dict[str, nn.Module], max_abs: float) -> str | None:
    """Why the weights of ``modules`` must not be committed (a non-finite value, or |w| > ``max_abs``),
    naming the module and the parameter; None if they are fine. Parameters partitioned away from this
    rank (ZeRO-3: empty placeholders) are skipped."""
    for name, module in modules.items():
        for pname, p in module.named_parameters():
            if p.numel() == 0:
                continue
            if not bool(torch.isfinite(p).all()):
                return f"{name} weight {pname!r} holds non-finite values"
            largest = float(p.abs().max())
            if largest > max_abs:
                return f"{name} weight {pname!r} reached |w| = {largest:.3g} > optim.max_weight_abs={max_abs:g}"
    return None


@dataclass(frozen=True)
class Advantages:
    """An estimator's output: what the policy loss weighs tokens by, and what the critic regresses on."""

    advantages: Tensor  # (B, T) the advantage of each trained token, 0 where loss_mask = 0
    returns: Tensor | None  # (B, T) critic targets (GAE only)
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. actor/reward_kl (KL in the reward)


@dataclass(frozen=True)
class Estimator:
    """One ``algo.advantage``: ``compute(batch, algo, old)``. A model-free one gets ``old=None`` and
    runs before the forward passes (so rows without signal can be dropped first)."""

    model_free: bool
    compute: Callable[[TokenBatch, AlgoConfig, OldPass | None], Advantages]


def _grpo(batch: TokenBatch, algo: AlgoConfig, old: OldPass | None) -> Advantages:
    # loss_mask: response_mask, or also observation tokens with agent.loss_on_observations
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.loss_mask, scale_by_std=algo.grpo_scale_by_std)
    return Advantages(adv, None)


def _batch_norm(batch: TokenBatch, algo: AlgoConfig, old: OldPass | None) -> Advantages:
    return Advantages(batch_norm_advantages(batch.rewards, batch.loss_mask), None)


def _gae(batch: TokenBatch, algo: AlgoConfig, old: OldPass | None) -> Advantages:
    assert old is not None and old.values is not None
    rmask = batch.response_mask  # (B, T) 1 = token sampled by the policy: GAE runs over these only
    rewards = token_level_rewards(batch.rewards, rmask)  # (B, T): R on the last sampled token
    metrics: dict[str, float] = {}
    if algo.kl_mode == "in_reward":
        assert old.ref_logprobs is not None
        rewards, kl_metrics = kl_in_reward(
            rewards, old.logprobs, old.ref_logprobs, rmask, kl_coef=algo.kl_coef, estimator=algo.kl_estimator
        )
        metrics = {k: float(v) for k, v in kl_metrics.items()}
    advantages, returns = gae_advantages(rewards, old.values, rmask, gamma=algo.gamma, lam=algo.lam)
    return Advantages(advantages, returns, metrics)


def _turn_advantages(batch: TokenBatch, algo: AlgoConfig, old: OldPass | None) -> Advantages:
    # batch.turn_advantages: each sampled token's turn's advantage, given by turn_advantages_batch
    if batch.turn_advantages is None:
        raise ValueError(
            f"algo.advantage={algo.advantage!r} needs the batch's turn advantages: "
            "batch = ragen_tasks.training.turn_values.turn_advantages_batch(batch, trajectories, config)"
        )
    return Advantages(torch.where(batch.loss_mask > 0, batch.turn_advantages, 0.0), None)


ADVANTAGES: dict[str, Estimator] = {
    "grpo": Estimator(model_free=True, compute=_grpo),
    "batch_norm": Estimator(model_free=True, compute=_batch_norm),
    "gae": Estimator(model_free=False, compute=_gae),
    "turn_td": Estimator(model_free=True, compute=_turn_advantages),
    "turn_q": Estimator(model_free=True, compute=_turn_advantages),
}


def ppo_update(
    batch: TokenBatch,
    *,
    actor: TrainModel,
    algo: AlgoConfig,
    optim: OptimConfig,
    generator: torch.Generator,
    critic: TrainModel | None = None,
    ref_model: nn.Module | None = None,
    demos: TokenBatch | None = None,
) -> dict[str, float]:
    """Update ``actor`` (and ``critic``) on ``batch``; return metrics (floats, namespaced keys).

    ``critic`` is required for ``algo.advantage == "gae"`` and ignored otherwise; ``ref_model`` is
    required when ``algo.kl_mode != "none"``; ``demos`` (demonstration episodes, collated) when
    ``algo.demo_loss_coef > 0``: optimizer step ``i`` imitates its rows ``i * demo_episodes`` onwards,
    wrapping around (an update left with no trajectory takes no step, so it imitates nothing either).
    ``generator`` (CPU) drives the minibatch shuffle: save its state in checkpoints
    for exact resume.
    """
    t0 = time.perf_counter()
    _check_models(algo, critic, ref_model, demos)
    estimator = ADVANTAGES[algo.advantage]
    metrics: dict[str, float] = {"batch/trajectories": float(batch.batch_size)}

    critic = None if estimator.model_free else critic  # only GAE trains a critic

    # 1. model-free advantages first, so rows without signal can be dropped before any forward pass
    early = estimator.compute(batch, algo, None) if estimator.model_free else None
    if early is not None:
        kept = _rows_with_signal(batch, early, algo, metrics)
        if kept is None:
            log.info("every trajectory has zero advantage: nothing to train on")
            metrics["timing/update_s"] = time.perf_counter() - t0
            return metrics
        batch, early = kept

    # 2. no-grad forward passes on the rows kept
    ref = ref_model if algo.kl_mode != "none" else None
    old = old_pass(batch, actor, critic, ref, optim.micro_batch_size, optim.micro_batch_tokens)
    diff = (old.logprobs - batch.rollout_logprobs).abs() * batch.response_mask  # (B, T)
    metrics["actor/rollout_logprob_diff_max"] = float(diff.max())

    # 3. advantages that need the critic (GAE over token rewards, KL in the reward)
    adv = early if early is not None else estimator.compute(batch, algo, old)
    metrics.update(adv.metrics)
    lmask = batch.loss_mask  # (B, T) 1 = token trained on
    metrics["batch/adv_mean"] = float((adv.advantages * lmask).sum() / lmask.sum())

    # 4. epochs x minibatches of whole trajectories, one optimizer step each
    actor.module.train()
    if critic is not None:
        critic.module.train()
    sums: dict[str, float] = defaultdict(float)
    steps = skipped = tokens = 0
    for _epoch in range(optim.ppo_epochs):
        order = torch.randperm(batch.batch_size, generator=generator)
        for start in range(0, batch.batch_size, optim.minibatch_size):
            rows = order[start : start + optim.minibatch_size]
            step_demos = _step_demos(demos, algo, steps + skipped)
            mb_metrics, stepped, mb_tokens = minibatch_step(
                batch, rows, adv, old, actor, critic, algo, optim, demos=step_demos
            )
            tokens += mb_tokens
            steps, skipped = (steps + 1, skipped) if stepped else (steps, skipped + 1)
            if steps + skipped == 1:  # the first minibatch is on-policy: its clip fractions must be 0
                metrics["actor/first_clipfrac"] = float(
                    mb_metrics["actor/clipfrac_low"] + mb_metrics["actor/clipfrac_high"]
                )
            for k, v in mb_metrics.items():
                sums[k] += float(v)

    # 5. metrics: means over the minibatches
    device = batch.input_ids.device  # nccl reduces GPU tensors only
    tokens = int(all_reduce(torch.tensor(float(tokens), device=device)).item())  # every rank's tokens
    elapsed = time.perf_counter() - t0
    metrics.update({k: v / (steps + skipped) for k, v in sums.items()})
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


def _check_models(
    algo: AlgoConfig, critic: TrainModel | None, ref_model: nn.Module | None, demos: TokenBatch | None
) -> None:
    """The models (and demonstrations) ``algo`` needs were passed, and its KL mode fits its estimator."""
    if algo.demo_loss_coef > 0 and (demos is None or demos.batch_size == 0):
        raise ValueError(
            f"algo.demo_loss_coef={algo.demo_loss_coef:g} needs demos=collate(rl_demonstrations(...)), "
            "or set algo.demo_loss_coef=0"
        )
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


def _rows_with_signal(
    batch: TokenBatch, adv: Advantages, algo: AlgoConfig, metrics: dict[str, float]
) -> tuple[TokenBatch, Advantages] | None:
    """Count the rows whose advantage is 0 on every trained token; with ``algo.drop_zero_advantage``
    drop them (the batch and the advantages then end at the longest row kept; None if none is left)."""
    keep = ((adv.advantages * batch.loss_mask) != 0).any(dim=1).nonzero().squeeze(1)  # (B',) rows with signal
    metrics["batch/zero_adv_rows"] = float(batch.batch_size - keep.numel())
    if not algo.drop_zero_advantage:
        return batch, adv
    metrics["batch/skipped_zero_adv"] = float(batch.batch_size - keep.numel())
    if keep.numel() == 0:
        return None
    kept = adv.advantages[keep][:, : int(batch.lengths[keep].max())]  # (B', T')
    return batch.select(keep), Advantages(kept, None, adv.metrics)


def _step_demos(demos: TokenBatch | None, algo: AlgoConfig, step: int) -> TokenBatch | None:
    """The demonstration episodes optimizer step ``step`` imitates (None: no supervised term)."""
    if demos is None or algo.demo_loss_coef == 0:
        return None
    first = step * algo.demo_episodes
    return demos.select(torch.arange(first, first + algo.demo_episodes) % demos.batch_size)  # demo_episodes rows


#: Metrics that are a micro-batch's share of the minibatch loss (they carry its denominator): summed.
#: ``actor/ratio_max`` is a max; every other metric is a token mean, weighted by the micro-batch's
#: share of the minibatch's trained tokens (exact over any cut of the minibatch into micro-batches).
LOSS_SHARES = frozenset({"actor/pg_loss", "critic/vf_loss", "actor/demo_nll"})


def minibatch_step(
    batch: TokenBatch,
    rows: Tensor,
    adv: Advantages,
    old: OldPass,
    actor: TrainModel,
    critic: TrainModel | None,
    algo: AlgoConfig,
    optim: OptimConfig,
    *,
    demos: TokenBatch | None = None,
) -> tuple[dict[str, Tensor], bool, int]:
    """One optimizer step on the minibatch ``rows`` (whole trajectories), micro-batch by micro-batch;
    with ``demos`` (the step's demonstration episodes) the warm start's loss on them first (``demo_step``).

    This rank runs its micro-batches of the minibatch (``batching.rank_plan``: a token-balanced
    shard, packed by length); every loss carries the WHOLE minibatch's denominator, so the
    gradients accumulated over micro-batches and averaged over ranks by the backend (see
    ``backend``) equal the whole minibatch's gradient.

    Returns (the minibatch's metrics as scalar tensors, reduced over the ranks: loss shares summed,
    ``actor/ratio_max`` a max, token means (``actor/entropy`` among them) weighted by tokens; grad
    norms; whether the optimizer stepped; tokens this rank processed).
    """
    lmask = batch.loss_mask[rows]  # (n, T) 1 = token trained on
    denom = _denominator(lmask, algo.loss_agg)
    trained_tokens = max(float(lmask.sum()), 1.0)
    plan = _micro_batches(rows, batch.lengths, actor, optim)
    device = batch.input_ids.device
    sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), device=device))
    tokens = 0
    if demos is not None:
        tokens += demo_step(demos, actor, algo, optim, sums)
    for i, micro in enumerate(plan):
        mb = batch.select(micro.rows)
        mrows, t = micro.rows, mb.seq_len
        last = i == len(plan) - 1
        keep = 0.0 if micro.padding else 1.0  # a padding micro-batch adds nothing (see batching)
        share = keep * float(mb.loss_mask.sum()) / trained_tokens  # weight of its token means
        # entropy in every micro-batch: for the bonus, else a metric over the whole minibatch (micro-batch 0
        # alone would be its longest rows, as micro-batches are cut longest first)
        with actor.forward_context(last_micro_batch=last):
            logprobs, entropy = token_logprobs(
                actor.forward_module,
                mb.input_ids,
                mb.attention_mask,
                with_entropy=True,
                entropy_grad=algo.entropy_coef > 0,
                positions=mb.loss_mask > 0,
            )  # (b, t) real where loss_mask = 1, the only tokens the losses read
            loss, m = ppo_policy_loss(
                logprobs,
                old.logprobs[mrows, :t],
                adv.advantages[mrows, :t],
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
                assert old.ref_logprobs is not None
                kl, km = kl_loss(
                    logprobs,
                    old.ref_logprobs[mrows, :t],
                    mb.loss_mask,
                    estimator=algo.kl_estimator,
                    agg=algo.loss_agg,
                    denominator=denom,
                )
                loss = loss + algo.kl_coef * kl
                m.update(km)
            actor.backward(loss * keep, last_micro_batch=last)
        _accumulate(sums, m, keep, share)
        if critic is not None:
            assert adv.returns is not None and old.values is not None
            with critic.forward_context(last_micro_batch=last):
                values = critic.forward_module(mb.input_ids, mb.attention_mask).float()  # (b, t)
                vloss, vm = value_loss(
                    values,
                    old.values[mrows, :t],
                    adv.returns[mrows, :t],
                    mb.loss_mask,
                    clip_range=algo.value_clip,
                    agg=algo.loss_agg,
                    denominator=denom,
                )
                critic.backward(vloss * keep, last_micro_batch=last)
            _accumulate(sums, vm, keep, share)
        tokens += 0 if micro.padding else int(mb.lengths.sum())
    reduced = _reduce_over_ranks(sums)
    grad_norm, stepped = actor.step()
    reduced["actor/grad_norm"] = torch.tensor(grad_norm)
    if critic is not None:
        c_norm, c_stepped = critic.step()
        reduced["critic/grad_norm"] = torch.tensor(c_norm)
        stepped = stepped and c_stepped
    _count_step(actor, stepped, grad_norm, optim.max_consecutive_skips)
    return reduced, stepped, tokens


def demo_step(
    demos: TokenBatch, actor: TrainModel, algo: AlgoConfig, optim: OptimConfig, sums: dict[str, Tensor]
) -> int:
    """Accumulate ``algo.demo_loss_coef`` x the warm start's loss on the demonstration episodes
    ``demos`` into the actor's gradient (this rank's token-balanced shard of them; never the step's
    last micro-batch, so the gradient syncs with the policy loss's). The loss is the mean negative
    log-likelihood per demonstrated token over all of ``demos``, added to ``sums["actor/demo_nll"]``
    as this rank's share. Returns the tokens this rank processed."""
    denom = max(float((demos.loss_mask > 0).sum()), 1.0)  # every demonstrated token of the step
    rows = torch.arange(demos.batch_size)  # (n,)
    plan = _micro_batches(rows, demos.lengths, actor, optim)
    tokens = 0
    for micro in plan:
        mb = demos.select(micro.rows)
        keep = 0.0 if micro.padding else 1.0
        targets = mb.loss_mask > 0  # (b, t) True = a demonstrated response token
        with actor.forward_context(last_micro_batch=False):
            logp, _ = token_logprobs(actor.forward_module, mb.input_ids, mb.attention_mask, positions=targets)
            nll = -(logp * targets).sum() / denom  # this micro-batch's share of the rows' mean
            actor.backward(nll * (algo.demo_loss_coef * keep), last_micro_batch=False)
        sums["actor/demo_nll"] = sums["actor/demo_nll"] + keep * nll.detach()
        tokens += 0 if micro.padding else int(mb.lengths.sum())
    return tokens


def _micro_batches(rows: Tensor, lengths: Tensor, actor: TrainModel, optim: OptimConfig) -> list[MicroBatch]:
    """This rank's micro-batches of ``rows`` (``batching.rank_plan``: a token-balanced shard, packed by length)."""
    ranks = actor.ranks
    return rank_plan(
        rows,
        lengths,
        world_size=ranks.world_size,
        rank=ranks.rank,
        max_rows=optim.micro_batch_size,
        max_tokens=optim.micro_batch_tokens,
    )


def _accumulate(sums: dict[str, Tensor], metrics: dict[str, Tensor], keep: float, share: float) -> None:
    """Add one micro-batch's ``metrics`` to ``sums`` (see ``LOSS_SHARES``); a padding micro-batch
    (``keep`` 0) adds zeros, so every rank holds the same keys for the reduction."""
    for k, v in metrics.items():
        v = v.detach()
        if k == "actor/ratio_max":
            sums[k] = torch.maximum(sums[k], v)  # a padding row is a real row of the minibatch
        elif k in LOSS_SHARES:
            sums[k] = sums[k] + keep * v
        else:
            sums[k] = sums[k] + share * v


def _reduce_over_ranks(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every rank's ``sums`` combined: one all-reduce for the sums, one for the max (no-op at 1 rank)."""
    keys = sorted(k for k in sums if k != "actor/ratio_max")
    packed = all_reduce(torch.stack([sums[k].float() for k in keys])) if keys else torch.zeros(0)
    out = {k: packed[i] for i, k in enumerate(keys)}
    if "actor/ratio_max" in sums:
        out["actor/ratio_max"] = all_reduce(sums["actor/ratio_max"].float().clone(), op="max")
    return out


def _count_step(actor: TrainModel, stepped: bool, grad_norm: float, max_skips: int) -> None:
    """Count a skipped step (non-finite gradient norm); too many in a row abort the update."""
    if stepped:
        actor.consecutive_skips = 0
        return
    actor.consecutive_skips += 1
    log.warning(
        "non-finite gradient norm (actor %s): optimizer step skipped (%d in a row)", grad_norm, actor.consecutive_skips
    )
    if actor.consecutive_skips >= max_skips:
        raise NonFiniteUpdateError(
            f"{actor.consecutive_skips} optimizer steps in a row had a non-finite gradient norm "
            f"(optim.max_consecutive_skips={max_skips}): the loss or the model has "
            "diverged; lower optim.lr, check the batch's rewards / log-probs, or roll back to the last checkpoint"
        )


def _denominator(loss_mask: Tensor, agg: str) -> float:
    """Token count (token-mean) or sequence count (seq-mean-*) of a whole minibatch."""
    if agg == "token-mean":
        return max(float(loss_mask.sum()), 1.0)
    return max(float((loss_mask.sum(dim=1) > 0).sum()), 1.0)

"""KL divergence to a reference policy: per-token estimators k1/k2/k3, in-reward or in-loss.

With samples drawn from the current policy pi and ``log_ratio = log pi(x) - log ref(x)``:

* ``k1 = log_ratio``                                  unbiased, high variance, can be negative
* ``k2 = 0.5 * log_ratio ** 2``                       biased, low variance, >= 0
* ``k3 = exp(-log_ratio) - 1 + log_ratio``            unbiased, low variance, >= 0 (Schulman)

StarPO-S uses no KL; vanilla StarPO may put it in the reward (PPO style) or in the loss (GRPO style).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ragen_tasks.algos.losses import LossAgg, aggregate_loss
from ragen_tasks.algos.masked import check_mask, check_same_shape, masked_mean

KLEstimator = Literal["k1", "k2", "k3"]

# log-ratios are clamped to this range before exp() so a single wild token cannot give inf/NaN.
LOG_RATIO_CLAMP = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL estimate of the current policy from the reference.

    Args:
        logprobs: (B, T) float, log pi(token) under the policy being trained (or that sampled).
        ref_logprobs: (B, T) float, log ref(token) under the reference policy.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring). The log-ratio is
            clamped to [-20, 20] for k3's exp.

    Returns:
        (B, T) float per-token estimates (apply a mask before reducing).
    """
    check_same_shape(logprobs, "logprobs", ref_logprobs=ref_logprobs)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(-lr) - 1.0 + lr
    raise ValueError(f"estimator={estimator!r}: expected one of 'k1', 'k2', 'k3'")


def kl_in_reward(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Subtract ``kl_coef * KL`` from the reward of every policy token (PPO-style KL penalty).

    Args:
        token_rewards: (B, T) float, task reward per token (see ``token_level_rewards``).
        logprobs: (B, T) float, log-probs under the sampling policy (no gradient needed).
        ref_logprobs: (B, T) float, log-probs under the reference policy.
        response_mask: (B, T) 0/1; 1 = token the policy sampled. The penalty is applied there only.
        kl_coef: penalty coefficient (>= 0).
        estimator: KL estimator, see ``kl_estimate``.

    Returns:
        ``(rewards (B, T), metrics)`` with ``metrics["actor/reward_kl"]`` the token-mean KL and
        ``metrics["actor/reward_kl_coef"]`` the coefficient.
    """
    check_same_shape(
        token_rewards, "token_rewards", logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask
    )
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0")
    m = check_mask(response_mask, "response_mask")
    kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), estimator)
    kl = torch.where(m, kl, torch.zeros_like(kl))
    rewards = token_rewards - kl_coef * kl
    metrics = {
        "actor/reward_kl": masked_mean(kl, m).detach(),
        "actor/reward_kl_coef": token_rewards.new_tensor(float(kl_coef)),
    }
    return rewards, metrics


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    estimator: KLEstimator = "k3",
    agg: LossAgg = "token-mean",
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference as a loss term (GRPO style); the caller adds ``kl_coef * loss``.

    Args:
        logprobs: (B, T) float, log-probs under the policy being trained (gradients flow).
        ref_logprobs: (B, T) float, log-probs under the reference policy (treated as constant).
        loss_mask: (B, T) 0/1; 1 = token trained on.
        estimator: KL estimator, see ``kl_estimate`` (k3 is the usual low-variance choice).
        agg, denominator: aggregation, see ``aggregate_loss``.

    Returns:
        ``(loss, {"actor/kl_loss": ...})``.
    """
    kl = kl_estimate(logprobs, ref_logprobs.detach(), estimator)
    loss = aggregate_loss(kl, loss_mask, agg, denominator=denominator)
    return loss, {"actor/kl_loss": masked_mean(kl.detach(), loss_mask)}

"""Pure RL math of StarPO / StarPO-S: tensors in, tensors out. No model, no config object, no I/O.

Mask convention: (B, T) 0/1 masks, 1 = token the policy sampled / is trained on; token-level outputs
are 0 where the mask is 0. Losses return ``(loss, metrics)`` with namespaced metric keys.
"""

from ragen_tasks.algos.advantages import (
    batch_norm_advantages,
    gae_advantages,
    group_stats,
    grpo_advantages,
    grpo_scores,
)
from ragen_tasks.algos.echo_trap import (
    EchoTrapRules,
    EchoTrapSignal,
    detect_echo_trap,
    first_signals,
    latest_signals,
)
from ragen_tasks.algos.filtering import filter_groups, num_groups_kept
from ragen_tasks.algos.health import (
    mean_metrics,
    rollout_health,
    rollout_health_from_trajectories,
    staleness_health,
)
from ragen_tasks.algos.kl import kl_estimate, kl_in_reward, kl_loss
from ragen_tasks.algos.losses import (
    aggregate_loss,
    entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)
from ragen_tasks.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from ragen_tasks.algos.rewards import last_token_index, token_level_rewards, turn_level_rewards

__all__ = [
    "EchoTrapRules",
    "EchoTrapSignal",
    "aggregate_loss",
    "batch_norm_advantages",
    "detect_echo_trap",
    "entropy_from_logits",
    "filter_groups",
    "first_signals",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "grpo_scores",
    "kl_estimate",
    "kl_in_reward",
    "kl_loss",
    "last_token_index",
    "latest_signals",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_metrics",
    "num_groups_kept",
    "ppo_policy_loss",
    "rollout_health",
    "rollout_health_from_trajectories",
    "staleness_health",
    "token_level_rewards",
    "turn_level_rewards",
    "value_loss",
]

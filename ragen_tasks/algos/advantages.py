"""Advantage estimators for StarPO: GAE (critic), GRPO (group z-score), batch-normalised returns,
per-turn TD(lambda) against a known state value.

All functions are pure and vectorised over the batch. Token-level outputs are (B, T) and are
exactly 0 where the mask is 0 (prompt, observation and padding tokens), whatever those positions
held on input.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ragen_tasks.algos.masked import check_mask, check_same_shape, masked_whiten

StdLevel = Literal["group", "batch"]


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over policy tokens only.

    The recursion runs over the positions where ``response_mask`` is 1 and BRIDGES the others: for
    a policy token t whose next policy token is t' (skipping any observation tokens between them),
    ``delta_t = r_t + gamma * V(t') - V(t)`` and ``A_t = delta_t + gamma * lam * A_t'``. After the
    last policy token of a row, ``V = 0`` and ``A = 0`` (the episode is over). Rewards and values at
    mask-0 positions are ignored, so place rewards on policy tokens (see ``token_level_rewards``).

    Args:
        token_rewards: (B, T) float, reward on policy tokens (usually only on the last one).
        values: (B, T) float, critic value V(t) of each token's state.
        response_mask: (B, T) 0/1; 1 = token the policy sampled (trained on), 0 = prompt/obs/pad.
        gamma: discount per policy token, in [0, 1].
        lam: GAE lambda, in [0, 1].
        whiten: whiten the advantages with the batch mean/std over mask-1 tokens (common practice);
            the returns are never whitened.

    Returns:
        ``(advantages, returns)``, both (B, T) float and 0 where the mask is 0.
        ``returns = A + V`` (before whitening) is the critic's regression target.
    """
    check_same_shape(token_rewards, "token_rewards", values=values, response_mask=response_mask)
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be (B, T), got shape {tuple(token_rewards.shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must both lie in [0, 1]")
    m = check_mask(response_mask, "response_mask")
    b, t = token_rewards.shape
    # Pack each row's policy tokens to the left: (B, L), L = most policy tokens in a row. Only mask-1
    # entries are read, so garbage (even NaN) at mask-0 positions never enters the arithmetic.
    rank = m.long().cumsum(dim=1) - 1  # (B, T) index of a policy token among its row's policy tokens
    rows, cols = m.nonzero(as_tuple=True)  # (P,) each, row-major: P = number of policy tokens
    ranks = rank[rows, cols]  # (P,)
    length = int(m.sum(dim=1).max().item()) if b > 0 and t > 0 else 0
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    packed_r = torch.zeros(b, length + 1, dtype=dtype, device=values.device)  # one zero column past the end
    packed_v = torch.zeros(b, length + 1, dtype=dtype, device=values.device)
    packed_r[rows, ranks] = token_rewards[rows, cols].to(dtype)
    packed_v[rows, ranks] = values[rows, cols].to(dtype)
    # delta_k = r_k + gamma * V_{k+1} - V_k; V past a row's last policy token is 0, and so is delta
    delta = packed_r[:, :-1] + gamma * packed_v[:, 1:] - packed_v[:, :-1]  # (B, L)
    packed_adv = _discounted_reverse_cumsum(delta, gamma * lam)  # (B, L)
    advantages = torch.zeros(b, t, dtype=dtype, device=values.device)
    advantages[rows, cols] = packed_adv[rows, ranks]
    values = torch.where(m, values.to(dtype), torch.zeros_like(advantages))
    returns = torch.where(m, advantages + values, torch.zeros_like(advantages))
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


def _discounted_reverse_cumsum(x: Tensor, c: float, chunk: int = 256) -> Tensor:
    """``out[:, k] = sum_{j >= k} c ** (j - k) * x[:, j]`` for x (B, L), vectorised.

    Chunks of ``chunk`` columns are done with one matmul by an upper-triangular matrix of powers of
    c; chunks are chained right to left through ``out[:, chunk_start]`` (L / chunk small steps).
    """
    b, length = x.shape
    if length == 0:
        return x.clone()
    size = min(chunk, length)
    pad = (-length) % size
    xp = torch.nn.functional.pad(x, (0, pad))  # zeros after the end change nothing
    k = torch.arange(size, device=x.device)
    diff = (k.unsqueeze(0) - k.unsqueeze(1)).to(torch.float64)  # (size, size): [row k, col j] = j - k
    powers = torch.where(diff >= 0, torch.tensor(c, dtype=torch.float64).pow(diff.clamp(min=0)), 0.0)
    weights = powers.to(x.dtype).T  # (size, size): x_chunk @ weights sums c^(j-k) x_j over j >= k
    decay = torch.tensor(c, dtype=torch.float64).pow((size - k).to(torch.float64)).to(x.dtype)  # (size,)
    out = torch.empty_like(xp)
    carry = torch.zeros(b, dtype=x.dtype, device=x.device)  # out at the first column of the next chunk
    for start in range(xp.shape[1] - size, -1, -size):
        block = xp[:, start : start + size] @ weights + carry.unsqueeze(1) * decay  # (B, size)
        out[:, start : start + size] = block
        carry = block[:, 0]
    return out[:, :length]


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Map group ids to 0..G-1. Returns (unique_ids (G,) sorted ascending, inverse (N,), counts (G,))."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be (N,), got shape {tuple(group_ids.shape)}")
    unique, inverse, counts = torch.unique(group_ids, sorted=True, return_inverse=True, return_counts=True)
    return unique, inverse, counts


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-group mean and unbiased std of trajectory rewards.

    Args:
        scores: (N,) float, trajectory rewards.
        group_ids: (N,) int, trajectories with the same id share an initial state.

    Returns:
        ``(unique_ids (G,) ascending, mean (G,), std (G,), counts (G,))``. The std uses Bessel's
        correction (n - 1, like ``torch.std``); a singleton group has std 0 (it carries no
        in-group signal), and a group of identical rewards has std exactly 0.
    """
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be (N,): one per trajectory"
        )
    unique, inverse, counts = _group_index(group_ids)
    g = unique.shape[0]
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    x = scores.to(dtype)
    n = counts.to(dtype)
    total = torch.zeros(g, dtype=dtype, device=x.device).index_add_(0, inverse, x)
    mean = total / n
    sq = torch.zeros(g, dtype=dtype, device=x.device).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    gmax = torch.full((g,), float("-inf"), dtype=dtype, device=x.device).scatter_reduce_(0, inverse, x, "amax")
    gmin = torch.full((g,), float("inf"), dtype=dtype, device=x.device).scatter_reduce_(0, inverse, x, "amin")
    std = torch.where((counts > 1) & (gmax > gmin), std, torch.zeros_like(std))
    return unique, mean, std, counts


def grpo_scores(
    scores: Tensor,
    group_ids: Tensor,
    *,
    scale_by_std: bool = True,
    std_level: StdLevel = "group",
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantage per trajectory: reward minus its group's mean, optionally divided by a std.

    Edge cases (decided here, tested):
      * singleton group (one rollout for that initial state): advantage 0 (no baseline exists);
      * zero-variance group (all rewards equal): advantage exactly 0 (no signal; such groups are
        what uncertainty filtering removes).

    Args:
        scores: (N,) float, trajectory rewards R.
        group_ids: (N,) int, rollouts sharing an initial state share an id.
        scale_by_std: divide by a std (GRPO). False = Dr. GRPO (mean-centring only).
        std_level: ``"group"`` divides by each group's unbiased std (GRPO, DeepSeekMath);
            ``"batch"`` divides by the unbiased std of all N rewards (group-mean baseline, batch-level
            scale, as in Lite PPO / REINFORCE++-baseline). Ignored when ``scale_by_std=False``.
        eps: added to the std before dividing.

    Returns:
        (N,) float advantages.
    """
    if std_level not in ("group", "batch"):
        raise ValueError(f"std_level={std_level!r}: expected 'group' or 'batch'")
    _, mean, std, counts = group_stats(scores, group_ids)
    _, inverse, _ = _group_index(group_ids)
    x = scores.to(mean.dtype)
    centered = x - mean[inverse]  # (N,)
    if scale_by_std:
        if std_level == "group":
            scale = std[inverse] + eps
        else:
            batch_std = x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)
            scale = (batch_std + eps).expand_as(centered)
        # a denominator of 0 only happens together with a zero numerator (eps = 0): define it as 0
        centered = centered / torch.where(scale > 0, scale, torch.ones_like(scale))
    no_signal = (counts[inverse] < 2) | (std[inverse] == 0)
    return torch.where(no_signal, torch.zeros_like(centered), centered)


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    scale_by_std: bool = True,
    std_level: StdLevel = "group",
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages broadcast to every policy token of each trajectory (see ``grpo_scores``).

    Normalisation happens over trajectory rewards within the group (common practice, as in verl and
    TRL), not over tokens; every policy token of a trajectory gets the same advantage.

    Args:
        scores: (N,) float, trajectory rewards.
        group_ids: (N,) int, same id = same initial state.
        response_mask: (N, T) 0/1; 1 = token the policy sampled (trained on).
        scale_by_std, std_level, eps: see ``grpo_scores``.

    Returns:
        (N, T) float, the trajectory's advantage on mask-1 tokens, 0 elsewhere.
    """
    m = check_mask(response_mask, "response_mask")
    if m.dim() != 2 or m.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask has shape {tuple(m.shape)}, expected ({scores.shape[0]}, T): one row per score"
        )
    adv = grpo_scores(scores, group_ids, scale_by_std=scale_by_std, std_level=std_level, eps=eps)  # (N,)
    full = adv.unsqueeze(1).expand(m.shape)
    return torch.where(m, full, torch.zeros_like(full))


def batch_norm_advantages(scores: Tensor, response_mask: Tensor, *, eps: float = 1e-6) -> Tensor:
    """The paper's "normalised cumulative reward": z-score of trajectory rewards over the batch.

    Each trajectory's advantage is ``(R - mean(R)) / (std(R) + eps)`` (unbiased std over the N
    trajectories), broadcast to its policy tokens. With one trajectory, or all rewards equal, every
    advantage is exactly 0.

    Args:
        scores: (N,) float, trajectory rewards.
        response_mask: (N, T) 0/1; 1 = token the policy sampled (trained on).

    Returns:
        (N, T) float advantages, 0 where the mask is 0.
    """
    m = check_mask(response_mask, "response_mask")
    if scores.dim() != 1 or m.dim() != 2 or m.shape[0] != scores.shape[0]:
        raise ValueError(f"scores {tuple(scores.shape)} must be (N,) and response_mask {tuple(m.shape)} must be (N, T)")
    x = scores.to(torch.float32) if not scores.is_floating_point() else scores
    if x.numel() < 2 or bool((x.max() == x.min()).item()):
        adv = torch.zeros_like(x)
    else:
        adv = (x - x.mean()) / (x.std() + eps)
    full = adv.unsqueeze(1).expand(m.shape)
    return torch.where(m, full, torch.zeros_like(full))


def turn_td_advantages(turn_rewards: Tensor, turn_values: Tensor, turn_valid: Tensor, *, lam: float) -> Tensor:
    """Per-turn TD(lambda) advantages against a known state value, whitened over the batch's turns.

    A turn's TD error is ``delta_k = r_k + V_{k+1} - V_k`` (gamma = 1): what the turn's reward and the
    value of the state it led to add to the value of the state it was played in. The advantage of turn
    k is ``A_k = sum_{j >= k} lam^(j - k) delta_j`` over the row's turns: ``lam = 0`` credits a turn
    with its own TD error only; ``lam = 1`` gives the return from the turn less ``V_k`` (the Monte-Carlo
    return with V as its baseline). With a value that is 0 once the episode is over the errors of a
    row sum to ``R - V_0``: V is a potential (Ng et al., 1999), so shaping by it leaves the best
    policy unchanged. The advantages are then whitened over every valid turn of the batch (mean and
    unbiased std); fewer than two valid turns give 0.

    Args:
        turn_rewards: (B, K) float, each turn's reward (env rewards + the turn's format penalty).
        turn_values: (B, K + 1) float; ``[b, k]`` is V of the state turn k was played in, and
            ``[b, n_b]`` (n_b = the row's valid turns) the value after its last turn, 0 where the
            episode is over. Entries after ``n_b`` are ignored.
        turn_valid: (B, K) 0/1; 1 = a real turn, a prefix of each row (0 = padding).
        lam: the TD(lambda) weight in [0, 1].

    Returns:
        (B, K) float advantages, 0 on padding turns.
    """
    valid = check_mask(turn_valid, "turn_valid", tuple(turn_rewards.shape))
    b, k = turn_rewards.shape
    if tuple(turn_values.shape) != (b, k + 1):
        raise ValueError(
            f"turn_values has shape {tuple(turn_values.shape)}, expected ({b}, {k + 1}): one more than turns"
        )
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam} must be in [0, 1]")
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("turn_valid must be a prefix of each row: a real turn after a padding turn")
    delta = torch.where(valid, turn_rewards + turn_values[:, 1:] - turn_values[:, :-1], 0.0)  # (B, K)
    return whiten_turns(_discounted_reverse_cumsum(delta, lam), valid)  # the sum is 0 past each row's last turn


def whiten_turns(turn_advantages: Tensor, turn_valid: Tensor) -> Tensor:
    """Per-turn advantages (B, K) whitened over the batch's valid turns (``turn_valid`` (B, K) 0/1:
    mean and unbiased std); fewer than two valid turns give 0 (no spread to scale by)."""
    valid = check_mask(turn_valid, "turn_valid", tuple(turn_advantages.shape))
    if int(valid.sum()) < 2:
        return torch.zeros_like(turn_advantages)
    return masked_whiten(turn_advantages, valid)

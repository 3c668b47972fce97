"""Reward assembly: per-trajectory (or per-turn) scalars -> token-level reward tensors.

StarPO's trajectory reward R (sum of the turns' env rewards and format penalties, already summed
in ``Trajectory.reward``) is placed on the LAST token of the sequence where the response mask is 1,
i.e. the last token the policy sampled. Every other position gets 0. Optional per-turn placement
puts each turn's reward on the last sampled token of that turn instead (denser credit for GAE).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ragen_tasks.algos.masked import check_mask


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last position where ``mask`` is 1, per row.

    Args:
        mask: (B, T) 0/1; 1 = token the policy sampled.

    Returns:
        (B,) int64. Raises ValueError if a row has no 1 (such a row cannot carry a reward).
    """
    m = check_mask(mask, "response_mask")
    if m.dim() != 2:
        raise ValueError(f"response_mask must be (B, T), got shape {tuple(m.shape)}")
    has_token = m.any(dim=1)
    if not bool(has_token.all()):
        row = int((~has_token).nonzero()[0].item())
        raise ValueError(
            f"response_mask row {row} has no policy token: a trajectory without sampled tokens cannot carry "
            "a reward; drop it before building the batch"
        )
    t = m.shape[1]
    positions = torch.arange(t, device=m.device).expand_as(m)
    return torch.where(m, positions, torch.full_like(positions, -1)).max(dim=1).values


def token_level_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each trajectory's scalar reward on its last policy-sampled token.

    Args:
        scores: (B,) float, the trajectory reward R (sum of step rewards + format penalties).
        response_mask: (B, T) 0/1; 1 = token the policy sampled. Every row needs at least one 1.

    Returns:
        (B, T) float, ``R[b]`` at ``(b, last_token_index[b])`` and 0 everywhere else.
    """
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)}, expected ({response_mask.shape[0]},): one reward per row of "
            "response_mask"
        )
    last = last_token_index(response_mask)  # (B,)
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(out.shape[0], device=out.device), last] = scores
    return out


def turn_level_rewards(
    turn_rewards: Tensor,
    turn_ends: Tensor,
    turn_valid: Tensor,
    response_mask: Tensor,
) -> Tensor:
    """Place each turn's reward on the last policy-sampled token of that turn.

    A turn spans ``[turn_start, turn_end)`` in the token sequence (``Trajectory.turn_ends``), so its
    last sampled token is ``turn_end - 1``. Turns are padded to K per row; ``turn_valid`` marks the
    real ones. The sum over tokens of the result equals the sum of the valid turn rewards.

    Args:
        turn_rewards: (B, K) float, reward of each turn (env rewards + format penalty of the turn).
        turn_ends: (B, K) int, index one past the turn's last sampled token.
        turn_valid: (B, K) 0/1; 1 = real turn, 0 = padding (its reward and end are ignored).
        response_mask: (B, T) 0/1; 1 = token the policy sampled. ``turn_end - 1`` of every valid
            turn must be a 1 position (a turn whose response is empty cannot carry a reward).

    Returns:
        (B, T) float token-level rewards.
    """
    valid = check_mask(turn_valid, "turn_valid", tuple(turn_rewards.shape))
    if tuple(turn_ends.shape) != tuple(turn_rewards.shape):
        raise ValueError(
            f"turn_ends has shape {tuple(turn_ends.shape)}, expected {tuple(turn_rewards.shape)} like turn_rewards"
        )
    m = check_mask(response_mask, "response_mask")
    b, t = m.shape
    if turn_rewards.shape[0] != b:
        raise ValueError(
            f"turn_rewards has {turn_rewards.shape[0]} rows but response_mask has {b}: one row per trajectory"
        )
    pos = turn_ends.long() - 1  # (B, K) last sampled token of each turn
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    if bool(((pos < 0) | (pos >= t)).any()):
        raise ValueError(f"turn_ends must lie in [1, {t}] for valid turns (they index one past the turn's last token)")
    rows = torch.arange(b, device=m.device).unsqueeze(1).expand_as(pos)
    if bool((valid & ~m[rows, pos]).any()):
        raise ValueError(
            "a valid turn ends on a token with response_mask 0: turn_ends[k] - 1 must be the turn's last sampled "
            "token (is the turn empty, or are turn_ends shifted?)"
        )
    out = torch.zeros((b, t), dtype=turn_rewards.dtype, device=turn_rewards.device)
    vals = torch.where(valid, turn_rewards, torch.zeros_like(turn_rewards))
    out.index_put_((rows.reshape(-1), pos.reshape(-1)), vals.reshape(-1), accumulate=True)
    return out

"""StarPO-S uncertainty-based filtering: keep the groups whose rollouts disagree the most.

Trajectories sharing an initial state form a group. The in-group std of trajectory rewards measures
how uncertain the policy still is on that task; groups with zero std carry no GRPO signal. StarPO-S
keeps the top ``keep_ratio`` of groups by that std.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ragen_tasks.algos.advantages import group_stats

FilterMode = Literal["highest_std", "lowest_std", "nonzero_std"]

# ceil(keep_ratio * n_groups) is taken after subtracting this, so 0.3 * 10 keeps 3 groups, not 4.
_RATIO_TOL = 1e-9


def num_groups_kept(keep_ratio: float, n_groups: int) -> int:
    """``ceil(keep_ratio * n_groups)`` (float error tolerated), at least 1 when ``n_groups > 0``."""
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio={keep_ratio} must lie in (0, 1]; 1 keeps every group (filter off)")
    if n_groups <= 0:
        return 0
    return max(1, min(n_groups, math.ceil(keep_ratio * n_groups - _RATIO_TOL)))


def filter_groups(
    rewards: Tensor,
    group_ids: Tensor,
    keep_ratio: float,
    mode: FilterMode = "highest_std",
) -> tuple[Tensor, dict[str, float]]:
    """Select trajectories by the in-group std of their rewards.

    The std is the unbiased std of ``group_stats`` (singleton or all-equal groups have std 0).
    Modes:
      * ``"highest_std"`` (StarPO-S): keep the ``ceil(keep_ratio * n_groups)`` groups with the
        LARGEST std (at least one group);
      * ``"lowest_std"`` (ablation): keep the same number of groups with the SMALLEST std;
      * ``"nonzero_std"``: keep every group whose std is > 0; ``keep_ratio`` is ignored (it is still
        validated). May keep nothing.
    Ties in std are broken deterministically by group id, smaller id first, in both sort orders.
    ``keep_ratio == 1`` with a std-ranked mode keeps every trajectory.

    Args:
        rewards: (N,) float, trajectory rewards.
        group_ids: (N,) int; trajectories with the same id share an initial state.
        keep_ratio: fraction of groups kept, in (0, 1].
        mode: one of the three modes above.

    Returns:
        ``(kept_indices, metrics)``: kept_indices is a (K,) int64 tensor of positions into
        ``rewards``, sorted ascending; metrics (floats) are ``filter/groups``, ``filter/kept_groups``,
        ``filter/kept_trajectories``, ``filter/kept_fraction`` (of trajectories),
        ``filter/zero_std_group_fraction``, ``filter/in_group_std_mean``, ``filter/in_group_std_max``
        (all groups), ``filter/kept_in_group_std_mean``, ``filter/kept_in_group_std_max`` (kept groups;
        0 when none is kept).
    """
    if mode not in ("highest_std", "lowest_std", "nonzero_std"):
        raise ValueError(f"mode={mode!r}: expected 'highest_std', 'lowest_std' or 'nonzero_std'")
    n_keep = num_groups_kept(keep_ratio, 1)  # validates keep_ratio
    unique, _, std, _ = group_stats(rewards, group_ids)  # unique ids ascending, std (G,)
    g = int(unique.shape[0])
    if mode == "nonzero_std":
        kept_group_pos = (std > 0).nonzero().flatten()
    else:
        n_keep = num_groups_kept(keep_ratio, g)
        # stable sort on std; groups are already in ascending id order, so equal stds keep id order
        order = torch.sort(std, descending=(mode == "highest_std"), stable=True).indices
        kept_group_pos = order[:n_keep]
    kept_ids = unique[kept_group_pos]
    kept_indices = torch.isin(group_ids, kept_ids).nonzero().flatten().to(torch.int64)  # ascending
    kept_std = std[kept_group_pos]
    n = int(rewards.shape[0])
    metrics = {
        "filter/groups": float(g),
        "filter/kept_groups": float(kept_ids.numel()),
        "filter/kept_trajectories": float(kept_indices.numel()),
        "filter/kept_fraction": float(kept_indices.numel()) / n if n else 0.0,
        "filter/zero_std_group_fraction": float((std == 0).float().mean().item()) if g else 0.0,
        "filter/in_group_std_mean": float(std.mean().item()) if g else 0.0,
        "filter/in_group_std_max": float(std.max().item()) if g else 0.0,
        "filter/kept_in_group_std_mean": float(kept_std.mean().item()) if kept_std.numel() else 0.0,
        "filter/kept_in_group_std_max": float(kept_std.max().item()) if kept_std.numel() else 0.0,
    }
    return kept_indices, metrics

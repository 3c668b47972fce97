"""Masked reductions and input checks shared by the algos: tensors in, tensors out.

Mask convention everywhere in ``ragen_tasks.algos``: a mask is a (B, T) tensor (bool, int or float
holding only 0/1) where 1 marks a token that counts (a token the policy sampled / is trained on)
and 0 marks prompt, observation or padding tokens. Values at mask-0 positions are never read into a
result: they may hold garbage (even NaN or inf) without changing anything.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_mask(mask: Tensor, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
    """Return ``mask`` as a bool tensor; raise ValueError if it is not 0/1 or has the wrong shape.

    Args:
        mask: any-shape tensor of 0/1 (bool, int or float).
        name: the argument's name, used in the error message.
        shape: the expected shape, or None to accept any.
    """
    if shape is not None and tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}: pass a mask the same shape as the values"
        )
    if mask.dtype == torch.bool:
        return mask
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        value = mask[bad][0].item()
        raise ValueError(f"{name} must hold only 0/1, found {value!r}: build masks as 0/1 (1 = token counts)")
    return mask != 0


def check_same_shape(reference: Tensor, reference_name: str, **others: Tensor) -> None:
    """Raise ValueError naming the first tensor in ``others`` whose shape differs from ``reference``."""
    for name, tensor in others.items():
        if tuple(tensor.shape) != tuple(reference.shape):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has {tuple(reference.shape)}: "
                "token-level tensors must all be (B, T)"
            )


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1 (garbage-safe: masked entries are replaced by 0).

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``; 1 = include.
        dim: reduce over this dim, or over everything if None.
    """
    m = check_mask(mask, "mask", tuple(values.shape))
    kept = torch.where(m, values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 where nothing is selected (never NaN).

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``; 1 = include.
        dim: reduce over this dim, or over everything if None.
    """
    m = check_mask(mask, "mask", tuple(values.shape))
    count = m.sum() if dim is None else m.sum(dim=dim)
    total = masked_sum(values, m, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance over all entries where ``mask`` is 1 (scalar).

    ``unbiased=True`` divides by n - 1 (Bessel); with n <= 1 selected entries the result is 0.

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``; 1 = include.
    """
    m = check_mask(mask, "mask", tuple(values.shape))
    n = m.sum()
    mean = masked_mean(values, m)
    centered = torch.where(m, values - mean, torch.zeros_like(values))
    sq = (centered**2).sum()
    denom = (n - 1) if unbiased else n
    if int(denom) <= 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return sq / denom.to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` with the mean and (unbiased) std of the entries where ``mask`` is 1.

    Returns ``(values - mean) / (std + eps)`` (or ``values / (std + eps)`` with the mean added back
    when ``shift_mean=False``) on mask-1 entries and exactly 0 on mask-0 entries.

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``; 1 = include in the statistics and the output.
        shift_mean: subtract the mean (True) or keep it (False).
        eps: added to the std for numerical safety.
    """
    m = check_mask(mask, "mask", tuple(values.shape))
    mean = masked_mean(values, m)
    std = masked_var(values, m, unbiased=True).sqrt()
    out = (values - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))

"""How a model is trained: backward, gradient clipping and the optimizer step, behind one interface.

``ppo_update`` only calls ``forward_context()``, ``backward(loss)`` and ``step()``; the torch
implementation is here, the DeepSpeed one in ``deepspeed_backend`` (imported only when chosen,
so CPU installs never import deepspeed). Pick one with :func:`make_train_model`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ragen_tasks.config import OptimConfig


class TrainModel(Protocol):
    """A model with its optimizer. ``module`` is the underlying nn.Module (for forward passes)."""

    module: nn.Module
    optimizer: Any  # the optimizer stepping ``module`` (a torch optimizer or ZeRO's wrapper); has ``param_groups``
    consecutive_skips: int

    def forward_context(self) -> contextlib.AbstractContextManager[Any]: ...
    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None: ...
    def step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients; return (pre-clip grad norm, stepped)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state to checkpoint (loadable with ``torch.load(weights_only=True)``)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output. Call AFTER the weights are loaded into ``module``."""
        ...


class TorchTrainModel:
    """Plain torch: accumulate grads, ``clip_grad_norm_``, skip the step when the norm is not finite."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float,
        amp_dtype: str = "float32",
        scheduler: Any = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.amp_dtype = amp_dtype
        self.consecutive_skips = 0

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.amp_dtype == "bfloat16":
            device_type = next(self.module.parameters()).device.type
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                yield
        else:
            yield

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        torch.autograd.backward(loss)

    def step(self) -> tuple[float, bool]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))  # pre-clip total norm
        stepped = math.isfinite(norm)
        if stepped:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def make_optimizer(module: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (foreach off: identical results across runs and backends)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)


def make_train_model(
    module: nn.Module, optimizer: torch.optim.Optimizer, optim: OptimConfig, *, scheduler: Any = None
) -> TrainModel:
    """Wrap ``module`` + ``optimizer`` in the backend ``optim.backend`` selects (torch or deepspeed)."""
    if optim.backend == "torch":
        return TorchTrainModel(
            module, optimizer, max_grad_norm=optim.max_grad_norm, amp_dtype=optim.amp_dtype, scheduler=scheduler
        )
    if optim.backend == "deepspeed":
        from ragen_tasks.training.deepspeed_backend import DeepSpeedTrainModel  # lazy: optional dependency

        return DeepSpeedTrainModel(module, optimizer, optim)
    raise ValueError(f"optim.backend={optim.backend!r}: expected 'torch' or 'deepspeed'")

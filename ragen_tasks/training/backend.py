"""How a model is trained: backward, gradient clipping and the optimizer step, behind one interface.

``ppo_update`` only calls ``forward_module``, ``forward_context()``, ``backward(loss)`` and
``step()``; the torch implementation is here, the DeepSpeed one in ``deepspeed_backend`` (imported
only when chosen, so CPU installs never import deepspeed). Pick one with :func:`make_train_model`.

Data parallel (``update.world_size`` > 1, see ``ragen_tasks.training.distributed``): every rank
builds the same model and wraps it; the torch backend in ``DistributedDataParallel``, DeepSpeed in
its ZeRO engine. Both AVERAGE gradients over the ranks, while each rank's loss already carries the
whole minibatch's denominator (its share of the minibatch loss), so ``backward`` multiplies the
loss by the world size: the averaged gradient is then the sum of the shares, the 1-rank gradient.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ragen_tasks.config import OptimConfig
from ragen_tasks.training.distributed import Ranks, current_ranks


class TrainModel(Protocol):
    """A model with its optimizer, on one data-parallel rank."""

    module: nn.Module  # the underlying nn.Module (weights to save, evaluation)
    forward_module: nn.Module  # what training forwards call: the DDP / ZeRO wrapper that syncs gradients
    optimizer: Any  # the optimizer stepping ``module`` (a torch optimizer or ZeRO's wrapper); has ``param_groups``
    consecutive_skips: int
    ranks: Ranks
    sharded_state: bool  # True: every rank holds its own part of the optimizer state (ZeRO at world size > 1)

    def forward_context(self, *, last_micro_batch: bool = True) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward AND backward: autocast, and no gradient sync before the last one."""
        ...

    def full_weights(self) -> contextlib.AbstractContextManager[Any]:
        """Inside, ``module`` holds all its weights on every rank (ZeRO-3 gathers its partitions;
        a collective: every rank enters it). For saving and checking weights."""
        ...

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
    """Plain torch: accumulate grads, ``clip_grad_norm_``, skip the step when the norm is not finite.
    At world size > 1 the module is wrapped in ``DistributedDataParallel`` (the optimizer state stays
    whole on every rank: it is replicated, not sharded)."""

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
        self.ranks = current_ranks()
        self.sharded_state = False
        self.forward_module: nn.Module = module
        if self.ranks.world_size > 1:
            device = next(module.parameters()).device
            self.forward_module = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None
            )

    @contextlib.contextmanager
    def forward_context(self, *, last_micro_batch: bool = True) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.amp_dtype == "bfloat16":
                device_type = next(self.module.parameters()).device.type
                stack.enter_context(torch.autocast(device_type=device_type, dtype=torch.bfloat16))
            if not last_micro_batch and isinstance(self.forward_module, torch.nn.parallel.DistributedDataParallel):
                stack.enter_context(self.forward_module.no_sync())  # accumulate locally; the last one syncs
            yield

    def full_weights(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # every rank holds every weight

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        torch.autograd.backward(loss * self.ranks.world_size)  # DDP averages the ranks' shares (module doc)

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

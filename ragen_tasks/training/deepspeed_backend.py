"""DeepSpeed ZeRO backend behind the same ``TrainModel`` interface as the torch one.

Imported only when ``OptimConfig.backend == "deepspeed"``. The engine wraps the caller's module and
torch optimizer (ZeRO stage from ``OptimConfig.zero_stage``; bf16 when ``amp_dtype == "bfloat16"``
on GPU). Gradient accumulation is driven by ``ppo_update``: every micro-batch loss already carries
the minibatch denominator, so DeepSpeed must not rescale it (``scale_wrt_gas=False``) and the
accumulation boundary is set explicitly on the last micro-batch.

On a machine without a GPU it runs on CPU with the gloo backend (world size 1 unless launched by
torchrun, see ``ragen_tasks.training.distributed``): set MASTER_ADDR / MASTER_PORT or let
:func:`init_distributed` default them. Forwards go through the engine (``forward_module``): ZeRO-3
counts micro-steps there, and without it every micro-batch's gradient would overwrite the last.

Optimizer state at world size > 1 with ZeRO >= 1 is sharded (``sharded_state``): each rank's
``state_dict`` is the inner torch optimizer's state over that rank's flat fp32 partition, and a
checkpoint holds one part per rank. Parts are only meaningful at the world size that wrote them
(the partition layout depends on it): see ``checkpoint.load_optimizers`` for the policy elsewhere.
Known limit: ZeRO decides on skipping non-finite steps itself (fp16 loss scaling); in fp32 / bf16 we
report the engine's global grad norm and count a non-finite one as skipped, but the engine may
already have applied it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ragen_tasks.config import OptimConfig
from ragen_tasks.training.distributed import current_ranks


def init_distributed() -> None:
    """Initialise torch.distributed once (gloo on CPU, nccl on GPU); world size 1 by default."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def ds_config(optim: OptimConfig) -> dict[str, Any]:
    """The DeepSpeed config for one trainer; accumulation is handled by the caller (see module doc)."""
    return {
        "train_micro_batch_size_per_gpu": 1,  # nominal: ppo_update feeds variable-size micro-batches
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": {"stage": optim.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": optim.amp_dtype == "bfloat16" and torch.cuda.is_available()},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainModel:
    """A DeepSpeed engine with the ``TrainModel`` methods ``ppo_update`` calls."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, optim: OptimConfig) -> None:
        import deepspeed

        init_distributed()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=ds_config(optim)
        )
        self.module: nn.Module = self.engine.module
        self.forward_module: nn.Module = self.engine
        self.consecutive_skips = 0
        self.ranks = current_ranks()
        self.zero_stage = optim.zero_stage
        self.sharded_state = optim.zero_stage >= 1 and self.ranks.world_size > 1
        self._autocast = optim.amp_dtype == "bfloat16" and not torch.cuda.is_available()

    @contextlib.contextmanager
    def forward_context(self, *, last_micro_batch: bool = True) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        if self._autocast:  # CPU bf16: autocast (DeepSpeed's bf16 mode targets GPUs)
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                yield
        else:
            yield

    def full_weights(self) -> contextlib.AbstractContextManager[Any]:
        if self.zero_stage < 3:
            return contextlib.nullcontext()  # stages 0-2 keep every weight on every rank
        import deepspeed

        gathered: contextlib.AbstractContextManager[Any] = deepspeed.zero.GatheredParameters(
            list(self.module.parameters()), modifier_rank=None
        )
        return gathered

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        # the engine averages the ranks' gradients; each loss is the rank's share (see backend's doc)
        self.engine.backward(loss * self.ranks.world_size, scale_wrt_gas=False)

    def step(self) -> tuple[float, bool]:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        return norm, math.isfinite(norm)

    def state_dict(self) -> dict[str, Any]:
        """The inner torch optimizer's state over this rank's flat fp32 partition(s). ZeRO's own
        state_dict holds a LossScaler object that ``torch.load(weights_only=True)`` refuses; the
        partitions themselves are rebuilt from the module's weights by ``deepspeed.initialize`` (fp32
        master weights equal the module's), so the moments and the step count are all a resume needs."""
        with self._inner_params():
            inner: torch.optim.Optimizer = self.optimizer.optimizer
            return inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("state"):
            return  # an optimizer that never stepped (e.g. checkpoint 0): nothing beyond the config's settings
        with self._inner_params():
            inner: torch.optim.Optimizer = self.optimizer.optimizer
            inner.load_state_dict(state)

    @contextlib.contextmanager
    def _inner_params(self) -> Iterator[None]:
        """ZeRO-3 keeps its inner optimizer's param groups empty between steps (the partitions are
        swapped in for the step only); put them in while the state is read or written, as ZeRO-3's
        own state_dict does."""
        if self.zero_stage < 3:
            yield
            return
        self.optimizer._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            self.optimizer._clear_fp32_optimizer_param_groups()

"""DeepSpeed ZeRO on CPU (gloo, world size 1): it follows the torch backend's loss trajectory, and a
checkpointed engine resumes on the same trajectory.

The two backends are compared stepping plain SGD: AdamW divides by sqrt(v), which turns float
round-off on a tiny gradient into an lr-sized change that differs between backends, CPUs and
thread counts. The resume test keeps AdamW (its moments are what a checkpoint must carry) and
compares DeepSpeed with itself.

Both tests share one process: DeepSpeed's first initialisation may JIT-compile a small op (about a
minute), later ones reuse it."""

import io
import math
import os

import pytest
import torch

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.synthetic import synthetic_trajectories
from ragen_tasks.data.token_batch import TokenBatch, collate
from ragen_tasks.training.backend import TrainModel, make_optimizer, make_train_model
from ragen_tasks.training.update import ppo_update
from tests.training._models import tiny_actor

ALGO = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)


def _optim(backend: str) -> OptimConfig:
    return OptimConfig(backend=backend, zero_stage=2, lr=1e-3, minibatch_size=8, micro_batch_size=4)


def _trainer(module: torch.nn.Module, optim: OptimConfig, *, sgd: bool = False) -> TrainModel:
    if sgd:
        return make_train_model(module, torch.optim.SGD(module.parameters(), lr=optim.lr), optim)
    return make_train_model(module, make_optimizer(module, lr=optim.lr, weight_decay=0.0), optim)


def _run(actor: TrainModel, optim: OptimConfig, gen: torch.Generator, batch: TokenBatch, steps: int) -> list[float]:
    """``steps`` updates; returns [pg_loss, grad_norm] per update."""
    out = []
    for _ in range(steps):
        m = ppo_update(batch, actor=actor, algo=ALGO, optim=optim, generator=gen)
        out += [m["actor/pg_loss"], m["actor/grad_norm"]]
    return out


def _losses(
    backend: str, steps: int = 3, *, device: str = "cpu", amp_dtype: str = "float32", sgd: bool = False
) -> list[float]:
    optim = _optim(backend).model_copy(update={"amp_dtype": amp_dtype})
    return _run(
        _trainer(tiny_actor(0).to(device), optim, sgd=sgd),
        optim,
        torch.Generator().manual_seed(0),
        collate(synthetic_trajectories()).to(device),
        steps,
    )


def _resumed_losses(steps_before: int = 1, steps_after: int = 2) -> list[float]:
    """DeepSpeed: ``steps_before`` updates, checkpoint (weights + optimizer state through the
    weights_only round trip the checkpoints use), fresh engine, resume, ``steps_after`` updates."""
    optim = _optim("deepspeed")
    module = tiny_actor(0)
    actor = _trainer(module, optim)
    gen = torch.Generator().manual_seed(0)
    batch = collate(synthetic_trajectories())
    _run(actor, optim, gen, batch, steps_before)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(actor.state_dict(), buffer)

    resumed_module = tiny_actor(1)  # other init: everything must come from the checkpoint
    resumed_module.load_state_dict(weights)  # weights BEFORE wrapping (ZeRO copies them into its partitions)
    resumed = _trainer(resumed_module, optim)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed_gen = torch.Generator()
    resumed_gen.set_state(gen.get_state())
    return _run(resumed, optim, resumed_gen, batch, steps_after)


@pytest.fixture
def deepspeed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    monkeypatch.setenv(
        "DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    )


@pytest.mark.slow
@pytest.mark.usefixtures("deepspeed_env")
def test_deepspeed_zero2_matches_torch_backend() -> None:
    assert _losses("deepspeed", sgd=True) == pytest.approx(_losses("torch", sgd=True), rel=1e-3, abs=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("deepspeed_env")
def test_deepspeed_resume_continues_the_same_trajectory() -> None:
    straight = _losses("deepspeed", steps=3)[2:]  # updates 2 and 3 of an uninterrupted run
    assert _resumed_losses() == pytest.approx(straight, rel=1e-4, abs=1e-6)


@pytest.mark.gpu
@pytest.mark.usefixtures("deepspeed_env")
def test_deepspeed_zero2_on_cuda_matches_torch_backend_and_runs_bf16() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert _losses("deepspeed", device="cuda", sgd=True) == pytest.approx(
        _losses("torch", device="cuda", sgd=True), rel=1e-3, abs=1e-5
    )
    bf16 = _losses("deepspeed", device="cuda", amp_dtype="bfloat16")  # DeepSpeed's own bf16 mode on GPU
    assert all(math.isfinite(v) for v in bf16) and all(g > 0 for g in bf16[1::2])

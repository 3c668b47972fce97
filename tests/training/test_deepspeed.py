"""DeepSpeed ZeRO on CPU (gloo, world size 1) follows the torch backend's loss trajectory.

ONE test: DeepSpeed's first initialisation may JIT-compile a small op (about a minute)."""

import os

import pytest
import torch

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.token_batch import collate
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.resume_harness import synthetic_trajectories, tiny_actor
from ragen_tasks.training.update import ppo_update


def _losses(backend: str, steps: int = 3) -> list[float]:
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    optim = OptimConfig(backend=backend, zero_stage=2, lr=1e-3, minibatch_size=8, micro_batch_size=4)
    actor_m = tiny_actor(0)
    actor = make_train_model(actor_m, make_optimizer(actor_m, lr=optim.lr, weight_decay=0.0), optim)
    gen = torch.Generator().manual_seed(0)
    batch = collate(synthetic_trajectories())
    out = []
    for _ in range(steps):
        m = ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=gen)
        out += [m["actor/pg_loss"], m["actor/grad_norm"]]
    return out


@pytest.mark.slow
def test_deepspeed_zero2_matches_torch_backend(monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    monkeypatch.setenv(
        "DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    )
    reference = _losses("torch")
    got = _losses("deepspeed")
    assert got == pytest.approx(reference, rel=1e-3, abs=1e-5)


def _resumed_losses(steps_before: int = 1, steps_after: int = 2) -> list[float]:
    """DeepSpeed: ``steps_before`` updates, checkpoint (weights + optimizer state through the
    weights_only round trip the checkpoints use), fresh engine, resume, ``steps_after`` updates."""
    import io

    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    optim = OptimConfig(backend="deepspeed", zero_stage=2, lr=1e-3, minibatch_size=8, micro_batch_size=4)
    module = tiny_actor(0)
    actor = make_train_model(module, make_optimizer(module, lr=optim.lr, weight_decay=0.0), optim)
    gen = torch.Generator().manual_seed(0)
    batch = collate(synthetic_trajectories())
    for _ in range(steps_before):
        ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=gen)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(actor.state_dict(), buffer)
    gen_state = gen.get_state()

    resumed_module = tiny_actor(1)  # other init: everything must come from the checkpoint
    resumed_module.load_state_dict(weights)  # weights BEFORE wrapping (ZeRO copies them into its partitions)
    resumed = make_train_model(resumed_module, make_optimizer(resumed_module, lr=optim.lr, weight_decay=0.0), optim)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed_gen = torch.Generator()
    resumed_gen.set_state(gen_state)
    out = []
    for _ in range(steps_after):
        m = ppo_update(batch, actor=resumed, algo=algo, optim=optim, generator=resumed_gen)
        out += [m["actor/pg_loss"], m["actor/grad_norm"]]
    return out


@pytest.mark.slow
def test_deepspeed_resume_continues_the_same_trajectory(monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    monkeypatch.setenv(
        "DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    )
    straight = _losses("deepspeed", steps=3)[2:]  # updates 2 and 3 of an uninterrupted run
    assert _resumed_losses() == pytest.approx(straight, rel=1e-4, abs=1e-6)

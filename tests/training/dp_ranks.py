"""The update on 1 or N data-parallel ranks, the same work either way: for ``test_data_parallel``.

``python -m torch.distributed.run --nproc-per-node N tests/training/dp_ranks.py OUT BACKEND:ZERO:ADV[:demo] ...``
runs, for each setting, three ``ppo_update`` calls on the same batch under N ranks; rank 0 writes
``{setting: update_losses(...)}`` to OUT (JSON). ``update_losses`` is the same work in the calling
process (world size 1, no launcher)."""

from __future__ import annotations

import json
import sys

import torch

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.synthetic import synthetic_trajectories
from ragen_tasks.data.token_batch import collate
from ragen_tasks.training.backend import make_train_model
from ragen_tasks.training.critic import make_critic
from ragen_tasks.training.update import ppo_update
from tests.training._models import tiny_actor


def update_losses(backend: str, zero_stage: int, advantage: str, demo: bool = False) -> list[list[float]]:
    """Per update: [pg_loss, actor grad norm, critic grad norm or 0, demo_nll or 0] of its steps, over
    3 updates.

    Plain SGD (not AdamW, whose division by sqrt(v) turns round-off into lr-sized steps), a batch
    whose rows differ in length (2 groups of 1-turn, 2 of 3-turn episodes) so the ranks' shards and
    micro-batch counts differ; minibatches of 5 (the last one 3 rows), micro-batches of 2 rows.
    ``demo``: with the supervised term, 3 demonstration rows of 2 and 4 turns, 2 per step (wrapping)."""
    optim = OptimConfig(
        backend=backend, zero_stage=zero_stage, lr=0.05, critic_lr=0.05, minibatch_size=5, micro_batch_size=2
    )
    algo = AlgoConfig(
        advantage=advantage,
        filter_keep_ratio=1.0,
        clip_high=0.28,
        demo_loss_coef=0.5 if demo else 0.0,
        demo_episodes=2,
    )
    demos = None
    if demo:
        demos = collate(synthetic_trajectories(1, 2, seed=3, turns=2) + synthetic_trajectories(1, 1, seed=4, turns=4))
    module = tiny_actor(0)
    critic_module = make_critic(module) if advantage == "gae" else None
    actor = make_train_model(module, torch.optim.SGD(module.parameters(), lr=optim.lr), optim)
    critic = None
    if critic_module is not None:
        critic = make_train_model(critic_module, torch.optim.SGD(critic_module.parameters(), lr=optim.lr), optim)
    rows = synthetic_trajectories(2, 2, seed=1, turns=1) + synthetic_trajectories(2, 2, seed=2, turns=3)
    batch = collate(rows)
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        m = ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=generator, critic=critic, demos=demos)
        out.append(
            [m["actor/pg_loss"], m["actor/grad_norm"], m.get("critic/grad_norm", 0.0), m.get("actor/demo_nll", 0.0)]
        )
    return out


if __name__ == "__main__":
    from ragen_tasks.training.distributed import exit_finished_rank, init_from_env

    path, settings = sys.argv[1], sys.argv[2:]
    ranks = init_from_env()
    results = {}
    for setting in settings:
        backend, zero, advantage, *demo = setting.split(":")
        results[setting] = update_losses(backend, int(zero), advantage, demo == ["demo"])
    if ranks.is_main:
        with open(path, "w") as f:
            json.dump(results, f)
    exit_finished_rank()

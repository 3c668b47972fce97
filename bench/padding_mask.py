"""Training passes with and without the padding mask, on real Sokoban demonstration episodes.

A ``TokenBatch`` is right-padded, so causal attention alone keeps every real token from the pads and
the training passes hand the model no mask (``training.critic.model_attention_mask``); this bench
measures what that saves against handing it the mask, as before. Two workloads, the `sokoban`
preset's model, algorithm and optimiser:

- ``warm start``: ``supervised_steps`` on the preset's demonstrations (batch 32), seconds per step;
- ``update``: ``ppo_update`` with the critic (GAE) on 128 demonstration episodes, as an RL iteration
  after the filter keeps half of 256, seconds per update.

The two arms run in interleaved rounds on copies of one model; the best round of each is kept, so
the ratio comes from one run on a noisy machine. Run:
.venv/bin/python bench/padding_mask.py [--threads 1] [--rounds 3] [--episodes 512] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch

from ragen_tasks.data.token_batch import collate
from ragen_tasks.models.loading import load_policy
from ragen_tasks.presets import load_config
from ragen_tasks.training import critic as critic_module
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.critic import make_critic
from ragen_tasks.training.update import ppo_update
from ragen_tasks.training.warm_start import demonstrations, supervised_steps

ARMS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "mask passed": lambda mask: mask,
    "right-padded, no mask": critic_module.model_attention_mask,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--episodes", type=int, default=512, help="Sokoban demonstration episodes")
    p.add_argument("--steps", type=int, default=10, help="supervised steps per round")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config("sokoban", [f"warm_start.episodes_per_env={args.episodes}"])
    model, tokenizer = load_policy("tiny")
    demos = demonstrations(tokenizer, config, seed=0)
    update_batch = collate(demos[:128], pad_id=tokenizer.pad_token_id)
    lengths = update_batch.lengths.float()
    print(
        f"{len(demos)} Sokoban demonstration episodes; the update's 128: {lengths.min():.0f}-{lengths.max():.0f} "
        f"tokens (mean {lengths.mean():.0f}); {args.threads} thread(s), best of {args.rounds} rounds"
    )
    best: dict[tuple[str, str], float] = {}
    original = critic_module.model_attention_mask
    try:
        for _ in range(args.rounds):
            for arm, mask_fn in ARMS.items():
                critic_module.model_attention_mask = mask_fn  # type: ignore[assignment]
                actor_m = copy.deepcopy(model)
                start = time.process_time()
                supervised_steps(
                    actor_m, demos, steps=args.steps, batch_size=32, lr=3e-3, seed=0, pad_id=tokenizer.pad_token_id
                )
                step_s = (time.process_time() - start) / args.steps
                critic_m = make_critic(actor_m)
                actor = make_train_model(actor_m, make_optimizer(actor_m, lr=1e-4, weight_decay=0.0), config.optim)
                critic = make_train_model(critic_m, make_optimizer(critic_m, lr=1e-4, weight_decay=0.0), config.optim)
                start = time.process_time()
                ppo_update(
                    update_batch,
                    actor=actor,
                    critic=critic,
                    algo=config.algo,
                    optim=config.optim,
                    generator=torch.Generator().manual_seed(0),
                )
                update_s = time.process_time() - start
                for key, seconds in (("warm start, CPU-s per step", step_s), ("update, CPU-s", update_s)):
                    best[(key, arm)] = min(best.get((key, arm), float("inf")), seconds)
    finally:
        critic_module.model_attention_mask = original
    arms = list(ARMS)
    print(f"| workload | {' | '.join(arms)} | ratio |")
    print("|---|---|---|---|")
    for key in dict.fromkeys(k for k, _ in best):
        before, after = (best[(key, arm)] for arm in arms)
        print(f"| {key} | {before:.3f} | {after:.3f} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()

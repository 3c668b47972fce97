"""What padding costs the training passes, on real demonstration episodes of the presets.

Two comparisons (``--compare``), each on the preset's own model, algorithm and optimiser settings:

- ``mask``: a ``TokenBatch`` is right-padded, so causal attention alone keeps every real token from
  the pads, and the training passes hand the model no mask (``training.critic.model_attention_mask``);
  against handing it the mask, as before. Workloads: ``supervised_steps`` (the warm start, batch 32),
  CPU-s per step; ``ppo_update`` on 128 episodes (an RL iteration after the filter keeps half of 256),
  CPU-s per update.
- ``micro``: the update's micro-batches (``optim.micro_batch_size`` / ``micro_batch_tokens``): each
  minibatch whole, padded to its longest row (``rows 32``), against rows sorted by length and cut by a
  row count or a padded-token budget. Same gradient up to float summation order (``training.batching``).

The arms run in interleaved rounds on copies of one model and the best round of each is kept, so the
ratios come from one run on a noisy machine. Demonstrations stand in for rollouts: the same token layout
and lengths as the episodes RL trains on. Their groups hold one episode each, so a group baseline gives
them no advantage; the bench keeps every row (``algo.drop_zero_advantage`` off), as the cost of a row does
not depend on its advantage. Run:
.venv/bin/python bench/padding.py --compare mask [--presets sokoban] [--threads 1] [--rounds 3]
.venv/bin/python bench/padding.py --compare micro [--presets sokoban frozenlake bandit] [--micro "rows 32" "tokens 4096"]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from ragen_tasks.config import TrainConfig
from ragen_tasks.data.token_batch import TokenBatch, collate
from ragen_tasks.models.loading import load_policy
from ragen_tasks.presets import load_config
from ragen_tasks.training import critic as critic_module
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.critic import make_critic
from ragen_tasks.training.update import ppo_update
from ragen_tasks.training.warm_start import demonstrations, supervised_steps

MASK_ARMS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "mask passed": lambda mask: mask,
    "right-padded, no mask": critic_module.model_attention_mask,
}


def micro_setting(arm: str) -> dict[str, Any]:
    """``rows N`` / ``tokens N`` -> the ``optim`` fields it sets (``tokens`` keeps the preset's row cap)."""
    kind, _, size = arm.partition(" ")
    if kind == "rows":
        return {"micro_batch_size": int(size), "micro_batch_tokens": None}
    if kind == "tokens":
        return {"micro_batch_tokens": int(size)}
    raise SystemExit(f"--micro {arm!r}: write 'rows N' or 'tokens N'")


def update_seconds(model: torch.nn.Module, batch: TokenBatch, config: TrainConfig) -> float:
    """CPU seconds of one ``ppo_update`` of a copy of ``model`` (and a critic, when the preset has one)."""
    actor_m = copy.deepcopy(model)
    actor = make_train_model(actor_m, make_optimizer(actor_m, lr=1e-4, weight_decay=0.0), config.optim)
    critic = None
    if config.algo.advantage == "gae":
        critic_m = make_critic(actor_m)
        critic = make_train_model(critic_m, make_optimizer(critic_m, lr=1e-4, weight_decay=0.0), config.optim)
    start = time.process_time()
    ppo_update(
        batch,
        actor=actor,
        critic=critic,
        algo=config.algo,
        optim=config.optim,
        generator=torch.Generator().manual_seed(0),
    )
    return time.process_time() - start


def warm_step_seconds(model: torch.nn.Module, demos: list[Any], steps: int, pad_id: int) -> float:
    """CPU seconds per supervised step (batch 32) of a copy of ``model``."""
    start = time.process_time()
    supervised_steps(copy.deepcopy(model), demos, steps=steps, batch_size=32, lr=3e-3, seed=0, pad_id=pad_id)
    return (time.process_time() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compare", choices=["mask", "micro"], required=True)
    p.add_argument("--presets", nargs="+", default=["sokoban"])
    p.add_argument("--micro", nargs="+", default=["rows 32", "rows 8", "tokens 4096"], help="--compare micro arms")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--episodes", type=int, default=512, help="demonstration episodes per preset")
    p.add_argument("--steps", type=int, default=10, help="supervised steps per round (--compare mask)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    arms = list(MASK_ARMS) if args.compare == "mask" else args.micro
    best: dict[tuple[str, str, str], float] = {}  # (preset, workload, arm) -> best CPU seconds
    original = critic_module.model_attention_mask
    for preset in args.presets:
        config = load_config(preset, [f"warm_start.episodes_per_env={args.episodes}", "algo.drop_zero_advantage=false"])
        model, tokenizer = load_policy(config.model.name_or_path)
        demos = demonstrations(tokenizer, config, seed=0)
        batch = collate(demos[:128], pad_id=tokenizer.pad_token_id)
        lengths = batch.lengths.float()
        print(
            f"{preset}: {len(demos)} demonstration episodes; the update's 128: {lengths.min():.0f}-"
            f"{lengths.max():.0f} tokens (mean {lengths.mean():.0f}); {args.threads} thread(s), best of "
            f"{args.rounds} rounds",
            flush=True,
        )
        for _ in range(args.rounds):
            for arm in arms:
                results: dict[str, float] = {}
                if args.compare == "mask":
                    critic_module.model_attention_mask = MASK_ARMS[arm]  # type: ignore[assignment]
                    try:
                        results["warm start, CPU-s per step"] = warm_step_seconds(
                            model, demos, args.steps, tokenizer.pad_token_id
                        )
                        results["update, CPU-s"] = update_seconds(model, batch, config)
                    finally:
                        critic_module.model_attention_mask = original
                else:
                    optim = config.optim.model_copy(update=micro_setting(arm))
                    results["update, CPU-s"] = update_seconds(model, batch, config.model_copy(update={"optim": optim}))
                for workload, seconds in results.items():
                    key = (preset, workload, arm)
                    best[key] = min(best.get(key, float("inf")), seconds)
    print(f"| preset | workload | {' | '.join(arms)} | {arms[0]} / each |")
    print(f"|---|---|{'---|' * len(arms)}---|")
    for preset, workload in dict.fromkeys((k[0], k[1]) for k in best):
        seconds = [best[(preset, workload, arm)] for arm in arms]
        ratios = " / ".join(f"{seconds[0] / s:.2f}x" for s in seconds[1:])
        print(f"| {preset} | {workload} | {' | '.join(f'{s:.3f}' for s in seconds)} | {ratios} |")


if __name__ == "__main__":
    main()

"""What warm-start steps cost and what more of them buy.

``speed``: seconds per supervised step of a fresh ``tiny`` model on a preset's demonstrations, at each
batch size (run it with the machine otherwise idle; ``OMP_NUM_THREADS`` sets the threads).

``continue``: a warm start's checkpoint trained on for ``--steps`` more supervised steps at the
preset's warm-start rate on its own demonstrations, 250 at a time (``supervised_steps`` makes a fresh
AdamW each call); before and after every block, the reasoning's and the answer's loss per
demonstrated token on fresh episodes (``bench/demo_loss.py``'s split). The model after the last
block is saved to ``--out`` if given.

Usage::

    python bench/warm_start_steps.py speed sokoban --batch 32 64 128
    python bench/warm_start_steps.py continue CHECKPOINT sokoban --set seed=3 --steps 1500 [--out DIR]
"""

from __future__ import annotations

import argparse
import time

from demo_loss import FRESH_SEED_OFFSET, split_losses  # bench/demo_loss.py (this folder is sys.path[0])

from ragen_tasks.models.loading import load_policy
from ragen_tasks.presets import load_config
from ragen_tasks.training.warm_start import demonstrations, supervised_steps

BLOCK = 250  # supervised steps between two loss readings
SPEED_EPISODES = 2048  # demonstrations the speed test draws its batches from
SPEED_SEQUENCES = 1280  # sequences timed per batch size (at least 20 steps)


def speed(preset: str, overrides: list[str], batch_sizes: list[int]) -> None:
    config = load_config(preset, [*overrides, f"warm_start.episodes_per_env={SPEED_EPISODES}"])
    _, tokenizer = load_policy(config.model.name_or_path)
    demos = demonstrations(tokenizer, config, seed=config.warm_start.seed_for(config.seed))
    for batch_size in batch_sizes:
        model, _ = load_policy(config.model.name_or_path)  # fresh weights for every batch size
        steps = max(20, SPEED_SEQUENCES // batch_size)
        start = time.perf_counter()
        supervised_steps(
            model,
            demos,
            steps=steps,
            batch_size=batch_size,
            lr=config.warm_start.lr,
            seed=0,
            pad_id=tokenizer.pad_token_id or 0,
        )
        per_step = (time.perf_counter() - start) / steps
        print(
            f"batch {batch_size}: {per_step:.3f} s a step, {per_step / batch_size * 1000:.2f} ms a sequence", flush=True
        )


def more_steps(checkpoint: str, preset: str, overrides: list[str], steps: int, out: str | None) -> None:
    config = load_config(preset, overrides)
    model, tokenizer = load_policy(checkpoint)
    seed = config.warm_start.seed_for(config.seed)
    demos = demonstrations(tokenizer, config, seed=seed)  # the warm start's own demonstrations
    fresh = demonstrations(tokenizer, config, seed=seed + FRESH_SEED_OFFSET, episodes=256)
    print("| extra steps | reasoning loss | answer loss |\n|---|---|---|")
    for block in range(steps // BLOCK + 1):
        if block:
            supervised_steps(
                model,
                demos,
                steps=BLOCK,
                batch_size=config.warm_start.batch_size,
                lr=config.warm_start.lr,
                seed=seed * 1000 + block,  # another order of the demonstrations each block
                pad_id=tokenizer.pad_token_id or 0,
            )
        model.eval()
        losses = split_losses(model, tokenizer, fresh)
        print(f"| {block * BLOCK} | {losses['reasoning']:.4f} | {losses['answer']:.4f} |", flush=True)
    if out is not None:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    speed_parser = sub.add_parser("speed", help="seconds per supervised step at each batch size")
    speed_parser.add_argument("preset")
    speed_parser.add_argument("--batch", type=int, nargs="+", default=[32])
    more = sub.add_parser("continue", help="more supervised steps on a warm start; the losses on fresh episodes")
    more.add_argument("checkpoint")
    more.add_argument("preset")
    more.add_argument("--steps", type=int, default=1500, help=f"extra steps, in blocks of {BLOCK}")
    more.add_argument("--out", default=None, help="folder for the model after the last block")
    for command in (speed_parser, more):
        command.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if args.command == "speed":
        speed(args.preset, args.overrides, args.batch)
    else:
        more_steps(args.checkpoint, args.preset, args.overrides, args.steps, args.out)


if __name__ == "__main__":
    main()

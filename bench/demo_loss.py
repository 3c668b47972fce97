"""How well a policy fits the warm start's demonstrations: held-out loss, reasoning and answer apart.

The warm start trains on demonstration episodes (``training.warm_start.demonstrations``); this scores
a checkpoint on the episodes it trained on and on fresh ones of another seed, teacher-forced: the
mean negative log-likelihood per demonstrated token, split into each turn's reasoning (its tokens
through the one that completes ``</think>``: ``rollout.loop.reasoning_token_count``, the line
``agent.loss_on_reasoning=false`` draws) and its answer (the rest of the turn: the answer, its tags and
the end-of-turn token). Training
and fresh losses alike mean the warm start does not overfit (more demonstrations would not help); a
lower reasoning loss means a model that restates the board better (what ``bench/perception.py``
measures on its own rollouts).

Usage::

    python bench/demo_loss.py CHECKPOINT PRESET [--set key=value ...] [--episodes 1024]

``PRESET`` and the ``--set`` overrides must be those the checkpoint's warm start was made with
(game, agent turn, reasoning, warm-start seed), so that "training" episodes are its own.
"""

from __future__ import annotations

import argparse

import torch

from ragen_tasks.data.token_batch import collate
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.models.loading import load_policy
from ragen_tasks.presets import load_config
from ragen_tasks.rollout.loop import reasoning_token_count
from ragen_tasks.training.critic import token_logprobs
from ragen_tasks.training.warm_start import demonstrations

FRESH_SEED_OFFSET = 7777  # fresh episodes: the warm start's seed plus this (other tasks, same game)


def split_losses(model: torch.nn.Module, tokenizer: object, episodes: list[Trajectory]) -> dict[str, float]:
    """Mean negative log-likelihood per demonstrated token: {"reasoning": .., "answer": ..}."""
    pad_id = tokenizer.pad_token_id or 0  # type: ignore[attr-defined]
    totals = {"reasoning": [0.0, 0], "answer": [0.0, 0]}
    for start in range(0, len(episodes), 64):
        chunk = episodes[start : start + 64]
        batch = collate(chunk, pad_id=pad_id)
        targets = batch.loss_mask > 0  # (B, T) True = a demonstrated response token
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=targets)  # (B, T)
        for episode, row_logp in zip(chunk, logp.tolist(), strict=True):
            for first, end in zip(episode.turn_starts, episode.turn_ends, strict=True):
                reasoning_end = first + reasoning_token_count(episode.input_ids[first:end], tokenizer)
                for position in range(first, end):
                    if episode.loss_mask[position]:
                        part = totals["reasoning" if position < reasoning_end else "answer"]
                        part[0] -= row_logp[position]
                        part[1] += 1
    return {name: round(total / max(count, 1), 4) for name, (total, count) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("preset")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--episodes", type=int, default=1024, help="episodes scored of each kind")
    args = parser.parse_args()

    config = load_config(args.preset, args.overrides)
    model, tokenizer = load_policy(args.checkpoint)
    model.eval()
    seed = config.warm_start.seed_for(config.seed)
    trained = demonstrations(tokenizer, config, seed=seed)[: args.episodes]  # the warm start's own first episodes
    fresh = demonstrations(tokenizer, config, seed=seed + FRESH_SEED_OFFSET)[: args.episodes]
    print("| episodes | reasoning loss | answer loss |\n|---|---|---|")
    for name, episodes in (("trained on", trained), ("fresh", fresh)):
        losses = split_losses(model, tokenizer, episodes)
        print(f"| {name} | {losses['reasoning']:.3f} | {losses['answer']:.3f} |")


if __name__ == "__main__":
    main()

"""How close 2 shards come to 1 HF engine: equal tokens, and the log-prob gap batched float math leaves.

One engine over all tasks vs the same tasks in two shards (9 + 9, separate engines), and vs the
same batch in reverse order, for the fast Qwen2 forward and the transformers forward at three
sampling settings (tiny model, 3 games, 3 turns). Per setting: trajectories with equal token ids,
with bit-equal log-probs, and the largest log-prob difference among those with equal tokens.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/shard_determinism.py
"""

from __future__ import annotations

import torch

from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.models import load_policy
from ragen_tasks.rollout.engine import SamplingParams
from ragen_tasks.rollout.hf_engine import HFEngine
from ragen_tasks.rollout.loop import make_group_tasks, run_rollouts

AGENT = AgentConfig(max_turns=3, max_tokens_per_turn=24, max_context_tokens=1024)
SPECS = [EnvSpec(name="bandit"), EnvSpec(name="sokoban"), EnvSpec(name="frozen_lake")]


def main() -> None:
    torch.set_num_threads(1)
    model, tok = load_policy("tiny")
    tasks = make_group_tasks(SPECS, groups=6, group_size=3, seed=5, iteration=0)
    print(
        "| forward | temperature, top_p | compared with | equal token ids | bit-equal log-probs | max abs log-prob gap |"
    )
    print("|---|---|---|---|---|---|")
    for fast in (True, False):
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.95), (0.0, 1.0)):
            sampling = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=7)

            def play(batch, fast=fast, sampling=sampling):
                engine = HFEngine(model, tok, fast=fast)
                return run_rollouts(
                    engine, tok, batch, agent=AGENT, sampling=sampling, policy_version=0, weights_fingerprint="b"
                )

            one = play(tasks)
            for name, other in (
                ("2 shards", play(tasks[:9]) + play(tasks[9:])),
                ("reversed batch", play(tasks[::-1])[::-1]),
            ):
                same = [a.input_ids == b.input_ids for a, b in zip(one, other, strict=True)]
                bits = sum(a.rollout_logprobs == b.rollout_logprobs for a, b in zip(one, other, strict=True))
                gap = max(
                    max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs, strict=True))
                    for a, b, s in zip(one, other, same, strict=True)
                    if s
                )
                forward = "fast_qwen2" if fast else "transformers"
                print(
                    f"| {forward} | {temperature}, {top_p} | {name} | {sum(same)}/{len(same)} | {bits}/{len(same)} "
                    f"| {gap:.2e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

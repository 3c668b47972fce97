"""Share of rollout wall time spent OUTSIDE the engine (env stepping, prompts, parsing, glue).

Runs ``run_rollouts`` with the HF engine on the tiny preset over a bandit/sokoban/frozen_lake
mix and times every ``engine.generate``/``release`` call; the rest of the wall time is the
loop's own overhead. Target (issue 4): overhead <= 10% of rollout time.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/rollout_loop.py --groups 8 --group-size 4 --turns 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.models import load_policy
from ragen_tasks.rollout.engine import Generation, GenerationRequest, SamplingParams
from ragen_tasks.rollout.hf_engine import HFEngine
from ragen_tasks.rollout.loop import make_group_tasks, run_rollouts


class TimedEngine:
    """Wraps an engine and sums the seconds spent inside it."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.tokens = 0

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        t0 = time.perf_counter()
        out = self.inner.generate(requests, params)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(g.token_ids) for g in out)
        return out

    def release(self, session_ids: Sequence[str]) -> None:
        t0 = time.perf_counter()
        self.inner.release(session_ids)
        self.seconds += time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_policy(args.model)
    specs = [EnvSpec(name="bandit"), EnvSpec(name="sokoban"), EnvSpec(name="frozen_lake")]
    tasks = make_group_tasks(specs, args.groups, args.group_size, seed=0, iteration=0)
    agent = AgentConfig(max_turns=args.turns, max_tokens_per_turn=args.tokens, max_context_tokens=2048)
    engine = TimedEngine(HFEngine(model, tok, seed=0))
    t0 = time.perf_counter()
    trajs = run_rollouts(
        engine,
        tok,
        tasks,
        agent=agent,
        sampling=SamplingParams(max_new_tokens=args.tokens, seed=0),
        policy_version=0,
        weights_fingerprint="bench",
    )
    wall = time.perf_counter() - t0
    outside = wall - engine.seconds
    turns = sum(t.num_turns for t in trajs)
    print(
        f"episodes={len(trajs)} turns={turns} sampled_tokens={engine.tokens} wall={wall:.2f}s "
        f"engine={engine.seconds:.2f}s outside_engine={outside:.2f}s ({100 * outside / wall:.1f}%) "
        f"tokens/s={engine.tokens / wall:.0f}"
    )


if __name__ == "__main__":
    main()

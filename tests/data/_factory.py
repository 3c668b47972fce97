"""Build valid trajectories for store / freshness / validation tests (no model, no env)."""

from __future__ import annotations

import random

from ragen_tasks.data.synthetic import trajectory, turn_layout
from ragen_tasks.data.trajectory import Trajectory


def make_trajectory(
    i: int,
    *,
    tokens: int = 40,
    turns: int = 2,
    policy_version: int = 3,
    fingerprint: str = "f" * 64,
    prompt: int = 10,
    seed: int = 0,
) -> Trajectory:
    """A consistent episode: prompt, then per turn a response span followed by an observation span."""
    rng = random.Random(seed * 1_000_003 + i)
    mask, starts, ends = turn_layout(tokens, prompt, turns)
    rewards = [round(rng.uniform(-1, 1), 3) for _ in range(turns)]
    return trajectory(
        [rng.randrange(50_000) for _ in range(tokens)],
        mask,
        starts,
        ends,
        rewards,
        prompt_length=prompt,
        traj_id=f"t{i:05d}",
        env_name="frozen_lake",
        seed=i,
        group_id=i // 4,
        policy_version=policy_version,
        weights_fingerprint=fingerprint,
        rollout_logprobs=[-rng.random() if m else 0.0 for m in mask],  # compared after a round trip
        turn_actions=[["Left", "Up"]] * turns,
        turn_think=["think"] * turns,
        turn_responses=["<answer>Left</answer>"] * turns,
        turn_observations=["P_\n_G"] * turns,
        success=bool(i % 2),
    )


def make_batch(n: int = 8, **kw: object) -> list[Trajectory]:
    return [make_trajectory(i, **kw) for i in range(n)]  # type: ignore[arg-type]

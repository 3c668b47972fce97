"""Environment benchmark: Sokoban room generation rate, env steps/s per game, and our FrozenLake step
rate side by side with Gymnasium's FrozenLake-v1 on the same map in the same run (ratio).

Pinned to one CPU core. Every number is the best of ``--repeats`` timed runs (the machine is shared,
so the best run is the least disturbed one); ratios come from the same run.

    .venv/bin/python bench/envs.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from ragen_tasks.envs import make

GYM_4X4 = ["SFFF", "FHFH", "FFFH", "HFFG"]


def best_rate(fn: Callable[[], int], repeats: int) -> float:
    """Items per second of ``fn`` (which returns how many items it did), best of ``repeats``."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = fn()
        rates.append(count / (time.perf_counter() - start))
    return max(rates)


def generation_rate(config: dict[str, Any], rooms: int, repeats: int) -> float:
    env = make("sokoban", **config)
    seeds = iter(range(10**9))

    def run() -> int:
        for _ in range(rooms):
            env.reset(seed=next(seeds))
        return rooms

    return best_rate(run, repeats)


def solve_rate(config: dict[str, Any], rooms: int, repeats: int) -> float:
    env = make("sokoban", **config)
    states = []
    for seed in range(rooms):
        env.reset(seed=seed)
        states.append(env.room)
    from ragen_tasks.envs.sokoban import solve

    def run() -> int:
        for room in states:
            solve(room)
        return rooms

    return best_rate(run, repeats)


def step_rate(env: Any, actions: list[Any], repeats: int) -> float:
    """Steps/s over a fixed action list, resetting (untimed-ly cheap, same for all) when an episode ends."""

    def run() -> int:
        env.reset(seed=0)
        step, reset = env.step, env.reset
        for action in actions:
            _, _, terminated, truncated, _ = step(action)
            if terminated or truncated:
                reset()
        return len(actions)

    return best_rate(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run, e.g. in tests)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    scale = 10 if args.quick else 1
    repeats = 2 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    n_steps = 200_000 // scale
    results: dict[str, float] = {}

    results["sokoban_6x6_1box_rooms_per_s"] = generation_rate({}, 1000 // scale, repeats)
    results["sokoban_8x8_2box_rooms_per_s"] = generation_rate(
        {"dim_room": (8, 8), "num_boxes": 2}, 500 // scale, repeats
    )
    results["sokoban_6x6_1box_bfs_solves_per_s"] = solve_rate({}, 300 // scale, repeats)

    moves = rng.integers(0, 4, size=n_steps)
    big = {"max_actions_per_episode": 10**9}
    sokoban_actions = [("Up", "Down", "Left", "Right")[a] for a in moves]
    results["sokoban_steps_per_s"] = step_rate(make("sokoban", room=None, **big), sokoban_actions, repeats)
    bandit = make("bandit")
    bandit.reset(seed=0)
    results["bandit_steps_per_s"] = step_rate(bandit, ["Phoenix", "Dragon"] * (n_steps // 2), repeats)

    # FrozenLake, same map, same action indices: ours (text in/out) vs Gymnasium's (ints).
    lake_names = [("Left", "Down", "Right", "Up")[a] for a in moves]
    ours = make("frozen_lake", desc=GYM_4X4, **big)
    results["frozen_lake_steps_per_s"] = step_rate(ours, lake_names, repeats)
    results["frozen_lake_random_map_steps_per_s"] = step_rate(make("frozen_lake", **big), lake_names, repeats)
    gym_raw = gym.make("FrozenLake-v1", desc=GYM_4X4).unwrapped
    results["gymnasium_frozen_lake_unwrapped_steps_per_s"] = step_rate(gym_raw, moves.tolist(), repeats)
    gym_made = gym.make("FrozenLake-v1", desc=GYM_4X4, max_episode_steps=10**9)
    results["gymnasium_frozen_lake_make_steps_per_s"] = step_rate(gym_made, moves.tolist(), repeats)
    results["ratio_ours_vs_gymnasium_unwrapped"] = (
        results["frozen_lake_steps_per_s"] / results["gymnasium_frozen_lake_unwrapped_steps_per_s"]
    )
    results["ratio_ours_vs_gymnasium_make"] = (
        results["frozen_lake_steps_per_s"] / results["gymnasium_frozen_lake_make_steps_per_s"]
    )

    meta = {"python": platform.python_version(), "gymnasium": gym.__version__, "cores_used": 1, "repeats": repeats}
    print(json.dumps({"meta": meta, "results": {k: round(v, 3) for k, v in results.items()}}, indent=2))


if __name__ == "__main__":
    main()

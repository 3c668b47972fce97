"""A checkpoint's held-out evaluation as a library call (no Prefect)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ragen_tasks import pipeline
from ragen_tasks.presets import load_config
from tests.conftest import TINY_RUN


def _run(tmp_path: Path, run_id: str, **extra: object) -> pipeline.Run:
    config = load_config("bandit-tiny", {**TINY_RUN, "store.root": str(tmp_path / "runs"), **extra})
    return pipeline.open_run(config, run_id)


def test_held_out_evaluation_is_deterministic_per_seed_block_and_independent_across_blocks(tmp_path: Path) -> None:
    fixed_lake = [{"name": "frozen_lake", "config": {"desc": ["SFF", "FHF", "FFG"]}}]  # every seed: the same board
    run = _run(tmp_path, "eval-blocks", envs=fixed_lake, **{"eval.temperature": 1.0})
    pipeline.init_run(run)
    checkpoint = run.checkpoint_path(0)

    def first_replies(offset: int) -> list[list[int]]:
        _, trajectories = pipeline.evaluate_checkpoint(run.config, checkpoint, seeds=6, seed_offset=offset)
        return [t.input_ids[t.turn_starts[0] : t.turn_ends[0]] for t in trajectories]

    assert first_replies(5_000_000) == first_replies(5_000_000)
    assert first_replies(5_000_000) != first_replies(7_000_000)  # another block draws other samples, not the same noise


def test_a_negative_temperature_is_refused_naming_it(tmp_path: Path) -> None:
    run = _run(tmp_path, "eval-temperature")
    with pytest.raises(ValueError, match=r"temperature=-0.5: must be >= 0"):
        pipeline.evaluate_checkpoint(run.config, tmp_path / "never-read", temperature=-0.5)


def test_an_evaluation_in_blocks_plays_the_same_episodes_as_one_batch(tmp_path: Path, caplog) -> None:
    """A large evaluation hands its one engine a block of episodes at a time, so its memory is one
    block's; the blocks change no episode (sampled at T 1, so any change in the noise would show)."""
    lakes = [{"name": "frozen_lake"}, {"name": "frozen_lake", "config": {"desc": ["SFF", "FHF", "FFG"]}}]
    run = _run(tmp_path, "eval-in-blocks", envs=lakes, **{"eval.temperature": 1.0})
    pipeline.init_run(run)
    checkpoint = run.checkpoint_path(0)

    def episodes(block_seeds: int, offset: int = 3_000_000) -> list[tuple[str, int, list[int]]]:
        _, trajectories = pipeline.evaluate_checkpoint(
            run.config, checkpoint, seeds=7, seed_offset=offset, block_seeds=block_seeds
        )
        return [(t.traj_id, t.seed, list(t.input_ids)) for t in trajectories]

    whole = episodes(block_seeds=7)
    assert [seed for _, seed, _ in whole] == [*range(3_000_000, 3_000_007)] * 2  # each env's seeds in turn
    with caplog.at_level(logging.INFO, logger="ragen_tasks.pipeline.policy"):
        assert episodes(block_seeds=3) == whole  # blocks of 3 x 2 envs = 6 episodes: 6, 6 and 2
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollouts: episodes")]
    assert blocks == [
        "rollouts: episodes 1..6 of 14",
        "rollouts: episodes 7..12 of 14",
        "rollouts: episodes 13..14 of 14",
    ]
    assert episodes(block_seeds=3, offset=3_000_001)[0][2] != whole[1][2]  # the test can fail: other noise shows
    with pytest.raises(ValueError, match=r"block_seeds=0: must be >= 1"):
        pipeline.evaluate_checkpoint(run.config, checkpoint, seeds=2, block_seeds=0)

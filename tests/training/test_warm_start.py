"""Warm-start demonstrations: what the demonstrator writes in its reasoning."""

import pytest

from ragen_tasks.envs import make
from ragen_tasks.training.warm_start import demo_reasoning


@pytest.mark.parametrize("hint", ["coordinates", "directions"])
def test_frozen_lake_demonstrator_restates_the_position_hint_under_the_board(hint: str) -> None:
    env = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False, position_hint=hint)
    board, _ = env.reset(seed=0)
    assert board.endswith("\n" + demo_reasoning(env))  # read from the observation, not invented
    board, *_ = env.step("Right")
    assert board.endswith("\n" + demo_reasoning(env))


def test_without_described_positions_the_reasoning_is_a_fixed_sentence() -> None:
    lake = make("frozen_lake", desc=["FFG", "SFH"])
    lake.reset(seed=0)
    assert demo_reasoning(lake) == "I move toward the goal and stay off the holes."
    bandit = make("bandit")
    bandit.reset(seed=0)
    assert not any(arm in demo_reasoning(bandit) for arm in bandit.action_names)  # arm-neutral

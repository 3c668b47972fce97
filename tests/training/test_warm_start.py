"""Warm-start demonstrations: what the demonstrator writes in its reasoning."""

from ragen_tasks.envs import make
from ragen_tasks.training.warm_start import demo_reasoning


def test_frozen_lake_demonstrator_restates_the_positions_the_board_describes() -> None:
    env = make("frozen_lake", desc=["FFG", "SFH"], is_slippery=False, describe_positions=True)
    board, _ = env.reset(seed=0)
    reasoning = demo_reasoning(env)
    assert reasoning == "I am at row 2, column 1. The goal is at row 1, column 3."
    assert board.endswith("You are at row 2, column 1. The goal is at row 1, column 3.")  # read, not invented
    env.step("Right")
    assert demo_reasoning(env).startswith("I am at row 2, column 2.")


def test_without_described_positions_the_reasoning_is_a_fixed_sentence() -> None:
    lake = make("frozen_lake", desc=["FFG", "SFH"])
    lake.reset(seed=0)
    assert demo_reasoning(lake) == "I move toward the goal and stay off the holes."
    bandit = make("bandit")
    bandit.reset(seed=0)
    assert not any(arm in demo_reasoning(bandit) for arm in bandit.action_names)  # arm-neutral

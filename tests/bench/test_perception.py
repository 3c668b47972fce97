"""bench/perception.py: a sentence counts in its own column, and ``--by-value`` splits a cell's column
by what the cell holds, so a rare cell read wrong every time is not hidden by the common ones."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from ragen_tasks.config import AgentConfig
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.training.warm_start import demo_reasoning
from tests.data._factory import make_trajectory

_SPEC = importlib.util.spec_from_file_location("perception", Path(__file__).parents[2] / "bench" / "perception.py")
assert _SPEC is not None and _SPEC.loader is not None
perception = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(perception)

BOARD = "_O__\n_P__\n__G_\n____"  # a hole above the player, frozen below


def one_turn(think: str) -> Trajectory:
    episode = make_trajectory(0, turns=1)
    return dataclasses.replace(episode, turn_observations=[BOARD], turn_think=[think], turn_actions=[["Down"]])


def test_column_splits_cells_by_value_only() -> None:
    assert perception.column("Up Left hole.", by_value=True) == "Up Left=hole"
    assert perception.column("Down frozen.", by_value=True) == "Down=frozen"
    assert perception.column("Up Left hole.", by_value=False) == "Up Left"
    assert perception.column("The goal is Down and Right.", by_value=True) == "The goal"
    assert perception.column("Turns left: 3.", by_value=True) == "Turns"


def test_by_value_shows_the_hole_read_as_frozen() -> None:
    env = perception.game_at("frozen_lake", BOARD)
    right_text = demo_reasoning(env, "neighbours")
    assert "Up hole." in right_text and "Down frozen." in right_text
    episodes = [one_turn(right_text.replace("Up hole.", "Up frozen."))]
    agent = AgentConfig(max_turns=5, max_actions_per_turn=3, max_actions_per_episode=10)

    turns, right, expected = perception.read_rate(episodes, "neighbours", agent, by_value=True)
    assert turns == 1
    assert (expected["Up=hole"], right["Up=hole"]) == (1, 0)
    assert (expected["Down=frozen"], right["Down=frozen"]) == (1, 1)
    assert expected["The goal"] == right["The goal"] == 1
    assert "Up" not in expected

    _, right, expected = perception.read_rate(episodes, "neighbours", agent)
    assert (expected["Up"], right["Up"]) == (1, 0)
    assert "Up=hole" not in expected


def test_print_rates_orders_values_within_their_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    expected = Counter({"The goal": 2, "Up=hole": 1, "Up=frozen": 1, "Down=wall": 2})
    right = Counter({"The goal": 2, "Up=frozen": 1, "Down=wall": 1})
    perception.print_rates([("ckpt", 2, right, expected)], "checkpoint")
    header = capsys.readouterr().out.splitlines()[0]
    assert header == "| checkpoint | turns | The goal | Up=frozen | Up=hole | Down=wall |"

"""Preset loading, composition and --set overrides: every error is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_tasks.presets import ConfigError, available_presets, load_config, preset_summary


def test_every_shipped_preset_validates() -> None:
    names = available_presets()
    assert "default" in names
    for name in names:
        config = load_config(name)
        assert config.preset == name


def test_every_shipped_preset_says_what_it_is_for() -> None:
    """`ragen train --list` shows each preset's opening comment's first sentence; a preset without one
    would be listed bare. The simplified lake must say it is not the paper's game."""
    for name in available_presets():
        summary = preset_summary(name)
        assert len(summary) > 20 and summary.endswith("."), (name, summary)
        assert "#" not in summary and "\n" not in summary, (name, summary)
    assert preset_summary("frozenlake-tiny").startswith("SIMPLIFIED FrozenLake (not the paper's game)")
    # The first sentence only: the frozenlake preset's comment goes on after it.
    assert preset_summary("frozenlake").endswith("tiny model, CPU.")


def test_set_overrides_nested_values() -> None:
    config = load_config("default", ["optim.lr=0.5", "agent.think=false", "iterations=3"])
    assert config.optim.lr == 0.5
    assert config.agent.think is False
    assert config.iterations == 3


def test_mapping_overrides() -> None:
    assert load_config("default", {"algo.clip_high": 0.3}).algo.clip_high == 0.3


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'nope'; known presets: .*default"):
        load_config("nope")


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'lrr' at optim; valid keys: .*lr"):
        load_config("default", ["optim.lrr=1"])


def test_bad_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"algo.clip_low=1.5: "):
        load_config("default", ["algo.clip_low=1.5"])


def test_a_curriculum_by_plan_length_needs_a_game_with_a_solver() -> None:
    assert load_config("sokoban", ["rollout.min_plan_length=6"]).rollout.min_plan_length == 6
    with pytest.raises(ConfigError, match=r"rollout.min_plan_length=6 needs games with a solver.*frozen_lake has none"):
        load_config("default", ["rollout.min_plan_length=6"])


def test_a_curriculum_that_cannot_be_met_fails_at_load() -> None:
    # before any warm start: longer than the episode's budget, or a share that rounds to no group
    with pytest.raises(ConfigError, match=r"min_plan_length=11 is more than agent.max_actions_per_episode=10"):
        load_config("sokoban", ["rollout.min_plan_length=11"])
    game_budget = ['envs=[{"name": "sokoban", "config": {"max_actions_per_episode": 8}}]', "rollout.min_plan_length=9"]
    with pytest.raises(ConfigError, match=r"min_plan_length=9 is more than sokoban.max_actions_per_episode=8"):
        load_config("sokoban", game_budget)
    groups = load_config("sokoban", []).rollout.groups
    with pytest.raises(ConfigError, match=rf"long_plan_share=0.01 of rollout.groups={groups} rounds to no group"):
        load_config("sokoban", ["rollout.min_plan_length=6", "rollout.long_plan_share=0.01"])
    assert load_config("sokoban", ["rollout.min_plan_length=10", f"rollout.long_plan_share={1 / groups}"])


def test_malformed_set() -> None:
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config("default", ["optim.lr"])


def test_file_preset_with_extends(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("extends: default\niterations: 2\n")
    config = load_config(str(path))
    assert config.iterations == 2
    assert config.envs == load_config("default").envs


def test_self_extension_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text(f"extends: {path}\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(str(path))

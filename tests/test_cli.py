"""The ``ragen`` CLI: every command's --help, and bad input as one clear line with exit code 2."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ragen_tasks.cli import app

runner = CliRunner()


@pytest.mark.parametrize("command", ["train", "evaluate", "regress", "report", "play", "bench"])
def test_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_top_level_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("train", "evaluate", "regress", "report", "play", "bench"):
        assert command in result.output


def test_bad_preset_is_one_line_exit_2() -> None:
    result = runner.invoke(app, ["train", "no-such-preset"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown preset 'no-such-preset'" in lines[0]
    assert "Traceback" not in result.output


def test_bad_set_key_is_one_line_exit_2() -> None:
    result = runner.invoke(app, ["train", "bandit-tiny", "--set", "optim.nope=1"])
    assert result.exit_code == 2
    assert "unknown key 'nope' at optim; valid keys:" in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_bad_set_value_names_the_field() -> None:
    result = runner.invoke(app, ["train", "bandit-tiny", "--set", "rollout.group_size=0"])
    assert result.exit_code == 2
    assert "rollout.group_size=0" in result.output


def test_list_presets() -> None:
    result = runner.invoke(app, ["train", "--list"])
    assert result.exit_code == 0
    assert "default" in result.output.split()


def test_evaluate_missing_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = runner.invoke(app, ["evaluate", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "is not a folder" in result.output


def test_report_of_a_non_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a RAGEN run" in result.output or "run_id" in result.output


def test_the_summary_lines_put_rl_beside_random_play_and_the_ceiling() -> None:
    from ragen_tasks.cli import _summary_text

    text = _summary_text(
        {
            "store": "runs/x",
            "report": "runs/x/report.html",
            "final_checkpoint": "runs/x/checkpoints/step_000040",
            "warm_start": {"cache": "hit", "cache_run": "warm-start-0123456789abcdef"},
            "eval_before_rl": {"sokoban": {"success": 0.41}},
            "eval_after_rl": {"sokoban": {"success": 0.62}},
            "reference": {"sokoban": {"ceiling": 0.977, "random": 0.041}},
            "rl_gain_z": {"sokoban": 4.8},
        }
    )
    assert "reused from the cache (warm-start-0123456789abcdef)" in text
    assert text.splitlines()[-1].split() == ["sokoban", "0.410", "->", "0.620", "+4.8", "0.041", "0.977"]

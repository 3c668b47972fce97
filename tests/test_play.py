"""``ragen play``: scripted stdin through typer's CliRunner; the board printed is the agent's text."""

from __future__ import annotations

from typer.testing import CliRunner

from ragen_tasks.cli import app
from ragen_tasks.envs import make
from ragen_tasks.play import parse_options, play_episode

runner = CliRunner()


def test_play_shows_the_agents_board_and_solves_a_fixed_room() -> None:
    room = "#######\n#_PX_O#\n#######"
    result = runner.invoke(
        app, ["play", "sokoban", "--seed", "1", "--set", f"room={room!s}"], input="jump\nright\n\nRIGHT\n"
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert room in out and "Valid actions: Up, Down, Left, Right" in out
    assert "'jump' is not a valid action" in out
    assert "#___P√#" in out and "Episode over (success): total reward 10.8 in 2 action(s)." in out
    assert "Traceback" not in out


def test_play_prints_exactly_the_observation_for_a_seed() -> None:
    env = make("frozen_lake")
    obs, _ = env.reset(seed=9)
    result = runner.invoke(app, ["play", "frozen_lake", "--seed", "9"], input="")
    assert result.exit_code == 0
    assert result.output.startswith(f"frozen_lake (seed 9)\n{obs}\nValid actions: Left, Down, Right, Up\n")
    assert "End of input: total reward 0 in 0 action(s)." in result.output


def test_play_bandit_until_the_pull_and_quit() -> None:
    result = runner.invoke(app, ["play", "bandit", "--seed", "0"], input="help\nphoenix\nDragon\n")
    assert result.exit_code == 0
    assert "You pulled Phoenix: reward 0.1" in result.output and "Episode over (failed)" in result.output
    assert "You pulled Dragon" not in result.output  # input after the end is not read
    quit_run = runner.invoke(app, ["play", "sokoban", "--seed", "0"], input="quit\nUp\n")
    assert quit_run.exit_code == 0 and "Up: reward" not in quit_run.output


def test_play_bad_input_gives_a_message_not_a_traceback() -> None:
    bad_env = runner.invoke(app, ["play", "chess"])
    assert bad_env.exit_code == 2 and "valid names: bandit, sokoban, frozen_lake" in bad_env.output
    bad_option = runner.invoke(app, ["play", "sokoban", "--set", "dim_room=[1, 1]"])
    assert bad_option.exit_code == 2 and "sokoban.dim_room=[1, 1]: must be at least 3x3" in bad_option.output
    no_equals = runner.invoke(app, ["play", "sokoban", "--set", "num_boxes"])
    assert no_equals.exit_code == 2 and "expected KEY=VALUE" in no_equals.output
    for result in (bad_env, bad_option, no_equals):
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_play_episode_truncates_and_parses_options() -> None:
    assert parse_options(["dim_room=[8, 8]", "num_boxes=2", "symbols=xsb"]) == {
        "dim_room": [8, 8],
        "num_boxes": 2,
        "symbols": "xsb",
    }
    lines: list[str] = []
    env = make("frozen_lake", desc=["SFFFFFFF", "FFFFFFFG"], is_slippery=False, max_actions_per_episode=2)
    summary = play_episode(env, ["Left", "Left", "Right"], lines.append, seed=0)
    assert summary.ended == "truncated" and summary.actions == 2 and not summary.success
    assert lines[-1] == "Episode over (out of actions): total reward 0 in 2 action(s)."
    room = "#####\n#P_O#\n#_X_#\n#####"
    assert parse_options([f"room={room}", "symbols=ragen"]) == {"room": room, "symbols": "ragen"}

"""The ``ragen`` CLI: every command's --help, and bad input as one clear line with exit code 2."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from ragen_tasks import cli
from ragen_tasks.cli import app
from ragen_tasks.presets import available_presets

runner = CliRunner()
COMMANDS = ("train", "evaluate", "regress", "report", "play", "bench")


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_keeps_each_docstring_paragraph_on_one_line(command: str) -> None:
    """A docstring is wrapped at the source's width; --help must reflow it to the terminal's, not keep
    the source's line breaks mid-sentence (in the command list and in the command's own help)."""
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(getattr(cli, command).__doc__).split("\n\n")]
    wide = {"COLUMNS": "1000"}
    own = runner.invoke(app, [command, "--help"], env=wide)
    listing = runner.invoke(app, ["--help"], env=wide)
    for paragraph in paragraphs:
        assert paragraph in own.output, (paragraph, own.output)
    assert paragraphs[0] in listing.output, (paragraphs[0], listing.output)


def test_top_level_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
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
    rows = {line.split()[0]: line for line in result.output.splitlines()}
    assert sorted(rows) == available_presets()
    assert "SIMPLIFIED FrozenLake" in rows["frozenlake-tiny"]


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

    summary = {
        "store": "runs/x",
        "report": "runs/x/report.html",
        "final_checkpoint": "runs/x/checkpoints/step_000040",
        "warm_start": {"cache": "hit", "cache_run": "warm-start-0123456789abcdef"},
        "eval_before_rl": {"sokoban": {"success": 0.41}},
        "eval_after_rl": {"sokoban": {"success": 0.62}},
        "reference": {"sokoban": {"ceiling": 0.977, "random": 0.041}},
        "rl_gain_z": {"sokoban": 4.8},
    }
    text = _summary_text(summary)
    assert "reused from the cache (warm-start-0123456789abcdef)" in text
    # a run whose evaluations kept no per-seed outcomes has no paired test: a dash in its column
    assert text.splitlines()[-1].split() == ["sokoban", "0.410", "->", "0.620", "+4.8", "-", "0.041", "0.977"]
    paired = {"sokoban": {"seeds": 512, "gains": 40, "losses": 12, "p": 7.1e-5}}
    lines = _summary_text({**summary, "rl_gain_paired": paired}).splitlines()
    assert lines[-2].split() == ["sokoban", "0.410", "->", "0.620", "+4.8", "7.1e-05", "0.041", "0.977"]
    assert "exact McNemar" in lines[-1]


# --- bad input is one line and exit code 2, checked before Prefect starts (no flow run, no run id used) ----


@pytest.fixture
def no_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.train

    def refuse(**kwargs: object) -> None:
        raise AssertionError("the training flow started although the input was bad")

    monkeypatch.setattr(flows.train, "train", refuse)


def _one_line_exit_2(args: list[str], *expected: str) -> str:
    result = runner.invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.usefixtures("no_flow")
def test_train_bad_inputs_are_one_line_before_prefect_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = str(tmp_path / "runs")
    base = ["train", "bandit-tiny", "--store", store]
    _one_line_exit_2([*base, "--set", "envs=[{name: bandti}]"], "envs.name='bandti' is not a game", "frozen_lake")
    _one_line_exit_2([*base, "--set", "envs=[{name: bandit, config: {nope: 1}}]"], "bandit.nope=1: unknown option")
    _one_line_exit_2([*base, "--run-id", "../escape"], "run_id='../escape'")
    _one_line_exit_2(["train", "bandit-tiny", "--store", "gs://bucket/runs"], "protocol 'gs' not supported")
    _one_line_exit_2(["train", "bandit-tiny", "--store", "s3://"], "must name a bucket")
    (tmp_path / "a-file").write_text("")
    _one_line_exit_2(["train", "bandit-tiny", "--store", str(tmp_path / "a-file" / "runs")], "is not writable")
    _one_line_exit_2([*base, "--resume-set", "algo.clip_low=0.1"], "only these settings may change", "optim.lr")
    assert not (tmp_path / "runs" / "escape").exists()


def test_a_missing_bucket_is_one_line(s3_server: str, no_flow: None) -> None:
    _one_line_exit_2(["train", "bandit-tiny", "--store", "s3://no-such-bucket/runs"], "is not writable")


@pytest.mark.usefixtures("no_flow")
def test_a_second_writer_of_a_run_is_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ragen_tasks.data.store import Store
    from ragen_tasks.pipeline.lease import RunLease

    lease = RunLease.acquire(Store(str(tmp_path / "runs")), "busy", stale_after_s=300)
    try:
        _one_line_exit_2(
            ["train", "bandit-tiny", "--store", str(tmp_path / "runs"), "--run-id", "busy"],
            "being written by another process",
            "pid",
        )
    finally:
        lease.release()


@pytest.fixture(scope="module")
def committed_checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ragen_tasks.models.loading import load_policy
    from ragen_tasks.training import checkpoint as ckpt

    model, tokenizer = load_policy("tiny")
    root = tmp_path_factory.mktemp("ckpts")
    return ckpt.save_checkpoint(root, 1, actor=model, tokenizer=tokenizer, optimizers={}).path


@pytest.mark.parametrize("damage", ["flipped byte", "truncated weights", "bad marker JSON", "marker without files"])
def test_evaluate_a_damaged_checkpoint_is_one_line(committed_checkpoint, tmp_path, damage: str) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from ragen_tasks.training import checkpoint as ckpt

    path = tmp_path / "step_000001"
    shutil.copytree(committed_checkpoint, path)
    weights = path / ckpt.WEIGHTS
    if damage == "flipped byte":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "bad marker JSON":
        (path / ckpt.MARKER).write_text("{not json")
    else:
        (path / ckpt.MARKER).write_text('{"fingerprint": "x"}')
    _one_line_exit_2(["evaluate", str(path), "--preset", "bandit-tiny", "--seeds", "1"], str(path))


def test_evaluate_refuses_an_uncommitted_checkpoint(committed_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from ragen_tasks.training import checkpoint as ckpt

    path = tmp_path / "step_000001"
    shutil.copytree(committed_checkpoint, path)
    (path / ckpt.MARKER).unlink()  # files intact, never committed (a save killed before its marker)
    _one_line_exit_2(["evaluate", str(path), "--preset", "bandit-tiny", "--seeds", "1"], "is not committed")


def test_evaluate_seeds_are_bounded(committed_checkpoint) -> None:  # type: ignore[no-untyped-def]
    _one_line_exit_2(["evaluate", str(committed_checkpoint), "--seeds", "1000000000"], "--seeds 1000000000")


@pytest.mark.usefixtures("no_flow")
def test_resuming_with_another_config_is_refused_before_prefect_naming_resume_set(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ragen_tasks.data.store import Store
    from ragen_tasks.presets import load_config

    store = str(tmp_path / "runs")
    stored = load_config("bandit-tiny", {"store.root": "/somewhere/else"}).model_dump(mode="json")  # moved since
    Store(store).write_json("old", 0, "summary", "config", stored, producer="test")
    base = ["train", "bandit-tiny", "--store", store, "--run-id", "old"]
    _one_line_exit_2(
        [*base, "--set", "optim.lr=0.5"], "optim.lr (0.001 in the run, 0.5 now)", "--resume-set optim.lr=0.5"
    )
    _one_line_exit_2([*base, "--set", "rollout.groups=3"], "rollout.groups", "new run id")
    _one_line_exit_2(
        ["train", "bandit-tiny", "--store", store, "--run-id", "new", "--resume-set", "optim.lr=1"],
        "does not exist yet",
    )


@pytest.mark.slow
def test_sigterm_ends_a_run_and_its_temporary_prefect_server(tmp_path: Path) -> None:
    """`kill PID` on `ragen train` (no Prefect API configured, so the flow starts Prefect's temporary
    server as a child process) exits with 143 and takes the server with it; it used to stay behind."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    ragen = str(Path(sys.executable).parent / "ragen")
    command = [ragen, "train", "bandit-tiny", "--store", str(tmp_path / "runs"), "--set", "iterations=50"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        servers: list[psutil.Process] = []
        deadline = time.monotonic() + 240
        while not servers and process.poll() is None and time.monotonic() < deadline:
            children = psutil.Process(process.pid).children(recursive=True)
            servers = [c for c in children if "uvicorn" in " ".join(c.cmdline())]
            time.sleep(0.5)
        assert servers, "the run never started Prefect's temporary server"
        time.sleep(2)  # the flow is past the server's start-up
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"temporary Prefect server still running: {[p.pid for p in alive]}"
    finally:
        if process.poll() is None:
            process.kill()

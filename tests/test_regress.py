"""`ragen evaluate --json` as the baseline format and `ragen regress` to both outcomes, on real tiny
checkpoints (local folders and s3:// URIs on a moto server at 127.0.0.1): exit 0 on pass, 1 on a
regression, 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from ragen_tasks.cli import app
from ragen_tasks.evaluation import RECORD_FORMAT
from ragen_tasks.pipeline import gate
from tests.conftest import GATE_SEEDS, make_gate_checkpoint

runner = CliRunner()


def _baseline(checkpoint: str, path: Path) -> dict:
    result = runner.invoke(app, ["evaluate", checkpoint, "--json", "--seeds", str(GATE_SEEDS)])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    path.write_text(result.stdout)
    return record


def test_evaluate_json_is_a_record_with_per_seed_outcomes(gate_checkpoints: dict[str, str], tmp_path: Path) -> None:
    record = _baseline(gate_checkpoints["good"], tmp_path / "baseline.json")
    assert record["format"] == RECORD_FORMAT
    assert (record["seeds"], record["seed_offset"]) == (GATE_SEEDS, 1_000_000)
    outcomes = record["per_seed"]["bandit"]
    assert [o["seed"] for o in outcomes] == list(range(1_000_000, 1_000_000 + GATE_SEEDS))
    assert record["envs"]["bandit"]["success"] == pytest.approx(sum(o["success"] for o in outcomes) / GATE_SEEDS)
    assert 0 < record["envs"]["bandit"]["success"] < 1  # the fixture's premise: a trained, imperfect policy


def test_regress_passes_the_same_checkpoint_and_fails_a_damaged_one(
    gate_checkpoints: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline = tmp_path / "baseline.json"
    record = _baseline(gate_checkpoints["good"], baseline)
    monkeypatch.chdir(tmp_path)  # --output as a bare file name: the working folder

    passed = runner.invoke(
        app, ["regress", gate_checkpoints["good"], "--baseline", str(baseline), "--output", "candidate.json"]
    )
    assert passed.exit_code == 0, passed.output
    assert "regression gate: PASS" in passed.stdout
    (row,) = [line.split() for line in passed.stdout.splitlines() if line.strip().startswith("bandit")]
    assert row[1] == str(GATE_SEEDS) and row[2] == row[4]  # every seed paired; the same success on both sides
    assert json.loads((tmp_path / "candidate.json").read_text())["per_seed"] == record["per_seed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["baseline.json", "candidate.json"]  # no temporary left

    failed = runner.invoke(app, ["regress", gate_checkpoints["damaged"], "--baseline", str(baseline)])
    assert failed.exit_code == 1, failed.output
    assert "regression gate: FAIL" in failed.stdout and "REGRESSED" in failed.stdout


def test_a_baseline_checkpoint_is_evaluated_on_the_same_seeds(gate_checkpoints: dict[str, str]) -> None:
    result = runner.invoke(
        app,
        ["regress", gate_checkpoints["damaged"], "--baseline", gate_checkpoints["good"], "--seeds", str(GATE_SEEDS)],
    )
    assert result.exit_code == 1, result.output
    assert "REGRESSED" in result.stdout


def test_the_record_says_its_temperature_and_the_gate_plays_at_it(
    gate_checkpoints: dict[str, str], tmp_path: Path
) -> None:
    good = gate_checkpoints["good"]
    sampled = _baseline(good, tmp_path / "sampled.json")
    assert sampled["temperature"] == 1.0  # bandit-tiny's eval.temperature
    result = runner.invoke(app, ["evaluate", good, "--json", "--seeds", str(GATE_SEEDS), "--temperature", "0"])
    assert result.exit_code == 0, result.output
    greedy = json.loads(result.stdout)
    (tmp_path / "greedy.json").write_text(result.stdout)
    assert greedy["temperature"] == 0
    assert greedy["per_seed"] != sampled["per_seed"]  # the premise: greedy and sampled play differ on these seeds

    result = runner.invoke(
        app, ["regress", good, "--baseline", str(tmp_path / "greedy.json"), "--output", str(tmp_path / "cand.json")]
    )
    assert result.exit_code == 0, result.output
    assert f"played: {GATE_SEEDS} seeds per env from 1000000, temperature 0" in result.stdout
    candidate = json.loads((tmp_path / "cand.json").read_text())
    assert candidate["temperature"] == 0 and candidate["per_seed"] == greedy["per_seed"]

    # A checkpoint baseline: both sides at the temperature asked for.
    both = gate.gate(good, good, seeds=GATE_SEEDS, temperature=0)
    assert both.candidate["temperature"] == both.baseline["temperature"] == 0
    assert both.candidate["per_seed"] == both.baseline["per_seed"] == greedy["per_seed"]


def test_bad_input_is_exit_2_with_one_line(gate_checkpoints: dict[str, str], tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"bandit": {"success": 0.5, "episodes": 24}}))  # the old `--json` shape
    record = _baseline(gate_checkpoints["good"], tmp_path / "record.json")
    no_temperature = tmp_path / "no-temperature.json"
    no_temperature.write_text(json.dumps({k: v for k, v in record.items() if k != "temperature"}))
    hot = tmp_path / "hot.json"
    hot.write_text(json.dumps({**record, "temperature": "hot"}))
    cases = [
        ("not an evaluation record", ["--baseline", str(old)]),
        ("does not exist", ["--baseline", str(tmp_path / "missing.json")]),
        ("a baseline record fixes them", ["--baseline", str(tmp_path / "record.json"), "--seeds", "8"]),
        ("a baseline record fixes them", ["--baseline", str(tmp_path / "record.json"), "--temperature", "0"]),
        ("does not say temperature", ["--baseline", str(no_temperature)]),
        ("temperature='hot' is not a number", ["--baseline", str(hot)]),
    ]
    for message, args in cases:
        result = runner.invoke(app, ["regress", gate_checkpoints["good"], *args])
        assert result.exit_code == 2, (message, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    missing = runner.invoke(app, ["regress", str(tmp_path / "nope"), "--baseline", gate_checkpoints["good"]])
    assert missing.exit_code == 2 and "is not a folder" in missing.output


@pytest.mark.slow
def test_s3_checkpoints_and_baselines(s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGEN_SCRATCH", str(tmp_path / "scratch"))
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="gate")
    good = make_gate_checkpoint("s3://gate/runs", "s3-good", trained=True)
    assert good == "s3://gate/runs/s3-good/checkpoints/step_000000"

    record = runner.invoke(app, ["evaluate", good, "--json", "--seeds", str(GATE_SEEDS)])
    assert record.exit_code == 0, record.output
    boto3.client("s3", endpoint_url=s3_server).put_object(Bucket="gate", Key="baselines/good.json", Body=record.stdout)

    result = runner.invoke(
        app,
        ["regress", good, "--baseline", "s3://gate/baselines/good.json", "--output", "s3://gate/baselines/next.json"],
    )
    assert result.exit_code == 0, result.output
    written = boto3.client("s3", endpoint_url=s3_server).get_object(Bucket="gate", Key="baselines/next.json")
    assert json.loads(written["Body"].read())["per_seed"] == json.loads(record.stdout)["per_seed"]

    missing = runner.invoke(app, ["regress", good, "--baseline", "s3://gate/baselines/none.json"])
    assert missing.exit_code == 2 and "does not exist" in missing.output

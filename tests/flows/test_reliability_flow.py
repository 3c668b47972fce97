"""Reliability through the real training flow (Prefect's test harness): a run on S3 (moto on
127.0.0.1) leaves its pruned checkpoints, summary.json and report.html in the bucket; a diverging
run stops with one line through the CLI and continues under the same run id with ``--resume-set``."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ragen_tasks.cli import app
from ragen_tasks.data.store import Store
from ragen_tasks.pipeline.lease import current_lease
from tests.pipeline.resume_harness import RESUME_RUN

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]


def test_an_s3_run_prunes_its_bucket_and_leaves_its_summary_there(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from flows.train import train

    bucket = f"runs-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    monkeypatch.setenv("RAGEN_SCRATCH", str(tmp_path / "scratch"))  # a pod's scratch: gone after the run
    overrides = {**RESUME_RUN, "iterations": 3, "checkpoint.keep_last": 2}
    summary = train(preset="bandit-tiny", overrides=overrides, run_id="s3run", store_root=f"s3://{bucket}/runs")
    store = Store(f"s3://{bucket}/runs")
    assert store.list_checkpoints("s3run") == [2, 3]  # keep_last applies to the bucket, not only the scratch
    stored = json.loads(store.get_object("s3run/summary.json") or b"{}")
    assert stored["run_id"] == "s3run" and stored["eval_after_rl"] == summary["eval_after_rl"]
    assert b"RAGEN run s3run" in (store.get_object("s3run/report.html") or b"")
    assert summary["report"] == f"s3://{bucket}/runs/s3run/report.html"
    lease = current_lease(store, "s3run")
    assert lease is not None and lease[1]["released"]


def test_a_diverging_run_stops_in_one_line_and_continues_with_resume_set(tmp_path: Path) -> None:
    runner = CliRunner()
    store = str(tmp_path / "runs")
    sets = [f"--set={k}={v}" for k, v in {**RESUME_RUN, "iterations": 1, "optim.ppo_epochs": 1}.items()]
    diverging = ["--set", "optim.lr=1e10", "--set", "optim.critic_lr=1e10"]
    args = ["train", "bandit-tiny", *sets, "--store", store, "--run-id", "lr"]
    failed = runner.invoke(app, [*args, *diverging])
    assert failed.exit_code == 2, failed.output
    last = failed.output.strip().splitlines()[-1]
    assert last.startswith("error: iteration 0: the update from checkpoint step 0 diverged"), last
    assert "--run-id lr --resume-set optim.critic_lr=" in last
    assert not (Path(store) / "lr" / "checkpoints" / "step_000001").exists()

    resumed = runner.invoke(app, [*args, *diverging, "--resume-set", "optim.critic_lr=1e-5"])
    assert resumed.exit_code == 0, resumed.output
    assert (Path(store) / "lr" / "checkpoints" / "step_000001" / "COMMITTED.json").exists()

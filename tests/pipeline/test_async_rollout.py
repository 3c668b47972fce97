"""Async mode: rollout workers commit batches stamped with policy version + fingerprint; the trainer
consumes only fresh ones.

Fast tests (one process, local store): a stale batch and a batch with a forged fingerprint are
rejected, counted, and absent from everything the update read; the trainer's wait is bounded and its
error names max_staleness. Slow test: two rollout-worker PROCESSES and a trainer PROCESS on the
loopback S3 server; one worker is SIGKILLed mid-batch; nothing committed is lost and the run completes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ragen_tasks import pipeline
from ragen_tasks.pipeline import async_rollout
from ragen_tasks.presets import load_config
from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
ASYNC_RUN = {
    **TINY_RUN,
    "warm_start.enabled": False,
    "eval.seeds": 1,
    "eval.every": 100,
    "rollout.mode": "async",
    "rollout.async_poll_s": 0.1,
    "rollout.async_warn_after_s": 20.0,
    "rollout.async_wait_timeout_s": 90.0,
    "freshness.max_staleness": 0,
}


def _new_run(root: str, run_id: str, iterations: int, **extra: Any) -> pipeline.Run:
    config = load_config("bandit-tiny", {**ASYNC_RUN, "iterations": iterations, "store.root": root, **extra})
    run = pipeline.open_run(config, run_id)
    pipeline.init_run(run)
    return run


def _train_iteration(run: pipeline.Run, k: int) -> dict[str, Any]:
    """What the train flow does per iteration in async mode, without Prefect."""
    consumed = async_rollout.consume_batch(run, k)
    batch = pipeline.filter_and_validate(run, k)
    updated = pipeline.update(run, k)
    pipeline.record_iteration(
        run, k, {"iteration": k, **batch, **updated, "policy/next_step": int(updated["checkpoint/step"])}
    )
    return consumed


def _ids(run: pipeline.Run, k: int, stage: str, name: str = "trajectories") -> set[str]:
    return {t.traj_id for t in run.store.read_trajectories(run.run_id, k, stage, name)[0]}


def test_stale_and_forged_batches_are_rejected_and_never_trained_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _new_run(str(tmp_path / "runs"), "async-stale", 2)
    uri = run.store.uri(run.run_id)
    # Two workers roll out with policy version 0; the trainer consumes one at iteration 0.
    async_rollout.run_worker(uri, "a", max_batches=1, idle_timeout_s=5)
    async_rollout.run_worker(uri, "b", max_batches=1, idle_timeout_s=5)
    first = _train_iteration(run, 0)
    assert first["async/consumed_lag"] == 0.0
    ledger0, _ = run.store.read_json(run.run_id, 0, "summary", "async")
    leftover = "w-b-000000" if ledger0["consumed"]["item"] == "w-a-000000" else "w-a-000000"
    # Version 1 exists now: worker a rolls out with it; a forged batch claims version 1 with other weights.
    async_rollout.run_worker(uri, "a", max_batches=1, idle_timeout_s=5)
    (src_version, src_item) = next((v, n) for v, n in async_rollout.list_worker_items(run) if v == 1)
    good, _ = run.store.read_trajectories(run.run_id, src_version, "rollouts", src_item)
    forged = [dataclasses.replace(t, traj_id=f"forged-{i}", weights_fingerprint="0" * 64) for i, t in enumerate(good)]
    run.store.write_trajectories(
        run.run_id,
        1,
        "rollouts",
        forged,
        producer="test",
        policy_version=1,
        weights_fingerprint="0" * 64,
        name="w-forged-000000",
    )

    with caplog.at_level(logging.WARNING, logger="ragen_tasks.pipeline.async_rollout"):
        second = _train_iteration(run, 1)
    ledger1, _ = run.store.read_json(run.run_id, 1, "summary", "async")
    reasons = {d["item"]: d["reason"] for d in ledger1["decisions"]}
    assert reasons[leftover] == "stale" and reasons["w-forged-000000"] == "unknown_fingerprint"
    assert ledger1["consumed"]["item"] == src_item and reasons[src_item] == "ok"
    assert second["async/rejected_batches_stale"] == 1.0
    assert second["async/rejected_batches_unknown_fingerprint"] == 1.0
    assert second["async/stale"] > 0 and second["async/rejected_tokens_mean"] > 0  # lengths of the rejected
    assert any("rejected worker batch" in r.message and leftover in r.message for r in caplog.records)

    # What the update consumed (iter_k/batch, read by pipeline.update) holds nothing rejected.
    stale_ids = _ids(run, 0, "rollouts", leftover)
    forged_ids = {t.traj_id for t in forged}
    for k, ledger in ((0, ledger0), (1, ledger1)):
        consumed = ledger["consumed"]
        assert _ids(run, k, "rollouts") == _ids(run, consumed["version"], "rollouts", consumed["item"])
        assert _ids(run, k, "batch") <= _ids(run, k, "rollouts")
        assert not _ids(run, k, "batch") & (stale_ids | forged_ids)
    assert run.store.read_manifest(run.run_id, 1, "batch").policy_version == 1
    assert async_rollout.staleness_distribution(run) == {"consumed": {0: 2}, "rejected": {0: 1, 1: 1}}
    # Idempotent: consuming iteration 1 again returns the committed choice, copies nothing new.
    assert async_rollout.consume_batch(run, 1)["async/consumed_lag"] == 0.0
    assert len(list((tmp_path / "runs" / run.run_id / "iter_000001" / "rollouts").glob("trajectories-*.parquet"))) == 1


def test_no_fresh_batch_is_a_bounded_wait_naming_max_staleness(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _new_run(
        str(tmp_path / "runs"),
        "async-deadlock",
        1,
        **{"rollout.async_warn_after_s": 0.2, "rollout.async_wait_timeout_s": 0.6},
    )
    t0 = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="ragen_tasks.pipeline.async_rollout"),
        pytest.raises(TimeoutError, match=r"freshness\.max_staleness=0"),
    ):
        async_rollout.consume_batch(run, 0)
    assert time.monotonic() - t0 < 10
    assert any("still waiting" in r.message for r in caplog.records)
    assert not run.store.has_manifest(run.run_id, 0, "rollouts")  # nothing consumed, nothing half-written


def test_worker_stops_when_no_new_checkpoint_arrives(tmp_path: Path) -> None:
    run = _new_run(str(tmp_path / "runs"), "async-idle", 1)
    result = async_rollout.run_worker(run.store.uri(run.run_id), "solo", idle_timeout_s=0.5)
    assert len(result["batches"]) == 1  # async_batches_per_version=1, then waits for version 1: bounded
    assert result["stopped"].startswith("no new checkpoint")


# ------------------------------------------------------------------ processes on the loopback S3 server
def _spawn(code: str, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_two_worker_processes_and_a_trainer_on_s3_survive_a_killed_worker(tmp_path: Path, s3_server: str) -> None:
    import boto3
    from prefect.settings import PREFECT_API_URL

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="async-runs")
    root, run_id, iterations = "s3://async-runs/runs", "async-mp", 3
    overrides = {**ASYNC_RUN, "iterations": iterations, "rollout.async_poll_s": 0.2}
    base_env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    env = {name: {**base_env, "RAGEN_SCRATCH": str(tmp_path / f"scratch-{name}")} for name in ("trainer", "a", "b")}
    trainer = _spawn(
        "import json, sys\nfrom flows.train import train\n"
        f"train(preset='bandit-tiny', overrides=json.loads(sys.argv[1]), run_id={run_id!r}, "
        f"store_root={root!r})",
        env["trainer"],
        tmp_path / "trainer.log",
        json.dumps(overrides),
    )
    workers = {
        w: _spawn(
            "from flows.rollout_worker import rollout_worker\n"
            f"rollout_worker(run_id={run_id!r}, store_root={root!r}, worker={w!r}, idle_timeout_s=90)",
            env[w],
            tmp_path / f"worker-{w}.log",
        )
        for w in ("a", "b")
    }
    procs = [trainer, *workers.values()]
    try:
        # Kill worker a mid-batch: it has fetched checkpoint 1 (so it is rolling out with it) but not
        # yet committed that batch.
        fetched = tmp_path / "scratch-a" / run_id / "checkpoints" / "step_000001"
        deadline = time.monotonic() + 150
        while not fetched.exists() and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.05)
        assert fetched.exists(), (tmp_path / "trainer.log").read_text()[-3000:]
        workers["a"].send_signal(signal.SIGKILL)
        workers["a"].wait(timeout=10)
        assert trainer.wait(timeout=150) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert workers["b"].wait(timeout=60) == 0, (tmp_path / "worker-b.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    run = pipeline.open_existing_run(f"{root}/{run_id}")
    assert [row["iteration"] for row in pipeline.history(run)] == list(range(iterations))
    items = async_rollout.list_worker_items(run)
    assert ("w-a-000001" not in {n for _, n in items}) and (0, "w-a-000000") in items  # killed mid-batch 1
    # Nothing committed was lost: every committed worker batch still reads back (checksums checked),
    # and every one of them the trainer saw is in a ledger.
    decided: dict[str, dict[str, Any]] = {}
    for k in range(iterations):
        ledger, _ = run.store.read_json(run_id, k, "summary", "async")
        decided.update({d["item"]: d for d in ledger["decisions"]})
        consumed = ledger["consumed"]
        step = pipeline.policy_step(run, k)
        assert consumed["reason"] == "ok" and 0 <= step - consumed["version"] <= 0  # max_staleness=0
        assert run.store.read_manifest(run_id, k, "batch").policy_version == consumed["version"]
    for version, name in items:
        trajectories, manifest = run.store.read_trajectories(run_id, version, "rollouts", name)
        assert trajectories and manifest.policy_version == version
    assert "w-a-000000" in decided
    dist = async_rollout.staleness_distribution(run)
    assert sum(dist["consumed"].values()) == iterations and set(dist["consumed"]) == {0}

"""What a training flow run shows: the metrics table's rows, artifact keys, the task clock, and (under a
real Prefect API) the library's log lines in the flow run's log, the warm start's progress artifact
and one metrics table per run, updated in place."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from flows.progress import SUMMARY_KEYS, Clock, artifact_key, metrics_row
from tests.conftest import TINY_RUN

#: Seconds a test waits for Prefect's log worker to deliver a finished run's last log lines.
LOG_DELIVERY_S = 30.0


def test_a_metrics_row_shows_summary_and_eval_keys_with_non_finite_values_as_text() -> None:
    row = {
        "iteration": 3,
        "rollout/success": 0.5,
        "actor/grad_norm": math.nan,
        "actor/entropy": math.inf,
        "eval/bandit/success": 1.0,
        "timing/update_s": 2.0,
    }
    assert metrics_row(row) == {
        "iteration": 3,
        "actor/entropy": "inf",
        "actor/grad_norm": "nan",
        "eval/bandit/success": 1.0,
        "rollout/success": 0.5,
    }
    assert {"rollout/success", "actor/grad_norm"} <= set(SUMMARY_KEYS)


def test_artifact_keys_are_lowercase_letters_digits_and_dashes() -> None:
    assert artifact_key("Flow_Test.2") == "flow-test-2"


def test_clock_times_each_task_call_and_the_iteration() -> None:
    clock = Clock()
    assert clock("rollout", lambda uri, it: {"uri": uri, "it": it}, "file:///r", 4) == {"uri": "file:///r", "it": 4}
    metrics = clock.metrics()
    assert set(metrics) == {"timing/rollout_task_s", "timing/iteration_s", "timing/iteration_start_unix"}
    assert 0 <= metrics["timing/rollout_task_s"] <= metrics["timing/iteration_s"]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_the_ui_sees_library_logs_warm_start_progress_and_one_growing_metrics_table(tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId

    from flows.train import train

    overrides = {**TINY_RUN, "iterations": 2, "warm_start.steps": 20}
    train(preset="bandit-tiny", overrides=overrides, run_id="ui-view", store_root=str(tmp_path / "runs"))

    async def read() -> tuple[list[Any], list[Any], list[str]]:
        async with get_client() as client:
            runs = [r for r in await client.read_flow_runs() if r.parameters.get("run_id") == "ui-view"]
            (run,) = runs
            keyed = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["ui-view-metrics", "ui-view-warm-start"]))
            )
            # Prefect ships log lines from a background worker in batches, so the last batch may
            # still be on its way when the flow returns: wait (bounded) for the run's last line.
            log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))
            deadline = time.monotonic() + LOG_DELIVERY_S
            logs = await client.read_logs(log_filter=log_filter)
            while not any(log.message.startswith("iteration 1:") for log in logs) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                logs = await client.read_logs(log_filter=log_filter)
            return (
                [a for a in keyed if a.key == "ui-view-metrics"],
                [a for a in keyed if a.key != "ui-view-metrics"],
                [log.message for log in logs],
            )

    metrics, warm, messages = asyncio.run(read())
    # Library lines (ragen_tasks loggers), not only the flow's own: the warm start is not silent.
    assert any("demonstration episodes" in m for m in messages), messages
    assert any(m.startswith("warm start: step 20/20") for m in messages), messages
    (table,) = metrics  # one artifact for the whole run, its rows replaced in place
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [r["iteration"] for r in rows] == [0, 1]
    (progress,) = warm
    assert progress.data == 100.0

"""What a training flow run shows: the metrics artifact's table, artifact keys, the task clock."""

from __future__ import annotations

import math

from flows.progress import SUMMARY_KEYS, Clock, artifact_key, metrics_table


def test_metrics_table_shows_summary_and_eval_keys_with_non_finite_values_as_text() -> None:
    row = {
        "iteration": 3,
        "rollout/success": 0.5,
        "actor/grad_norm": math.nan,
        "actor/entropy": math.inf,
        "eval/bandit/success": 1.0,
        "timing/update_s": 2.0,
    }
    assert metrics_table(row) == [
        {"metric": "actor/entropy", "value": "inf"},
        {"metric": "actor/grad_norm", "value": "nan"},
        {"metric": "eval/bandit/success", "value": 1.0},
        {"metric": "rollout/success", "value": 0.5},
    ]
    assert {"rollout/success", "actor/grad_norm"} <= set(SUMMARY_KEYS)


def test_artifact_keys_are_lowercase_letters_digits_and_dashes() -> None:
    assert artifact_key("Flow_Test.2") == "flow-test-2"


def test_clock_times_each_task_call_and_the_iteration() -> None:
    clock = Clock()
    assert clock("rollout", lambda uri, it: {"uri": uri, "it": it}, "file:///r", 4) == {"uri": "file:///r", "it": 4}
    metrics = clock.metrics()
    assert set(metrics) == {"timing/rollout_task_s", "timing/iteration_s", "timing/iteration_start_unix"}
    assert 0 <= metrics["timing/rollout_task_s"] <= metrics["timing/iteration_s"]

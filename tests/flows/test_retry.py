"""The flows' retry condition under a real Prefect API: a final error is not retried, others are."""

from __future__ import annotations

import pytest
from prefect import flow, task

from flows.retry import retry_unless

pytestmark = pytest.mark.usefixtures("prefect_api")


def _attempts(error: type[Exception]) -> int:
    calls: list[int] = []

    @task(retries=1, retry_delay_seconds=0, retry_condition_fn=retry_unless(ValueError))
    def failing() -> None:
        calls.append(1)
        raise error("boom")

    @flow
    def run() -> None:
        failing()

    with pytest.raises(error, match="boom"):
        run()
    return len(calls)


def test_a_final_error_fails_at_once_and_another_is_retried() -> None:
    assert _attempts(ValueError) == 1
    assert _attempts(RuntimeError) == 2

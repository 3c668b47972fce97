"""Flow tests run against a real (temporary, local) Prefect API via Prefect's test harness."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# Smallest settings that still exercise every stage (warm start, filter, GX, update, eval).
TINY_RUN = {
    "rollout.groups": 4,
    "rollout.group_size": 4,
    "warm_start.episodes_per_env": 16,
    "warm_start.steps": 4,
    "warm_start.batch_size": 8,
    "eval.seeds": 4,
    "eval.every": 1,
    "agent.max_turns": 2,
    "agent.max_tokens_per_turn": 24,
    "optim.minibatch_size": 16,
    "optim.micro_batch_size": 16,
}

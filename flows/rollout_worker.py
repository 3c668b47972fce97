"""The rollout-worker flow (async mode): a thin wrapper over ``pipeline.async_rollout.run_worker``.

Start one per rollout pod (``prefect.yaml``: deployment ``rollout-worker``) or per process. Each
worker loads the newest committed checkpoint of the run, rolls out a batch, commits it under its own
item names stamped with policy version and weights fingerprint, and repeats; it stops after
``max_batches``, once the run's last iteration is committed, or after ``rollout.async_wait_timeout_s``
without a new checkpoint. Give each worker its own scratch folder (``RAGEN_SCRATCH``) when several
share one machine.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from prefect import flow, get_run_logger

from ragen_tasks.pipeline import async_rollout


def default_worker_name() -> str:
    """``<host>-<pid>``, made a safe key part: unique per pod (host = pod name) and per process."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{os.getpid()}").lstrip("-._")[:64] or "worker"


@flow(name="ragen-rollout-worker")
def rollout_worker(
    run_id: str,
    store_root: str,
    max_batches: int | None = None,
    worker: str | None = None,
    idle_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Roll out batches for run ``run_id`` in ``store_root`` (a folder or ``s3://bucket/prefix``).
    ``max_batches``: stop after this many (None: until the run ends); ``worker``: this worker's
    name in item keys (default ``<host>-<pid>``); ``idle_timeout_s``: stop after this long without
    a new checkpoint (default: the run's ``rollout.async_wait_timeout_s``)."""
    name = worker or default_worker_name()
    result = async_rollout.run_worker(
        f"{store_root.rstrip('/')}/{run_id}", name, max_batches=max_batches, idle_timeout_s=idle_timeout_s
    )
    get_run_logger().info(
        "rollout worker %s: %d batches committed, stopped: %s", name, len(result["batches"]), result["stopped"]
    )
    return result

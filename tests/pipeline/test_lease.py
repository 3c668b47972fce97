"""The run's writer lease on a real store (a folder, and S3 on the loopback moto server): a second
writer is refused naming the holder; a stale lease (its process gone, or no heartbeat) is taken over
by exactly one new writer; the old holder notices it lost the run."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ragen_tasks.data.store import Store
from ragen_tasks.pipeline.lease import RunLease, RunLeaseError, check_free, current_lease


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "file":
        return Store(str(tmp_path / "runs"))
    import boto3

    bucket = f"lease-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=request.getfixturevalue("s3_server")).create_bucket(Bucket=bucket)
    return Store(f"s3://{bucket}/runs")


def test_a_second_writer_is_refused_naming_the_holder(store: Store) -> None:
    held = RunLease.acquire(store, "run1", stale_after_s=300)
    with pytest.raises(RunLeaseError, match=r"being written by another process \(host .*, pid \d+"):
        RunLease.acquire(store, "run1", stale_after_s=300)
    with pytest.raises(RunLeaseError):
        check_free(store, "run1", 300)
    RunLease.acquire(store, "run2", stale_after_s=300).release()  # other runs are not affected
    held.release()
    again = RunLease.acquire(store, "run1", stale_after_s=300)  # a released lease is free
    assert again.seq == 1
    again.release()


def test_the_lease_of_a_killed_process_on_this_host_is_taken_over_at_once(store: Store, tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"owner": "x", "host": __import__("socket").gethostname(), "pid": int(gone.stdout), "heartbeat": 1e18}
    store.create_object("run1/lease/lease-000000.json", json.dumps(record).encode())
    taken = RunLease.acquire(store, "run1", stale_after_s=300)
    assert taken.seq == 1 and current_lease(store, "run1")[1]["owner"] == taken.record["owner"]  # type: ignore[index]
    taken.release()


def test_a_lease_without_heartbeat_is_stale_and_its_holder_learns_it_lost_the_run(store: Store) -> None:
    old = RunLease.acquire(store, "run1", stale_after_s=0.01)
    old.record = {**old.record, "host": "another-host"}  # not this host: only the heartbeat's age counts
    store.put_object("run1/lease/lease-000000.json", json.dumps({**old.record, "heartbeat": 0}).encode())
    new = RunLease.acquire(store, "run1", stale_after_s=0.01)
    assert new.seq == 1
    old.heartbeat()
    with pytest.raises(RunLeaseError, match="lost its lease"):
        old.check()
    old.release()  # a lost lease is not marked released: the new holder's stays in force
    assert not current_lease(store, "run1")[1]["released"]  # type: ignore[index]
    new.release()


def test_two_takers_of_one_stale_lease_cannot_both_win(store: Store) -> None:
    store.create_object("run1/lease/lease-000000.json", json.dumps({"heartbeat": 0, "host": "h", "pid": 1}).encode())
    first = RunLease.acquire(store, "run1", stale_after_s=1)
    # The second taker read the same stale lease 0 and tries to create lease 1 too: the create-only write refuses.
    assert not store.create_object("run1/lease/lease-000001.json", b"{}")
    first.release()

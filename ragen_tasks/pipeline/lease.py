"""A run's writer lease: one training process writes a run at a time.

Two ``ragen train`` with the same run id would both write the same checkpoint folders (and remove
each other's temp folders), so the train flow holds a lease object in the store while it runs::

    {run_id}/lease/lease-{n:06d}.json   {"owner", "host", "pid", "started", "heartbeat", "released"}

The lease with the highest ``n`` is the current one. Taking a lease is a create-only write of the next
number (the store's conditional put), so of two processes that both find the current lease free or
stale, exactly one wins. The holder refreshes ``heartbeat`` from a background thread; before each
refresh it checks that no newer lease exists, and a holder that finds one has lost the run and stops
at the next iteration.

A lease is free when released; stale when its heartbeat is older than ``store.lease_stale_s``, or at
once when its holder ran on this host and its process is gone (a killed run resumes without waiting).
Staleness compares the holder's clock with the reader's: hosts are assumed to keep time within a
small fraction of ``lease_stale_s``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ragen_tasks.data.keys import check_run_id
from ragen_tasks.data.store import Store

log = logging.getLogger(__name__)


class RunLeaseError(RuntimeError):
    """Another process holds the run's lease (or took it over from this one)."""


def _key(run_id: str, seq: int) -> str:
    return f"{check_run_id(run_id)}/lease/lease-{seq:06d}.json"


def current_lease(store: Store, run_id: str) -> tuple[int, dict[str, Any]] | None:
    """(number, record) of the run's newest lease, or None if it never had one."""
    seq = -1
    while store.object_exists(_key(run_id, seq + 1)):
        seq += 1
    if seq < 0:
        return None
    data = store.get_object(_key(run_id, seq), max_bytes=64 * 1024)
    try:
        record = json.loads(data or b"{}")
    except ValueError:
        record = {}  # an unreadable lease protects nothing: treat it as stale
    return seq, record if isinstance(record, dict) else {}


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def stale_reason(record: dict[str, Any], stale_after_s: float, now: float | None = None) -> str | None:
    """Why ``record`` no longer protects the run (released, holder gone, heartbeat too old), or None."""
    now = time.time() if now is None else now
    if record.get("released"):
        return "released"
    host, pid, beat = record.get("host"), record.get("pid"), record.get("heartbeat")
    if not isinstance(beat, int | float):
        return "unreadable lease"
    if host == socket.gethostname() and isinstance(pid, int) and not _process_alive(pid):
        return f"its process {pid} on this host is gone"
    if now - beat > stale_after_s:
        return f"no heartbeat for {now - beat:.0f} s (store.lease_stale_s={stale_after_s:g})"
    return None


def describe(record: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    beat = record.get("heartbeat")
    age = f"{now - beat:.0f} s ago" if isinstance(beat, int | float) else "unknown"
    return f"host {record.get('host')!r}, pid {record.get('pid')}, started {record.get('started')}, heartbeat {age}"


def check_free(store: Store, run_id: str, stale_after_s: float) -> None:
    """Raise RunLeaseError if a live process holds the run (what ``ragen train`` checks before it starts)."""
    found = current_lease(store, run_id)
    if found is not None and stale_reason(found[1], stale_after_s) is None:
        raise RunLeaseError(
            f"run {store.uri(run_id)} is being written by another process ({describe(found[1])}); wait for it "
            f"to finish, or use another --run-id (a crashed holder's lease is taken over after "
            f"store.lease_stale_s={stale_after_s:g} s without a heartbeat)"
        )


@dataclass
class RunLease:
    """The lease this process holds on a run; ``start()`` the heartbeat, ``check()`` it between
    iterations, ``release()`` it at the end."""

    store: Store
    run_id: str
    seq: int
    record: dict[str, Any]
    stale_after_s: float
    lost: str | None = None  # why the lease was lost (set by the heartbeat thread)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, store: Store, run_id: str, *, stale_after_s: float) -> RunLease:
        """Take the run's lease, or raise RunLeaseError naming the live holder."""
        found = current_lease(store, run_id)
        seq = 0
        if found is not None:
            check_free(store, run_id, stale_after_s)
            seq = found[0] + 1
            log.warning(
                "taking over the lease of run %s from %s (%s)",
                run_id,
                describe(found[1]),
                stale_reason(found[1], stale_after_s),
            )
        now = time.time()
        record = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "heartbeat": now,
            "released": False,
        }
        if not store.create_object(_key(run_id, seq), json.dumps(record).encode()):
            winner = current_lease(store, run_id)
            raise RunLeaseError(
                f"run {store.uri(run_id)}: another process took its lease at the same moment "
                f"({describe(winner[1]) if winner else 'unknown holder'}); use another --run-id or wait for it"
            )
        return cls(store=store, run_id=run_id, seq=seq, record=record, stale_after_s=stale_after_s)

    def heartbeat(self) -> None:
        """Refresh the heartbeat, unless a newer lease exists (then the lease is lost)."""
        if self.store.object_exists(_key(self.run_id, self.seq + 1)):
            newer = current_lease(self.store, self.run_id)
            self.lost = f"taken over by {describe(newer[1]) if newer else 'another process'}"
            return
        self.record = {**self.record, "heartbeat": time.time()}
        self.store.put_object(_key(self.run_id, self.seq), json.dumps(self.record).encode())

    def _beat(self) -> None:
        interval = max(1.0, self.stale_after_s / 5)
        while not self._stop.wait(interval) and self.lost is None:
            try:
                self.heartbeat()
            except Exception as exc:  # a store hiccup: try again next beat; staleness is judged by others
                log.warning("run %s: lease heartbeat failed (%s)", self.run_id, exc)

    def start(self) -> RunLease:
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise RunLeaseError if another process took the run over."""
        if self.lost is not None:
            raise RunLeaseError(
                f"run {self.store.uri(self.run_id)}: this process lost its lease ({self.lost}); stopping"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.lost is None and not self.store.object_exists(_key(self.run_id, self.seq + 1)):
            self.record = {**self.record, "released": True, "heartbeat": time.time()}
            self.store.put_object(_key(self.run_id, self.seq), json.dumps(self.record).encode())

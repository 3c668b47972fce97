"""Async rollouts: workers sample continuously against the newest checkpoint; the trainer consumes
only batches that pass the freshness check. Library side only (no Prefect); the flows in
``flows/rollout_worker.py`` and ``flows/stages.py`` wrap it.

Worker loop (:func:`run_worker`)::

    newest committed checkpoint v  ->  roll out one batch of full groups with policy version v
    ->  commit iter_{v}/rollouts/w-{worker}-{seq}  (stamped with v and the weights fingerprint)

Each worker writes only its own item names (``w-{worker}-{seq:06d}``: ``data.keys.worker_item``) and
manifests are create-only, so two workers never collide, and a worker killed mid-batch leaves nothing committed half-way (its
data objects are orphans no manifest names). A worker commits at most ``async_batches_per_version``
batches per policy version, then waits for a newer checkpoint; it stops after ``max_batches``, when
the run's last iteration is committed, or after ``async_wait_timeout_s`` without a new
checkpoint (bounded: never a silent hang).

Trainer side (:func:`consume_batch`; iteration k trains policy version c = ``policy_step(run, k)``):
the committed worker batches not decided by an earlier iteration are checked with :func:`check_freshness` against c, the known
fingerprints of versions c - max_staleness .. c and ``max_staleness``; stale / future /
unknown-fingerprint batches are REJECTED (counted in the iteration's ledger, with the
episode-length distribution of rejected vs kept) and never copied; the freshest accepted batch is
copied to ``iter_k/rollouts/trajectories``, where ``filter_and_validate`` and ``update`` read it
exactly as in-process. The ledger ``iter_k/summary/async`` is committed first, so a retried consume
re-copies the same batch (idempotent). If no fresh batch arrives the trainer warns after
``async_warn_after_s`` and fails after ``async_wait_timeout_s`` with a message naming
``freshness.max_staleness`` (the deadlock where the bound is tighter than a checkpoint's publish
latency plus a rollout).

Discovery lists ``iter_*/rollouts/*.manifest.json`` (``Store.iterations``, ``Store.committed_names``);
every candidate is then read through its manifest (checksums checked), so a listing never makes
uncommitted data visible.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ragen_tasks.data.freshness import check_freshness, freshness_report
from ragen_tasks.data.keys import check_part, parse_worker_item, worker_item
from ragen_tasks.data.manifest import ManifestError
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.pipeline.lineage import policy_step, trusted_fingerprints
from ragen_tasks.pipeline.policy import play_checkpoint
from ragen_tasks.pipeline.run import PRODUCER, Run, open_existing_run
from ragen_tasks.rollout.loop import RolloutTask, make_group_tasks
from ragen_tasks.training import checkpoint as ckpt

log = logging.getLogger(__name__)

LEDGER_STAGE, LEDGER_NAME = "summary", "async"
CONSUMED_NAME = "trajectories"  # the trainer's copy in iter_k/rollouts: what filter_and_validate reads


# ----------------------------------------------------------------------------------- discovery
def list_worker_items(run: Run) -> list[tuple[int, str]]:
    """``(policy_version, name)`` of every committed worker batch of the run (listing manifests)."""
    store, rid = run.store, run.run_id
    return sorted(
        (version, name)
        for version in store.iterations(rid)
        for name in store.committed_names(rid, version, "rollouts")
        if parse_worker_item(name) is not None
    )


def newest_checkpoint(run: Run) -> int | None:
    """Step of the newest committed checkpoint (the store's on s3://, the run folder's locally)."""
    if run.is_local:
        info = ckpt.latest_checkpoint(run.checkpoint_root)
        return None if info is None else info.step
    steps = run.store.list_checkpoints(run.run_id)
    return steps[-1] if steps else None


def worker_tasks(run: Run, worker: str, seq: int) -> list[RolloutTask]:
    """The full groups of one worker batch: a deterministic stream per (worker, seq), ids prefixed by
    the item name so every trajectory of the run stays traceable to the batch that produced it."""
    config, name = run.config, worker_item(worker, seq)
    stream = int(hashlib.sha256(name.encode()).hexdigest()[:12], 16)  # not hash(): same on every pod
    tasks = make_group_tasks(
        config.envs,
        config.rollout.groups,
        config.rollout.group_size,
        config.seed,
        stream,
        seed_space=config.eval.seed_offset,
        min_plan_length=config.rollout.min_plan_length,
        long_plan_share=config.rollout.long_plan_share,
    )
    return [replace(t, traj_id=f"{name}-{t.traj_id.split('-', 1)[1]}") for t in tasks]


# ----------------------------------------------------------------------------------- worker
def wait_for_run(
    run_uri: str,
    *,
    timeout_s: float,
    poll_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Run:
    """The run at ``run_uri`` once its trainer has committed the config (bounded wait)."""
    start = clock()
    while True:
        try:
            return open_existing_run(run_uri)
        except FileNotFoundError:
            if clock() - start > timeout_s:
                raise TimeoutError(
                    f"rollout worker: no run at {run_uri} after {timeout_s:.0f}s; start the trainer "
                    "first (it commits the config) or check store_root/run_id"
                ) from None
            sleep(poll_s)


def run_worker(
    run_uri: str,
    worker: str,
    *,
    max_batches: int | None = None,
    idle_timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Roll out batches against the newest checkpoint until done (see the module docstring).

    Returns ``{"worker", "batches": [item URIs committed by this call], "stopped": reason}``.
    """
    check_part(worker, "worker")
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches={max_batches} must be >= 0 (or None for no limit)")
    run = wait_for_run(
        run_uri, timeout_s=900.0 if idle_timeout_s is None else idle_timeout_s, poll_s=1.0, sleep=sleep, clock=clock
    )
    cfg = run.config.rollout
    idle_timeout = cfg.async_wait_timeout_s if idle_timeout_s is None else idle_timeout_s
    mine = [(v, n) for v, n in list_worker_items(run) if (parsed := parse_worker_item(n)) and parsed[0] == worker]
    per_version = Counter(v for v, _ in mine)
    seq = len(mine)  # a restarted worker continues its numbering; nothing committed is rewritten
    committed: list[str] = []
    idle_since, stopped = clock(), "max_batches"
    while max_batches is None or len(committed) < max_batches:
        if run.store.has_manifest(run.run_id, run.config.iterations - 1, "summary", "summary"):
            stopped = "the run's last iteration is committed"
            break
        version = newest_checkpoint(run)
        if version is None or per_version[version] >= cfg.async_batches_per_version:
            if clock() - idle_since > idle_timeout:
                stopped = f"no new checkpoint for {idle_timeout:.0f}s"
                log.warning("rollout worker %s: %s (last version %s); stopping", worker, stopped, version)
                break
            sleep(cfg.async_poll_s)
            continue
        try:
            uri = _roll_one(run, worker, seq, version)
        except (ManifestError, ckpt.CheckpointError, FileNotFoundError) as e:  # pruned between list and load
            log.info("rollout worker %s: checkpoint %d went away (%s); retrying with the newest", worker, version, e)
            sleep(cfg.async_poll_s)
            continue
        committed.append(uri)
        per_version[version] += 1
        seq += 1
        idle_since = clock()
    return {"worker": worker, "batches": committed, "stopped": stopped}


def _roll_one(run: Run, worker: str, seq: int, version: int) -> str:
    config, name = run.config, worker_item(worker, seq)
    path = run.checkpoint_path(version)
    fp = str(ckpt.verify_checkpoint(path)["fingerprint"])
    trajectories = play_checkpoint(
        config,
        path,
        worker_tasks(run, worker, seq),
        temperature=config.rollout.temperature,
        seed=int(hashlib.sha256(name.encode()).hexdigest()[:8], 16),
        policy_version=version,
        weights_fingerprint=fp,
    )
    run.store.write_trajectories(
        run.run_id,
        version,
        "rollouts",
        trajectories,
        producer=f"rollout-worker:{worker}",
        policy_version=version,
        weights_fingerprint=fp,
        name=name,
        extra={"worker": worker, "seq": seq},
    )
    log.info("rollout worker %s: committed %s (policy version %d)", worker, name, version)
    return run.store.uri(run.run_id, version, "rollouts", name)


# ----------------------------------------------------------------------------------- trainer
def decided_items(run: Run, before: int) -> set[str]:
    """Worker items consumed or rejected by the ledgers of iterations ``< before``."""
    out: set[str] = set()
    for k in range(before):
        if run.store.has_manifest(run.run_id, k, LEDGER_STAGE, LEDGER_NAME):
            ledger, _ = run.store.read_json(run.run_id, k, LEDGER_STAGE, LEDGER_NAME)
            out.update(d["item"] for d in ledger["decisions"])
    return out


def consume_batch(
    run: Run,
    iteration: int,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Async mode's rollout stage for ``iteration``: wait (bounded) for a fresh worker batch, reject the
    stale / future / unknown-fingerprint ones, copy the chosen one to ``iter_k/rollouts``.

    Returns metrics (``async/...``): rejections by reason, staleness (lag) of the consumed batch,
    lag histogram of every batch decided here, episode lengths of kept vs rejected, wait time.
    """
    store, rid = run.store, run.run_id
    if not store.has_manifest(run.run_id, iteration, LEDGER_STAGE, LEDGER_NAME):
        ledger = _choose_batch(run, iteration, sleep=sleep, clock=clock)
        store.write_json(
            rid,
            iteration,
            LEDGER_STAGE,
            LEDGER_NAME,
            ledger,
            producer=PRODUCER,
            policy_version=policy_step(run, iteration),
        )
    ledger, _ = store.read_json(rid, iteration, LEDGER_STAGE, LEDGER_NAME)  # the first committed one wins
    if not store.has_manifest(rid, iteration, "rollouts", CONSUMED_NAME):
        chosen = ledger["consumed"]
        trajectories, manifest = store.read_trajectories(rid, chosen["version"], "rollouts", chosen["item"])
        store.write_trajectories(
            rid,
            iteration,
            "rollouts",
            trajectories,
            producer=PRODUCER,
            policy_version=manifest.policy_version,
            weights_fingerprint=manifest.weights_fingerprint,
            extra={"consumed": chosen["item"], "consumed_version": chosen["version"]},
        )
    metrics = dict(ledger["metrics"])
    metrics["trajectories"] = store.read_manifest(rid, iteration, "rollouts", CONSUMED_NAME).num_rows
    return metrics


def _choose_batch(
    run: Run, iteration: int, *, sleep: Callable[[float], None], clock: Callable[[], float]
) -> dict[str, Any]:
    cfg, staleness = run.config.rollout, run.config.freshness.max_staleness
    current = policy_step(run, iteration)  # the trainer's policy version (checkpoint step)
    known = trusted_fingerprints(run, iteration, staleness)  # lineage only: never a rolled-back step
    decided = decided_items(run, iteration)
    decisions: list[dict[str, Any]] = []
    rejected: list[Trajectory] = []
    start, warned = clock(), False
    while True:
        accepted: list[dict[str, Any]] = []
        for version, name in sorted(v_n for v_n in list_worker_items(run) if v_n[1] not in decided):
            manifest = run.store.read_manifest(run.run_id, version, "rollouts", name)
            decision = (
                check_freshness(manifest.policy_version, manifest.weights_fingerprint, current, known, staleness)
                if manifest.policy_version >= 0 and manifest.policy_version == version
                else None
            )
            entry = {
                "item": name,
                "version": version,
                "lag": current - version,
                "reason": "unknown_fingerprint" if decision is None else decision.reason,
            }
            if decision is not None and decision.accepted:
                accepted.append(entry)  # undecided until chosen: a later iteration may still use it
                continue
            decided.add(name)
            decisions.append(entry)
            rejected.extend(run.store.read_trajectories(run.run_id, version, "rollouts", name)[0])
            log.warning(
                "iteration %d: rejected worker batch %s (policy version %d, lag %d, max_staleness %d): %s",
                iteration,
                name,
                version,
                current - version,
                staleness,
                entry["reason"],
            )
        if accepted:
            chosen = min(accepted, key=lambda e: (e["lag"], e["item"]))  # freshest, then by name: deterministic
            decisions.append(chosen)
            trajectories, _ = run.store.read_trajectories(run.run_id, chosen["version"], "rollouts", chosen["item"])
            return _ledger(current, staleness, chosen, decisions, trajectories, rejected, known, clock() - start)
        waited = clock() - start
        counts = Counter(d["reason"] for d in decisions)
        message = (
            f"async trainer: no batch fresh enough for policy version {current} after {waited:.0f}s "
            f"(freshness.max_staleness={staleness}; rejected so far: {dict(counts) or 'none'}). A checkpoint's "
            "publish latency plus one rollout may exceed what max_staleness allows: raise "
            "freshness.max_staleness, or check that rollout workers are running against this run"
        )
        if waited > cfg.async_wait_timeout_s:
            raise TimeoutError(f"{message} (gave up after rollout.async_wait_timeout_s={cfg.async_wait_timeout_s})")
        if waited > cfg.async_warn_after_s and not warned:
            log.warning("%s; still waiting (up to rollout.async_wait_timeout_s=%s)", message, cfg.async_wait_timeout_s)
            warned = True
        sleep(cfg.async_poll_s)


def _ledger(
    current: int,
    staleness: int,
    chosen: dict[str, Any],
    decisions: list[dict[str, Any]],
    accepted: list[Trajectory],
    rejected: list[Trajectory],
    known: dict[int, str],
    waited: float,
) -> dict[str, Any]:
    report = freshness_report([*accepted, *rejected], current, known, staleness)
    counts = Counter(d["reason"] for d in decisions if d is not chosen)
    metrics: dict[str, float] = {
        f"async/rejected_batches_{r}": float(counts.get(r, 0)) for r in ("stale", "future", "unknown_fingerprint")
    }
    metrics["async/consumed_lag"] = float(chosen["lag"])
    metrics["async/wait_s"] = waited
    metrics.update({f"async/{k.removeprefix('freshness/')}": v for k, v in report.metrics().items()})
    lags = Counter(int(d["lag"]) for d in decisions)
    return {
        "policy_version": current,
        "max_staleness": staleness,
        "consumed": chosen,
        "decisions": decisions,
        "lag_histogram": {str(k): n for k, n in sorted(lags.items())},
        "metrics": {k: (v if v == v else None) for k, v in metrics.items()},
    }  # NaN (empty set) -> null


def staleness_distribution(run: Run) -> dict[str, dict[int, int]]:
    """Lag histograms over the whole run: ``{"consumed": {lag: batches}, "rejected": {lag: batches}}``."""
    consumed: Counter[int] = Counter()
    rejected: Counter[int] = Counter()
    last = run.store.last_committed_iteration(run.run_id, LEDGER_STAGE, LEDGER_NAME)
    for k in range(0 if last is None else last + 1):
        ledger, _ = run.store.read_json(run.run_id, k, LEDGER_STAGE, LEDGER_NAME)
        for d in ledger["decisions"]:
            (consumed if d["item"] == ledger["consumed"]["item"] else rejected)[int(d["lag"])] += 1
    return {"consumed": dict(sorted(consumed.items())), "rejected": dict(sorted(rejected.items()))}

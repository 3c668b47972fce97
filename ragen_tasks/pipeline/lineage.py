"""Policy lineage: which checkpoint step each iteration samples with, the weights' fingerprints,
and the run as an iteration must see it (the guard's mitigations in force, its rollback targets kept).

Policy versions are checkpoint steps. Iteration ``k`` samples with ``policy_step(run, k)`` (0 for
the first iteration, then the ``policy/next_step`` recorded by iteration ``k-1``), and its update
commits the next step. Usually that is just ``k -> k+1``; after a guard rollback the next step is a
new checkpoint holding an older, healthy checkpoint's exact weights, and the numbering moves on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ragen_tasks import guard
from ragen_tasks.pipeline.run import Run, open_existing_run
from ragen_tasks.training import checkpoint as ckpt

log = logging.getLogger(__name__)


def history(run: Run, *, before: int | None = None, last: int | None = None) -> list[dict[str, Any]]:
    """Committed iteration rows in order: all of them, or those before iteration ``before``, or only
    the ``last`` few of those (reads only what it returns: per-iteration callers stay O(1))."""
    end = before
    if end is None:
        done = run.store.last_committed_iteration(run.run_id, "summary", "summary")
        end = 0 if done is None else done + 1
    start = 0 if last is None else max(0, end - last)
    return [run.store.read_json(run.run_id, k, "summary", "summary")[0] for k in range(start, end)]


def policy_step(run: Run, iteration: int) -> int:
    """The checkpoint step that samples iteration ``iteration`` (see the module docstring)."""
    if iteration == 0:
        return 0
    previous, _ = run.store.read_json(run.run_id, iteration - 1, "summary", "summary")
    return int(previous["policy/next_step"])


def marker_fingerprint(run: Run, step: int) -> str:
    """sha256 of checkpoint ``step``'s weight file, as its own commit marker states it."""
    marker_path = run.checkpoint_path(step, verify=False) / ckpt.MARKER
    try:
        return str(json.loads(marker_path.read_text())["fingerprint"])
    except (ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(
            f"checkpoint {marker_path.parent}: {ckpt.MARKER} is not a valid commit marker"
        ) from e


def recorded_fingerprint(run: Run, step: int) -> tuple[str, str] | None:
    """(fingerprint, where) of checkpoint ``step`` as the run's lineage recorded it when the step was
    committed: ``iter_0/summary/initial_policy`` for step 0, else the update (or guard rollback)
    manifest of the iteration that committed it. None while that record is not written yet (the
    committing stage itself, or a retry of it)."""
    if step == 0:
        if not run.store.has_manifest(run.run_id, 0, "summary", "initial_policy"):
            return None
        manifest = run.store.read_manifest(run.run_id, 0, "summary", "initial_policy")
        return manifest.weights_fingerprint, run.store.uri(run.run_id, 0, "summary", "initial_policy")
    # Iteration k commits step policy_step(k) + 1 (+ 1 more after a rollback), so the committing
    # iteration is at most step - 1, and walking down, the first committed update below ``step`` ends the search.
    for k in range(step - 1, -1, -1):
        if run.store.has_manifest(run.run_id, k, "update", "rollback"):
            rolled, manifest = run.store.read_json(run.run_id, k, "update", "rollback")
            if int(rolled["new_step"]) == step:
                return str(rolled["fingerprint"]), run.store.uri(run.run_id, k, "update", "rollback")
        if run.store.has_manifest(run.run_id, k, "update", "metrics"):
            manifest = run.store.read_manifest(run.run_id, k, "update", "metrics")
            if manifest.policy_version == step:
                return manifest.weights_fingerprint, run.store.uri(run.run_id, k, "update", "metrics")
            if manifest.policy_version < step:
                return None
    return None


def fingerprint(run: Run, step: int) -> str:
    """sha256 of checkpoint ``step``'s weights. The run's lineage is the authority: a checkpoint whose
    marker states another fingerprint than the one recorded when the step was committed (files
    replaced and the marker re-signed) is refused with CheckpointError."""
    stated = marker_fingerprint(run, step)
    recorded = recorded_fingerprint(run, step)
    if recorded is not None and recorded[0] != stated:
        raise ckpt.CheckpointError(
            f"checkpoint {run.checkpoint_path(step, verify=False)}: its marker states fingerprint {stated[:12]}.. "
            f"but the run recorded {recorded[0][:12]}.. for step {step} when it was committed ({recorded[1]}): "
            "the checkpoint was replaced after commit; refusing it (restore the original or start a new run)"
        )
    return stated


def trusted_fingerprints(run: Run, iteration: int, max_staleness: int) -> dict[int, str]:
    """{step: fingerprint} of the steps a batch for ``iteration`` may come from: the current step and
    the steps of the policy's LINEAGE (the ``policy/step`` each recent iteration actually sampled with)
    up to ``max_staleness`` behind it. A checkpoint replaced by a guard rollback is never in the
    lineage, and a pruned one has no fingerprint: batches from either are rejected as
    unknown_fingerprint (keep checkpoint.keep_last > max_staleness)."""
    current = policy_step(run, iteration)
    # Steps grow by >= 1 per iteration, so the last max_staleness + 1 rows hold every step in the window.
    recent = history(run, before=iteration, last=max_staleness + 1)
    trusted: dict[int, str] = {}
    for step in sorted({current, *(int(r["policy/step"]) for r in recent if "policy/step" in r)}):
        if current - max_staleness <= step <= current:
            try:
                trusted[step] = fingerprint(run, step)
            except (ckpt.CheckpointError, FileNotFoundError, OSError) as exc:
                log.warning("policy step %d: fingerprint unknown (%s); its batches will be rejected", step, exc)
    return trusted


def run_in_force(base: Run, iteration: int, rows: Sequence[Mapping[str, Any]] | None = None) -> Run:
    """``base`` as iteration ``iteration`` must see it: the guard's mitigations recorded by the
    previous iteration in force, and protection from pruning for the guard's last healthy checkpoint and
    the step this iteration samples with. ``rows``: the committed rows before ``iteration`` if the
    caller holds them; else the recent ones are read from the store."""
    rules = guard.rules(base.config.guard)
    if rows is None:  # the guard looks back at most max_patience + 1 signal-free rows since a rollback
        rows = history(base, before=iteration, last=4 * (guard.max_patience(rules) + 1))
    protect = {policy_step(base, iteration)}
    if base.config.guard.action in ("stop", "rollback"):  # only these ever go back to an older checkpoint
        protect |= guard.rollback_candidates(guard.since_last_rollback(rows), rules)
    return replace(base, config=guard.in_force(rows).apply(base.config), protect_steps=frozenset(protect))


def run_for_iteration(run_uri: str, iteration: int) -> Run:
    """The run at ``run_uri`` as iteration ``iteration`` must see it: what a stage task or a stage
    deployment opens from the URI it is given."""
    return run_in_force(open_existing_run(run_uri), iteration)

"""Sharded rollouts: one batch of tasks spread over several engines, merged back in task order.

A shard is a set of whole groups (rollouts sharing an initial state stay on one engine, so a
group's samples come from one policy copy). Each shard is played by ``play(tasks, engine_options)``
on its own engine, either in a thread (engines that are clients of a server: one
OpenAI-compatible server per shard) or in a process started with the ``spawn`` method (local
engines: each process builds its own engine from plain data, e.g. a checkpoint path; no model is
ever pickled). The merged list holds the trajectory of ``tasks[i]`` at position ``i``, exactly the
order one engine's ``run_rollouts`` returns.

Why the trajectories equal one engine's: the engines key their sampling randomness on (seed,
session id, step), never on a row's position in a batch (``rollout/seeding.py``), and an episode
never interacts with the others. What can still differ is float rounding of batched math, see
``hf_engine``'s "Batch composition".

Failure: if any shard fails, ``run_sharded`` raises ``RolloutShardError`` naming every failed shard
(its server URL or process number, and its task range) after the others have ended; nothing is
returned, so the caller commits nothing.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.rollout.loop import RolloutTask

logger = logging.getLogger(__name__)

PlayShard = Callable[[list[RolloutTask], dict[str, Any]], list[Trajectory]]  # (tasks, engine_options) -> trajectories


class RolloutShardError(RuntimeError):
    """One or more rollout shards failed; the message names each (URL or process) and its tasks."""


def split_groups(tasks: Sequence[RolloutTask], shards: int) -> list[list[int]]:
    """Task indices of each shard: whole groups together, balanced by task count.

    Groups (by ``group_id``, in order of first appearance) are dealt out in contiguous runs: the
    group whose tasks start at cumulative count ``c`` (of ``n`` tasks) goes to shard
    ``c * shards // n``. Within a shard, indices keep the task order. Shards that get no group
    (fewer groups than shards) are left out, so the result may be shorter than ``shards``.
    """
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1")
    members: dict[int, list[int]] = {}
    for i, task in enumerate(tasks):
        members.setdefault(task.group_id, []).append(i)
    out: list[list[int]] = [[] for _ in range(shards)]
    seen = 0
    for indices in members.values():
        out[seen * shards // max(len(tasks), 1)].extend(indices)
        seen += len(indices)
    return [sorted(s) for s in out if s]


def shard_label(index: int, count: int, options: Mapping[str, Any]) -> str:
    """How errors and logs name a shard: its server URL, else its process number."""
    where = f"server {options['base_url']}" if "base_url" in options else "local process"
    return f"rollout shard {index + 1}/{count} ({where})"


def _set_threads(threads: int) -> None:
    """Initializer of a spawned shard process: its share of the host's cores (N processes with all
    cores each oversubscribe the CPU, and idle OpenMP threads spin). torch reads these variables
    when it is imported; if the parent's ``__main__`` module, which spawn re-imports first, already
    imported torch, its thread count is set directly."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def run_sharded(
    tasks: Sequence[RolloutTask],
    shard_options: Sequence[dict[str, Any]],
    play: PlayShard,
    *,
    processes: bool,
    threads_per_process: int = 1,
) -> list[Trajectory]:
    """Play ``tasks`` split over ``len(shard_options)`` shards; shard ``k`` runs
    ``play(its tasks, shard_options[k])``. ``processes``: each shard in its own spawned process
    (``play`` and its arguments must pickle: a module-level function or a ``functools.partial`` of
    one, with plain data); else each in a thread. Returns one trajectory per task, in task order.
    """
    if not shard_options:
        raise ValueError("shard_options: give at least one shard")
    if not tasks:
        return []
    parts = split_groups(tasks, len(shard_options))
    if len(parts) < len(shard_options):
        idle = len(shard_options) - len(parts)
        logger.info("%d groups of tasks for %d rollout shards: %d stay idle", len(parts), len(shard_options), idle)
    count = len(parts)
    executor: Executor
    if processes:
        executor = ProcessPoolExecutor(
            max_workers=count,
            mp_context=multiprocessing.get_context("spawn"),  # fork would copy torch's threads and locks
            initializer=_set_threads,
            initargs=(max(1, threads_per_process),),
        )
    else:
        executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="rollout-shard")
    with executor:
        futures: list[Future[list[Trajectory]]] = [
            executor.submit(play, [tasks[i] for i in part], dict(options))
            for part, options in zip(parts, shard_options, strict=False)
        ]
    # leaving the with-block waited for every shard: a failed one never leaves others running behind it
    merged: list[Trajectory | None] = [None] * len(tasks)
    failures: list[str] = []
    first: BaseException | None = None
    for k, (part, future, options) in enumerate(zip(parts, futures, shard_options, strict=False)):
        label = f"{shard_label(k, count, options)}, tasks {tasks[part[0]].traj_id}..{tasks[part[-1]].traj_id}"
        exc = future.exception()
        first = first or exc
        if isinstance(exc, BrokenProcessPool):
            failures.append(f"{label}: its process died or its result could not be read back ({exc})")
            continue
        if exc is not None:
            failures.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        trajectories = future.result()
        got = [t.traj_id for t in trajectories]
        wanted = [tasks[i].traj_id for i in part]
        if got != wanted:
            failures.append(
                f"{label}: returned trajectories {got[:3]}... for tasks {wanted[:3]}... (count or order differs)"
            )
            continue
        for i, trajectory in zip(part, trajectories, strict=True):
            merged[i] = trajectory
    if failures:
        raise RolloutShardError(
            f"{len(failures)} of {count} rollout shards failed; nothing of this batch is returned: "
            + "; ".join(failures)
        ) from first
    return [t for t in merged if t is not None]

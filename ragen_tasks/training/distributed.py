"""Data-parallel ranks of the update: which rank this process is, the collectives the update uses,
and the local launcher (torchrun).

``update.world_size: 1`` (the default) runs the update in the stage's own process: no process
group, every helper here is a no-op. With N > 1 the update stage launches
``python -m torch.distributed.run --standalone --nproc-per-node N -m ragen_tasks.pipeline.update_ranks
RUN ITERATION`` and waits; each rank reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), joins the process group (gloo on CPU, nccl on GPU) and runs the same
update on its shard of every minibatch. A rank that fails writes its error to
``RAGEN_RANK_ERROR_DIR`` so the launcher raises it as one line, of the same type where the type is
one the callers act on (a diverged update must stay final for the flow's retries).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ragen_tasks.config import UpdateConfig

log = logging.getLogger(__name__)

ERROR_DIR_ENV = "RAGEN_RANK_ERROR_DIR"  # where a failing rank writes rank-<r>.json: {"type", "message"}


@dataclass(frozen=True)
class Ranks:
    """This process's place among the update's data-parallel ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # rank within this node: picks the GPU and who fetches shared files

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes metrics, commits checkpoints and talks to the store."""
        return self.rank == 0


SINGLE = Ranks()


def current_ranks() -> Ranks:
    """The ranks of the initialised process group, or ``SINGLE`` when there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def init_from_env() -> Ranks:
    """Join the process group torchrun described in the environment (gloo on CPU, nccl on GPU)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"not launched by torchrun: {', '.join(missing)} unset. Run the update ranks with "
            "python -m torch.distributed.run --nproc-per-node N -m ragen_tasks.pipeline.update_ranks RUN ITERATION"
        )
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return current_ranks()


def resolve_world_size(update: UpdateConfig) -> int:
    """Ranks per node: ``update.world_size``, or one per visible GPU when it is 0 (1 without GPUs)."""
    if update.world_size > 0:
        return update.world_size
    return max(torch.cuda.device_count(), 1)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) ``tensor`` over the ranks, in place; returns it. No-op without a process group."""
    if current_ranks().world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    """Wait until every rank got here. No-op without a process group."""
    if current_ranks().world_size > 1:
        dist.barrier()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, small: a problem string, file hashes), in rank order."""
    ranks = current_ranks()
    if ranks.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable, small)."""
    if current_ranks().world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def exit_finished_rank() -> NoReturn:
    """End a rank process whose work is done and written: destroy the process group, flush the
    logs and standard streams, and exit 0 without the interpreter's shutdown.

    Why not return normally: DeepSpeed keeps references to the process group (its engine, its ZeRO
    optimizer's parameters, ``deepspeed.utils.groups``), so ``destroy_process_group`` cannot join
    gloo's worker threads. A worker that then drops the last reference to a collective's tensor
    while the interpreter shuts down needs the GIL, cannot take it, and the C++ runtime aborts the
    process (SIGABRT, "terminate called without an active exception") after a successful update,
    at random. ``os._exit`` skips that shutdown; nothing the rank leaves behind depends on it."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def record_rank_errors() -> Iterator[None]:
    """Write an exception raised inside to ``$RAGEN_RANK_ERROR_DIR/rank-<r>.json`` (then re-raise)."""
    try:
        yield
    except BaseException as exc:
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder:
            record = {"type": type(exc).__name__, "message": str(exc)}
            (Path(folder) / f"rank-{current_ranks().rank}.json").write_text(json.dumps(record))
        raise


class UpdateRanksError(RuntimeError):
    """The ranks of a data-parallel update failed (the message names the rank and its error)."""


def launch_update_ranks(
    run_uri: str, iteration: int, nproc: int, *, known_errors: dict[str, Callable[[str], BaseException]]
) -> None:
    """Run the update of ``iteration`` with ``nproc`` local ranks under torchrun and wait.

    On failure raise the first failing rank's error: rebuilt with ``known_errors[type name]`` when
    its type is listed (so e.g. a diverged update stays final for the flow's retries), else as
    ``UpdateRanksError``."""
    with tempfile.TemporaryDirectory(prefix="ragen-ranks-") as errors:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "ragen_tasks.pipeline.update_ranks",
            run_uri,
            str(iteration),
        ]
        log.info("iteration %d: update on %d ranks: %s", iteration, nproc, " ".join(cmd))
        # The ranks share this machine's cores (torchrun would set 1 thread each, with a banner).
        threads = os.environ.get("OMP_NUM_THREADS") or str(max((os.cpu_count() or 1) // nproc, 1))
        env = {**os.environ, ERROR_DIR_ENV: errors, "OMP_NUM_THREADS": threads}
        code = subprocess.run(cmd, env=env, check=False).returncode
        if code == 0:
            return
        reports = sorted(Path(errors).glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        if not reports:
            raise UpdateRanksError(
                f"iteration {iteration}: the {nproc}-rank update exited with code {code} before any rank "
                "reported an error (killed, or out of memory?); see the ranks' output above"
            )
        record = json.loads(reports[0].read_text())
        rank = reports[0].stem.split("-")[1]
        make = known_errors.get(record["type"])
        if make is not None:
            raise make(record["message"])
        raise UpdateRanksError(
            f"iteration {iteration}: rank {rank} of {nproc} failed: {record['type']}: {record['message']}"
        )

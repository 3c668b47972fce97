"""One data-parallel rank of the update stage: ``python -m ragen_tasks.pipeline.update_ranks RUN ITERATION``.

Launched by torchrun (``--nproc-per-node N``; see ``ragen_tasks.training.distributed`` and, across
pods, ``ragen_tasks.training.k8s_launch``), never by hand: it joins the process group torchrun
describes, re-opens the run from the store as the iteration must see it, and runs
``update_stage.update`` on this rank. Exit code 0 = the next checkpoint and the update's metrics
are committed (by rank 0).
"""

from __future__ import annotations

import argparse
import logging

import torch.distributed as dist

from ragen_tasks.pipeline.lineage import run_for_iteration
from ragen_tasks.pipeline.update_stage import update
from ragen_tasks.training.distributed import exit_finished_rank, init_from_env, record_rank_errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ragen_tasks.pipeline.update_ranks", description=__doc__)
    parser.add_argument("run", help="the run's folder or URI (s3://bucket/prefix/<run_id>)")
    parser.add_argument("iteration", type=int, help="the iteration whose update to run")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # the launching stage shows progress
    with record_rank_errors():
        ranks = init_from_env()
        logging.basicConfig(
            level=logging.INFO if ranks.is_main else logging.WARNING, format=f"[rank {ranks.rank}] %(message)s"
        )
        try:
            update(run_for_iteration(args.run, args.iteration), args.iteration)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_finished_rank()  # not a normal exit: see its docstring

"""Runs the training flow (the production path: pipeline build / save / load, the flow's own resume)
on a tiny GAE run, with a crash injected on request. For the resume tests; run it as a script::

    python tests/pipeline/resume_harness.py --store DIR --run-id ID --iterations N [--kill-after K] [--kill-in-save K:write|commit]
        [--set KEY=VALUE ...] [--resume-set KEY=VALUE ...]

The process SIGKILLs itself: ``--kill-after K`` right after checkpoint step K commits (inside
iteration K-1's update, before the update's metrics are committed); ``--kill-in-save K:write``
while the files of checkpoint K are being written; ``--kill-in-save K:commit`` after checkpoint K's
folder is renamed into place but before its marker is written. Run it again without a kill to resume.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch

from ragen_tasks.training import checkpoint as ckpt

#: bandit-tiny with a critic (GAE), no warm start, and the smallest sizes that still run every stage.
RESUME_RUN: dict[str, Any] = {
    "algo.advantage": "gae",
    "algo.filter_keep_ratio": 1.0,
    "warm_start.enabled": False,
    "rollout.groups": 2,
    "rollout.group_size": 4,
    "agent.max_tokens_per_turn": 16,
    "optim.ppo_epochs": 2,
    "optim.minibatch_size": 4,
    "optim.micro_batch_size": 2,
    "eval.seeds": 2,
    "eval.every": 100,
}


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Make the save in progress SIGKILL this process at ``point`` ('write' or 'commit')."""
    if point == "write":
        real = torch.save

        def save_then_die(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
            real(obj, f, *a, **kw)
            _kill_self()

        torch.save = save_then_die  # checkpoint.py calls torch.save through the torch module
    elif point == "commit":
        ckpt.__dict__["sha256_file"] = lambda path: _kill_self()  # its first call comes after the rename
    else:
        raise ValueError(f"kill point {point!r}: expected 'write' or 'commit'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--kill-in-save", default=None, help="STEP:write or STEP:commit")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE over RESUME_RUN (YAML value)")
    parser.add_argument("--resume-set", action="append", default=[], help="KEY=VALUE recorded on resume")
    args = parser.parse_args()
    kill_in_save = args.kill_in_save.split(":") if args.kill_in_save else None
    real_save = ckpt.save_checkpoint

    def save_checkpoint(root: Path, step: int, **kwargs: Any) -> ckpt.CheckpointInfo:
        if kill_in_save is not None and int(kill_in_save[0]) == step:
            _arm(kill_in_save[1])
        info = real_save(root, step, **kwargs)
        if args.kill_after == step:
            _kill_self()
        return info

    ckpt.save_checkpoint = save_checkpoint  # the pipeline saves through the checkpoint module

    import yaml

    from flows.train import train

    def pairs(items: list[str]) -> dict[str, Any]:
        return {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in items)}

    train(
        preset="bandit-tiny",
        overrides={**RESUME_RUN, **pairs(args.set), "iterations": args.iterations},
        run_id=args.run_id,
        store_root=str(args.store),
        resume_set=pairs(args.resume_set) or None,
    )


if __name__ == "__main__":
    main()

"""The update on 2 data-parallel ranks (torchrun, gloo, 1 thread each) does the 1-rank update's work:
the same loss and pre-clip gradient norm at every optimizer step, for the torch backend (DDP; with a
critic too) and DeepSpeed ZeRO-2 and ZeRO-3, and with the supervised term on demonstrations. The batch's rows differ in length, so the ranks'
token-balanced shards hold different row counts and one rank runs padding micro-batches.

All 2-rank settings run in one torchrun launch (DeepSpeed's first start compiles a small op)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.dp_ranks import update_losses

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "torch:0:grpo",
    "torch:0:gae",
    "deepspeed:2:grpo",
    "deepspeed:3:grpo",
    "torch:0:grpo:demo",
    "deepspeed:3:grpo:demo",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[float]]]:
    out = tmp_path_factory.mktemp("dp") / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "tests/training/dp_ranks.py"), str(out), *SETTINGS]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("setting", SETTINGS)
def test_two_ranks_step_like_one(two_ranks: dict[str, list[list[float]]], setting: str) -> None:
    _, _, advantage, *demo = setting.split(":")
    one = update_losses(
        "torch", 0, advantage, demo == ["demo"]
    )  # the 1-rank reference (ZeRO at 1 rank equals it: test_deepspeed)
    two = two_ranks[setting]
    for k, (a, b) in enumerate(zip(one, two, strict=True)):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6), f"update {k}: 1 rank {a} vs 2 ranks {b} ({setting})"


def test_a_finished_rank_exits_0_with_what_it_printed_and_logged(tmp_path: Path) -> None:
    """``exit_finished_rank`` skips the interpreter's shutdown, so it flushes itself what the rank
    printed (stdout into a pipe is block-buffered) and logged, and nothing after it runs."""
    program = (
        "import logging, sys\n"
        "import torch.distributed as dist\n"
        "from ragen_tasks.training.distributed import exit_finished_rank\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
        f"dist.init_process_group('gloo', store=dist.FileStore({str(tmp_path / 'store')!r}, 1), rank=0, world_size=1)\n"
        "print('printed')\n"
        "logging.getLogger('rank').info('logged')\n"
        "exit_finished_rank()\n"
        "print('after the exit')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONUNBUFFERED", None)
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "printed\n"
    assert "logged" in done.stderr

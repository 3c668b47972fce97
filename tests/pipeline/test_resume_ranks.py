"""Multi-rank checkpoints on the production path: the training flow with every update on 2 ranks
(torchrun, gloo). With DeepSpeed ZeRO-2 each rank writes its own optimizer part: a rank SIGKILLed
right after writing its part of checkpoint 2 leaves checkpoint 1 the newest committed, and the rerun
resumes to exactly the weights and optimizer parts of an uninterrupted run. A checkpoint written by
2 ranks (torch backend: the optimizer state is whole) resumes on 1 rank, whose update matches what
the 2 ranks did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ragen_tasks.training import checkpoint as ckpt

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("resume_harness.py")
N = 3
ZERO2 = ["--set", "optim.backend=deepspeed", "--set", "optim.zero_stage=2", "--set", "update.world_size=2"]
TORCH2 = ["--set", "update.world_size=2"]


def _train(
    store: Path, run_id: str, iterations: int, *extra: str, kill: str | None = None
) -> subprocess.CompletedProcess[str]:
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{Path(__file__).with_name('rank_hooks')}",
    }
    env.pop("RAGEN_TEST_KILL_IN_SAVE", None)
    if kill is not None:
        env["RAGEN_TEST_KILL_IN_SAVE"] = kill
    command = [sys.executable, str(HARNESS), "--store", str(store), "--run-id", run_id, "--iterations", str(iterations)]
    return subprocess.run([*command, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {**load_file(str(folder / "model.safetensors")), **load_file(str(folder / "critic.safetensors"))}


def _history(store: Path, run_id: str) -> list[dict[str, float]]:
    from ragen_tasks import pipeline

    return pipeline.history(pipeline.open_existing_run(str(store / run_id)))


def test_rank_killed_in_checkpoint_write_resumes_exactly(tmp_path: Path) -> None:
    straight = _train(tmp_path, "straight", N, *ZERO2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    final = ckpt.step_dir(tmp_path / "straight" / "checkpoints", N)
    marker = ckpt.verify_checkpoint(final)
    assert marker["world_size"] == 2 and marker["optimizer_parts"] == {"actor": 2, "critic": 2}

    died = _train(tmp_path, "killed", N, *ZERO2, kill="2:1")
    assert died.returncode != 0, died.stdout[-2000:]
    latest = ckpt.latest_checkpoint(tmp_path / "killed" / "checkpoints")
    assert latest is not None and latest.step == 1, "the half-written step 2 must not be committed"
    resumed = _train(tmp_path, "killed", N, *ZERO2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = ckpt.step_dir(tmp_path / "killed" / "checkpoints", N)
    a, b = _weights(final), _weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("actor", "critic"):
        for rank in range(2):
            part = f"optim_{name}.rank{rank:03d}-of-002.pt"
            x, y = (torch.load(f / part, weights_only=True) for f in (final, again))
            for i in x["state"]:
                for k, v in x["state"][i].items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(y["state"][i][k])), (part, i, k)


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path: Path) -> None:
    straight = _train(tmp_path, "two", N, *TORCH2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = _train(tmp_path, "then-one", N - 1, *TORCH2)
    assert first.returncode == 0, first.stderr[-3000:]
    marker = json.loads((ckpt.step_dir(tmp_path / "then-one" / "checkpoints", N - 1) / ckpt.MARKER).read_text())
    assert marker["world_size"] == 2 and marker["optimizer_parts"] == {"actor": 1, "critic": 1}
    resumed = _train(tmp_path, "then-one", N, *TORCH2, "--resume-set", "update.world_size=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    two, one = _history(tmp_path, "two")[-1], _history(tmp_path, "then-one")[-1]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert one[key] == pytest.approx(two[key], rel=1e-3, abs=1e-6), key

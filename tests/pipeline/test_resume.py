"""Resume equivalence of the production path with real SIGKILLs: the training flow run N iterations
straight == run, killed, re-run with the same run id (bitwise: weights, critic, Adam moments, the
shuffling RNG, and the run's metric history); a kill in the middle of a checkpoint save leaves the
previous checkpoint loadable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ragen_tasks.training import checkpoint as ckpt

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("resume_harness.py")
N = 3


def _command(store: Path, run_id: str, *extra: str) -> tuple[list[str], dict[str, str]]:
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),  # the test server: a killed run leaves no server behind
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, str(HARNESS), "--store", str(store), "--run-id", run_id, "--iterations", str(N)]
    return [*command, *extra], env


def _train(store: Path, run_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command, env = _command(store, run_id, *extra)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _kill_when(store: Path, run_id: str, relative: str) -> int:
    """Start the run and SIGKILL it from outside as soon as ``relative`` (a path in the run folder)
    exists, as the audit did: the moment is wherever the run happens to be, not a hook in the code."""
    command, env = _command(store, run_id)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        if (store / run_id / relative).exists():
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    return process.wait(timeout=60)


def _checkpoints(store: Path, run_id: str) -> Path:
    return store / run_id / "checkpoints"


def _state(path: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], dict[str, Any]]:
    from safetensors.torch import load_file

    weights = {**load_file(str(path / "model.safetensors")), **load_file(str(path / "critic.safetensors"))}
    opts = [torch.load(path / f"optim_{n}.pt", weights_only=True) for n in ("actor", "critic")]
    extra = torch.load(path / "extra_state.pt", weights_only=True)
    return weights, opts, {**extra, "rng": torch.load(path / "rng.pt", weights_only=True)}


def _history(store: Path, run_id: str) -> str:
    """The run's committed metric rows without wall-clock measurements, as canonical JSON (NaN-safe)."""
    from ragen_tasks import pipeline

    rows = pipeline.history(pipeline.open_existing_run(str(store / run_id)))
    timeless = [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]
    return json.dumps(timeless, sort_keys=True)


def _audit(store: Path, run_id: str) -> None:
    """The outside audit's checks on a finished run: contiguous committed iterations, every checkpoint
    folder committed and intact (no temp or half-written one left), and in every stage folder exactly
    the data objects its manifests name (no orphan, no duplicate, nothing missing)."""
    from ragen_tasks.data.manifest import Manifest

    run_dir = store / run_id
    committed = sorted(p.parent.parent.name for p in run_dir.glob("iter_*/summary/summary.manifest.json"))
    assert committed == [f"iter_{k:06d}" for k in range(N)], committed
    for folder in (run_dir / "checkpoints").iterdir():
        assert not folder.name.startswith("."), folder
        ckpt.verify_checkpoint(folder)
    for stage_dir in run_dir.glob("iter_*/*"):
        named: set[str] = set()
        for m in stage_dir.glob("*.manifest.json"):
            named |= {o.name for o in Manifest.from_json_bytes(m.read_bytes(), where=str(m)).objects}
        data = {p.name for p in stage_dir.iterdir() if not p.name.endswith(".manifest.json")}
        assert data == named, (stage_dir, sorted(data ^ named))


def _assert_same(a: Any, b: Any) -> None:
    wa, oa, ea = a
    wb, ob, eb = b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for x, y in zip(oa, ob, strict=True):
        assert x["state"].keys() == y["state"].keys()
        for i in x["state"]:
            for k, v in x["state"][i].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(y["state"][i][k])), (i, k)
    assert torch.equal(ea["generator"], eb["generator"])
    # rng.pt: the global RNGs are seeded from the run, so identical runs record identical states
    assert torch.equal(ea["rng"]["torch"], eb["rng"]["torch"])
    assert torch.equal(ea["rng"]["numpy"][1], eb["rng"]["numpy"][1]) and ea["rng"]["python"] == eb["rng"]["python"]


def test_kill_and_resume_is_bitwise_identical(tmp_path: Path) -> None:
    straight = _train(tmp_path, "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = _state(ckpt.step_dir(_checkpoints(tmp_path, "straight"), N))

    killed = _train(tmp_path, "killed", "--kill-after", "1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert ckpt.latest_checkpoint(_checkpoints(tmp_path, "killed")).step == 1  # type: ignore[union-attr]
    resumed = _train(tmp_path, "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same(reference, _state(ckpt.step_dir(_checkpoints(tmp_path, "killed"), N)))
    # Killed after checkpoint 1 committed but before iteration 0's update metrics: the history is exact too.
    straight_history = _history(tmp_path, "straight")
    assert '"actor/pg_loss"' in straight_history or '"actor/' in straight_history
    assert _history(tmp_path, "killed") == straight_history
    _audit(tmp_path, "straight")
    _audit(tmp_path, "killed")

    # Kill points chosen by polling the store: inside iteration 1 (its rollouts committed), and inside
    # the update right after checkpoint 2's folder appears (its files may still be being written).
    for run_id, relative in (
        ("polled-rollout", "iter_000001/rollouts/trajectories.manifest.json"),
        ("polled-update", "checkpoints/step_000002"),
    ):
        assert _kill_when(tmp_path, run_id, relative) == -signal.SIGKILL, run_id
        resumed = _train(tmp_path, run_id)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        _assert_same(reference, _state(ckpt.step_dir(_checkpoints(tmp_path, run_id), N)))
        assert _history(tmp_path, run_id) == straight_history
        _audit(tmp_path, run_id)

    for point in ("write", "commit"):
        run_id = f"in-save-{point}"
        died = _train(tmp_path, run_id, "--kill-in-save", f"2:{point}")
        assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
        latest = ckpt.latest_checkpoint(_checkpoints(tmp_path, run_id))
        assert latest is not None and latest.step == 1  # the half-written step 2 is not committed
        ckpt.verify_checkpoint(latest.path)
        if point == "commit":
            with pytest.raises(ckpt.CheckpointError, match="not committed"):
                ckpt.verify_checkpoint(ckpt.step_dir(_checkpoints(tmp_path, run_id), 2))
        resumed = _train(tmp_path, run_id)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        _assert_same(reference, _state(ckpt.step_dir(_checkpoints(tmp_path, run_id), N)))
        assert _history(tmp_path, run_id) == straight_history
        _audit(tmp_path, run_id)

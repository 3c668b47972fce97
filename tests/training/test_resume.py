"""Resume equivalence with real SIGKILLs: N iterations straight == k, kill, resume to N (bitwise),
and a kill in the middle of a checkpoint save leaves the previous checkpoint loadable."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from ragen_tasks.training import checkpoint as ckpt

N = 3


def _harness(root, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ragen_tasks.training.resume_harness",
            "--root",
            str(root),
            "--iterations",
            str(N),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _state(path):
    from safetensors.torch import load_file

    weights = {**load_file(str(path / "model.safetensors")), **load_file(str(path / "critic.safetensors"))}
    opts = [torch.load(path / f"optim_{n}.pt", weights_only=True) for n in ("actor", "critic")]
    return weights, opts, torch.load(path / "extra_state.pt", weights_only=True)


def _assert_same(a, b):
    wa, oa, ea = a
    wb, ob, eb = b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for x, y in zip(oa, ob, strict=True):
        assert x["state"].keys() == y["state"].keys()
        for i in x["state"]:
            for k, v in x["state"][i].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(y["state"][i][k])), (i, k)
    assert torch.equal(ea["generator"], eb["generator"])


@pytest.mark.slow
def test_kill_and_resume_is_bitwise_identical(tmp_path):
    straight = _harness(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    reference = _state(ckpt.step_dir(tmp_path / "straight", N))

    killed = _harness(tmp_path / "killed", "--kill-after", "1")
    assert killed.returncode == -signal.SIGKILL
    assert ckpt.latest_checkpoint(tmp_path / "killed").step == 1
    resumed = _harness(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _assert_same(reference, _state(ckpt.step_dir(tmp_path / "killed", N)))

    for point in ("write", "commit"):
        root = tmp_path / f"in_save_{point}"
        died = _harness(root, "--kill-in-save", f"2:{point}")
        assert died.returncode == -signal.SIGKILL
        latest = ckpt.latest_checkpoint(root)
        assert latest is not None and latest.step == 1  # the half-written step 2 is not committed
        ckpt.verify_checkpoint(latest.path)
        if point == "commit":
            with pytest.raises(ckpt.CheckpointError, match="not committed"):
                ckpt.verify_checkpoint(ckpt.step_dir(root, 2))
        resumed = _harness(root)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        _assert_same(reference, _state(ckpt.step_dir(root, N)))

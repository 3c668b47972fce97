"""The training flow end to end on the tiny preset, under a real Prefect API.

Checks: a 2-iteration run commits manifests, checkpoints, eval metrics and artifacts; re-running
with the same run id resumes (no stage runs twice); a crash injected mid-iteration followed by a
re-run leaves no duplicate batch and the right number of iterations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ragen_tasks import pipeline
from ragen_tasks.training import checkpoint as ckpt
from tests.conftest import TINY_RUN

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]


def _train(tmp_path: Path, run_id: str, iterations: int, preset: str = "bandit-tiny", **extra: Any) -> dict[str, Any]:
    from flows.train import train

    overrides = {**TINY_RUN, "iterations": iterations, **extra}
    return train(preset=preset, overrides=overrides, run_id=run_id, store_root=str(tmp_path / "runs"))


def _artifact_keys() -> set[str]:
    import asyncio

    from prefect.client.orchestration import get_client

    async def keys() -> set[str]:
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts() if a.key}

    return asyncio.run(keys())


MIXTURE = {"envs": [{"name": "bandit"}, {"name": "frozen_lake"}]}  # two games in one run


def test_two_iterations_then_resume(tmp_path: Path) -> None:
    summary = _train(tmp_path, "flow-test", 2, preset="default", **MIXTURE)
    run_dir = tmp_path / "runs" / "flow-test"
    # Every stage of both iterations committed its manifest.
    for it in range(2):
        for stage, name in (
            ("tasks", "tasks"),
            ("rollouts", "trajectories"),
            ("batch", "trajectories"),
            ("update", "metrics"),
            ("eval", "eval"),
            ("summary", "summary"),
        ):
            assert (run_dir / f"iter_{it:06d}" / stage / f"{name}.manifest.json").exists(), (it, stage, name)
    # Checkpoints 0 (warm start), 1, 2 are committed (keep_last=2 keeps the newest two).
    steps = [c.step for c in ckpt.committed_checkpoints(run_dir / "checkpoints")]
    assert steps[-1] == 2
    # summary.json holds before/after-RL eval per env and the report exists.
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["iterations"] == 2
    assert set(on_disk["eval_before_rl"]) == set(on_disk["eval_after_rl"]) == {"bandit", "frozen_lake"}
    assert Path(summary["report"]).exists()
    assert "bandit_high_ev_choice_rate" in on_disk["warm_start"]
    for env, paired in on_disk["rl_gain_paired"].items():  # the same held-out seeds before and after RL
        before, after = on_disk["eval_before_rl"][env], on_disk["eval_after_rl"][env]
        assert paired["seeds"] == before["episodes"] == after["episodes"]
        assert paired["gains"] - paired["losses"] == round((after["success"] - before["success"]) * paired["seeds"])
        assert 0 < paired["p"] <= 1
    assert set(on_disk["rl_gain_paired"]) == {"bandit", "frozen_lake"}
    keys = _artifact_keys()
    assert {"flow-test-metrics", "flow-test-progress", "flow-test-warm-start", "flow-test-summary"} <= keys

    # Resume to 3 iterations: only iteration 2 runs; earlier manifests are untouched.
    before = (run_dir / "iter_000000" / "rollouts" / "trajectories.manifest.json").stat().st_mtime_ns
    _train(tmp_path, "flow-test", 3, preset="default", **MIXTURE)
    after = (run_dir / "iter_000000" / "rollouts" / "trajectories.manifest.json").stat().st_mtime_ns
    assert before == after
    run = pipeline.open_existing_run(str(run_dir))
    assert [row["iteration"] for row in pipeline.history(run)] == [0, 1, 2]
    assert ckpt.latest_checkpoint(run_dir / "checkpoints").step == 3  # type: ignore[union-attr]


def test_crash_mid_iteration_then_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_update = pipeline.update

    def crash_in_iteration_1(run: pipeline.Run, iteration: int, *handoff: Any) -> dict[str, Any]:
        if iteration == 1:
            raise RuntimeError("injected crash in update")
        return real_update(run, iteration, *handoff)

    monkeypatch.setattr(pipeline, "update", crash_in_iteration_1)  # every attempt (and the retry) fails
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "crash-test", 2)
    run_dir = tmp_path / "runs" / "crash-test"
    assert (run_dir / "iter_000001" / "batch" / "trajectories.manifest.json").exists()
    assert not (run_dir / "iter_000001" / "summary" / "summary.manifest.json").exists()

    monkeypatch.setattr(pipeline, "update", real_update)
    _train(tmp_path, "crash-test", 2)
    run = pipeline.open_existing_run(str(run_dir))
    assert [row["iteration"] for row in pipeline.history(run)] == [0, 1]
    # Exactly one data object per committed stage: nothing was written twice.
    for stage in ("rollouts", "batch"):
        parquet = sorted(p.name for p in (run_dir / "iter_000001" / stage).glob("*.parquet"))
        assert len(parquet) == 1, parquet


def test_in_memory_trainer_handoff_equals_reloading_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process updates take the trainer the previous update saved from memory; the run must be
    bitwise the run that rebuilds it from the checkpoint files every iteration."""
    from safetensors.torch import load_file

    def final_state(run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        path = ckpt.step_dir(tmp_path / "runs" / run_id / "checkpoints", 3)
        return load_file(str(path / "model.safetensors")), torch.load(path / "optim_actor.pt", weights_only=True)

    _train(tmp_path, "handoff", 3)
    monkeypatch.setattr(pipeline.TrainerHandoff, "keep", lambda self, run, trainer, step: None)  # every update reloads
    _train(tmp_path, "reload", 3)
    (weights_a, optim_a), (weights_b, optim_b) = final_state("handoff"), final_state("reload")
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    for i, state in optim_a["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(optim_b["state"][i][k])) for k, v in state.items())

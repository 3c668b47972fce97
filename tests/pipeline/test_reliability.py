"""Runs that can always continue, through the public stage functions on a real tiny model (no
Prefect): a diverging update is never committed and the run continues under the same id with a
recorded lower learning rate; checkpoint 0 is never rebuilt once pruned; the run's lineage is the
authority for fingerprints; a moved run folder resumes; identical runs write identical checkpoints;
keep_last counts the guard's protected checkpoints."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from ragen_tasks import pipeline
from ragen_tasks.config import ConfigError
from ragen_tasks.presets import load_config
from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.training.update import DivergedUpdateError
from tests.pipeline.resume_harness import RESUME_RUN


def _open(root: Path, run_id: str, **extra: Any) -> pipeline.Run:
    config = load_config("bandit-tiny", {**RESUME_RUN, "iterations": 3, "store.root": str(root), **extra})
    return pipeline.open_run(config, run_id)


def _iteration(run: pipeline.Run, k: int) -> dict[str, Any]:
    """Iteration ``k`` through the stage functions, committed like the flow commits it."""
    generated = pipeline.generate_tasks(pipeline.run_in_force(run, k), k)
    rolled = pipeline.rollout(pipeline.run_in_force(run, k), k)
    batch = pipeline.filter_and_validate(pipeline.run_in_force(run, k), k)
    updated = pipeline.update(pipeline.run_for_iteration(run.uri, k), k)
    row = pipeline.iteration_row(run, k, generated=generated, rolled=rolled, batch=batch, updated=updated)
    return pipeline.record_iteration(run, k, row)


DIVERGING = {"optim.lr": 1e10, "optim.critic_lr": 1e10, "optim.ppo_epochs": 1}


def _diverge(root: Path, run_id: str, **extra: Any) -> tuple[pipeline.Run, str]:
    """Iteration 0 of a run whose update diverges, up to the update's error: (the run, its message)."""
    run = _open(root, run_id, **DIVERGING, **extra)
    pipeline.init_run(run)
    for stage in (pipeline.generate_tasks, pipeline.rollout, pipeline.filter_and_validate):
        stage(run, 0)
    with pytest.raises(DivergedUpdateError) as err:
        pipeline.update(pipeline.run_for_iteration(run.uri, 0), 0)
    return run, str(err.value)


def test_a_diverging_update_is_never_committed_and_the_run_continues_with_a_recorded_lower_lr(tmp_path: Path) -> None:
    # Without a warm start every reward is the format penalty: only the critic gets a gradient. Two
    # optimizer steps: a finite one that blows the weights up, then one skipped (non-finite norm).
    run, message = _diverge(tmp_path, "diverge")
    assert (
        "1 of 2 optimizer steps skipped" in message
        and "optim.max_weight_abs" in message
        and "step 1 was NOT committed" in message
    )
    assert "critic weight" in message and "--run-id diverge --resume-set optim.critic_lr=" in message
    assert [c.step for c in ckpt.committed_checkpoints(run.checkpoint_root)] == [0]

    # Changing the LR with a plain --set is refused (another experiment), naming the explicit way.
    with pytest.raises(ConfigError, match=r"optim\.critic_lr.*--resume-set optim\.critic_lr=1e-05"):
        pipeline.init_run(_open(tmp_path, "diverge", **{**DIVERGING, "optim.critic_lr": 1e-5}))
    with pytest.raises(ConfigError, match="only these settings may change"):
        pipeline.init_run(_open(tmp_path, "diverge", **DIVERGING), resume_set={"algo.clip_low": 0.1})
    # The explicit, recorded override: the same run id continues from checkpoint 0 with lower LRs.
    lower = {"optim.lr": 1e-5, "optim.critic_lr": 1e-5}
    resumed = _open(tmp_path, "diverge", **DIVERGING)
    assert pipeline.init_run(resumed, resume_set=lower)["start_iteration"] == 0
    assert pipeline.recorded_changes(run.store, "diverge") == [
        {"set": lower, "previous": {"optim.lr": 1e10, "optim.critic_lr": 1e10}, "from_iteration": 0}
    ]
    assert pipeline.open_existing_run(run.uri).config.optim.critic_lr == 1e-5
    row = _iteration(resumed, 0)
    assert row["policy/next_step"] == 1 and row["actor/skipped_steps"] == 0
    # Resuming again needs no flag: the recorded change stays in force.
    assert pipeline.init_run(_open(tmp_path, "diverge", **DIVERGING))["start_iteration"] == 1


def test_a_diverging_update_on_two_ranks_fails_as_on_one(tmp_path: Path) -> None:
    """The ranks' error reaches the stage as the same type and message (final for the flow's retries);
    nothing is committed by any rank."""
    run, message = _diverge(tmp_path, "diverge-ranks", **{"update.world_size": 2})
    assert "1 of 2 optimizer steps skipped" in message and "step 1 was NOT committed" in message, message
    assert "critic weight" in message and "--run-id diverge-ranks --resume-set optim.critic_lr=" in message
    assert [c.step for c in ckpt.committed_checkpoints(run.checkpoint_root)] == [0]
    assert not list(run.checkpoint_root.glob(".tmp-*")) and not (run.checkpoint_root / "step_000001").exists()


def test_checkpoint_0_pruned_is_never_rebuilt_on_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _open(tmp_path, "pruned", **{"checkpoint.keep_last": 1})
    pipeline.init_run(run)
    _iteration(run, 0)
    ckpt.prune(run.checkpoint_root, keep_last=1)  # what the next save does once step 0 is no longer in use
    assert [c.step for c in ckpt.committed_checkpoints(run.checkpoint_root)] == [1]

    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("checkpoint 0 (the warm start) was rebuilt on resume")

    from ragen_tasks.pipeline import stages

    monkeypatch.setattr(stages, "warm_started_policy", must_not_run)
    monkeypatch.setattr(stages, "build_trainer", must_not_run)
    assert pipeline.init_run(_open(tmp_path, "pruned", **{"checkpoint.keep_last": 1}))["start_iteration"] == 1
    assert not ckpt.step_dir(run.checkpoint_root, 0).exists()


def _resign(path: Path) -> None:
    """Replace a checkpoint's weights and re-sign its marker, as anyone who can write the store can."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / ckpt.WEIGHTS))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1.0
    save_file(weights, str(path / ckpt.WEIGHTS), metadata={"format": "pt"})
    marker = json.loads((path / ckpt.MARKER).read_text())
    marker["files"][ckpt.WEIGHTS] = ckpt.sha256_file(path / ckpt.WEIGHTS)
    marker["fingerprint"] = marker["files"][ckpt.WEIGHTS]
    (path / ckpt.MARKER).write_text(json.dumps(marker))


def test_a_resigned_checkpoint_is_refused_against_the_lineage(tmp_path: Path) -> None:
    run = _open(tmp_path, "resigned")
    pipeline.init_run(run)
    _iteration(run, 0)
    for step in (0, 1):
        _resign(ckpt.step_dir(run.checkpoint_root, step))
        ckpt.verify_checkpoint(ckpt.step_dir(run.checkpoint_root, step))  # its own marker is consistent
        with pytest.raises(ckpt.CheckpointError, match=f"run recorded .* for step {step} when it was committed"):
            pipeline.fingerprint(run, step)
    pipeline.generate_tasks(run, 1)
    with pytest.raises(ckpt.CheckpointError, match="replaced after commit"):
        pipeline.rollout(pipeline.run_in_force(run, 1), 1)  # samples with step 1
    with pytest.raises(ckpt.CheckpointError, match="replaced after commit"):
        pipeline.load_trainer(run, 1)
    with pytest.raises(ckpt.CheckpointError, match="replaced after commit"):
        pipeline.evaluate_step(run, 0)


def test_a_moved_run_folder_resumes(tmp_path: Path) -> None:
    run = _open(tmp_path / "a", "moved")
    pipeline.init_run(run)
    _iteration(run, 0)
    shutil.copytree(tmp_path / "a" / "moved", tmp_path / "b" / "moved")
    moved = _open(tmp_path / "b", "moved")
    assert pipeline.init_run(moved)["start_iteration"] == 1
    assert _iteration(moved, 1)["policy/next_step"] == 2


def test_identical_runs_write_identical_checkpoint_files(tmp_path: Path) -> None:
    first, second = _open(tmp_path, "one"), _open(tmp_path, "two")
    torch.rand(3)  # whatever the process drew before must not show in a checkpoint
    pipeline.init_run(first)
    torch.rand(5)
    pipeline.init_run(second)
    for name in ("model.safetensors", "rng.pt", "extra_state.pt"):
        a = (ckpt.step_dir(first.checkpoint_root, 0) / name).read_bytes()
        b = (ckpt.step_dir(second.checkpoint_root, 0) / name).read_bytes()
        assert a == b, name
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.step_dir(first.checkpoint_root, 0).iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_keep_last_counts_the_protected_checkpoints() -> None:
    steps = [0, 1, 2, 3, 4, 5]
    assert ckpt.steps_to_prune(steps, keep_last=2, protect={4}) == [0, 1, 2, 3]
    assert ckpt.steps_to_prune(steps, keep_last=2, protect={1}) == [0, 2, 3, 4]  # newest + the protected one
    assert ckpt.steps_to_prune(steps, keep_last=3, protect={1}) == [0, 2, 3]
    assert ckpt.steps_to_prune(steps, keep_last=2, protect={1, 2}) == [0, 3, 4]  # protection wins over the count


def test_a_warn_guard_protects_no_rollback_targets(tmp_path: Path) -> None:
    run = _open(tmp_path, "warn", **{"guard.action": "warn"})
    pipeline.init_run(run)
    _iteration(run, 0)
    _iteration(run, 1)
    assert pipeline.run_in_force(run, 2).protect_steps == {2}  # only the step iteration 2 samples with
    stopping = _open(tmp_path, "warn", **{"guard.action": "stop"})
    assert pipeline.run_in_force(stopping, 2).protect_steps > {2}


def test_config_differences_names_leaf_keys_and_skips_free_ones() -> None:
    """Leaf keys with both values, sorted; a free key frees everything under it, not its namesakes."""
    made = load_config("bandit-tiny", []).model_dump(mode="json")
    asked = load_config("bandit-tiny", ["optim.lr=0.5", "store.root=/elsewhere", "seed=3"]).model_dump(mode="json")
    assert pipeline.config_differences(made, asked, free=("store",)) == [
        ("optim.lr", made["optim"]["lr"], 0.5),
        ("seed", made["seed"], 3),
    ]
    assert ("store.root", made["store"]["root"], "/elsewhere") in pipeline.config_differences(made, asked)
    assert pipeline.config_differences(made, asked, free=("sto", "optim.lr", "seed")) == [
        ("store.root", made["store"]["root"], "/elsewhere")
    ]


def test_a_resume_may_change_the_store_options_but_not_the_settings() -> None:
    """The store may move or change its options on resume (``store.storage_options`` is free as a whole,
    nested keys included); anything else is refused, naming at most five keys and how many more."""
    from ragen_tasks.pipeline.run import check_same_config

    made = load_config("bandit-tiny", ['store.storage_options={"anon": false}']).model_dump(mode="json")
    moved = load_config("bandit-tiny", ["store.root=/elsewhere"]).model_dump(mode="json")
    check_same_config(made, moved, "runs/r")
    changed = load_config(
        "bandit-tiny",
        [f"{key}=0.5" for key in ("optim.lr", "optim.critic_lr", "algo.clip_low", "algo.clip_high")]
        + ["seed=7", "algo.kl_coef=0.5"],
    ).model_dump(mode="json")
    with pytest.raises(ConfigError, match=r"optim\.lr \(.* in the run, 0\.5 now\).* and 1 more"):
        check_same_config(made, changed, "runs/r")

"""The Echo-Trap guard through the real training flow (Prefect test harness, tiny model, CPU).

Both tests run the ``collapse-grpo`` preset at TINY_RUN size. A real collapse needs the full warm
start and minutes of CPU (bench/echo_trap.py), too slow and too seed-dependent for
CI, so the detector is FORCED here through ``guard.rules``: one rule (``format_error_rise``) is
pointed at the ``iteration`` counter with every other rule off. With ``warmup: 2`` its early level
is the mean of the first two iterations since the start (or the last rollback), so it fires exactly
at the third one, on every machine. Everything else is real: rollouts, updates, checkpoints, the
guard's decision, the rollback stage and the stop path.

Checks:
* ``stop``: the run ends cleanly at the firing iteration; ``summary["stopped"]`` names the last
  healthy checkpoint, which is committed and loadable;
* ``rollback``: the rollback checkpoint holds the EXACT weights (and Adam state) of the named
  healthy checkpoint, the next iteration samples from it and its update uses the halved learning
  rate; after ``max_rollbacks`` (1) the next firing stops the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ragen_tasks import pipeline
from ragen_tasks.training import checkpoint as ckpt
from tests.conftest import TINY_RUN

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]

LR = 2.0e-3  # the collapse-grpo preset's learning rate (asserted below, so a preset change shows up here)

# Fires exactly at the 3rd iteration since the start / the last rollback (see the module docstring).
FORCED_RULES: dict[str, Any] = {
    "warmup": 2,
    "format_error_metric": "iteration",
    "format_error_rise": 0.5,
    "format_error_patience": 1,
    "std_collapse_fraction": None,
    "grad_norm_spike_factor": None,
    "entropy_collapse_fraction": None,
    "entropy_jump_factor": None,
    "think_collapse_fraction": None,
}


def _train(tmp_path: Path, run_id: str, iterations: int, **extra: Any) -> dict[str, Any]:
    from flows.train import train

    overrides = {
        **TINY_RUN,
        "agent.max_turns": 1,
        # Enough warm start that answers parse (TINY_RUN's 4 steps leave every answer a format
        # error: zero advantages, no update, nothing for a rollback to undo).
        "warm_start.steps": 40,
        "warm_start.batch_size": 16,
        "warm_start.episodes_per_env": 64,
        "checkpoint.keep_last": 20,
        "iterations": iterations,
        "optim.lr": LR,
        "guard.rules": FORCED_RULES,
        **extra,
    }
    return train(preset="collapse-grpo", overrides=overrides, run_id=run_id, store_root=str(tmp_path / "runs"))


def _rows(tmp_path: Path, run_id: str) -> list[dict[str, Any]]:
    return pipeline.history(pipeline.open_existing_run(str(tmp_path / "runs" / run_id)))


def _step(tmp_path: Path, run_id: str, step: int) -> Path:
    return ckpt.step_dir(tmp_path / "runs" / run_id / "checkpoints", step)


def _actor_lr(path: Path) -> float:
    state = torch.load(path / "optim_actor.pt", weights_only=True)
    return float(state["param_groups"][0]["lr"])


def test_stop_ends_cleanly_naming_the_last_healthy_checkpoint(tmp_path: Path) -> None:
    summary = _train(tmp_path, "guard-stop", 6, **{"guard.action": "stop"})
    rows = _rows(tmp_path, "guard-stop")
    assert [row["iteration"] for row in rows] == [0, 1, 2]  # stopped at the firing iteration, not 6
    assert [row["guard/action"] for row in rows] == ["none", "none", "stop"]
    assert [s["rule"] for s in rows[2]["guard/signals"]] == ["format_error_rise"]
    stopped = summary["stopped"]
    assert stopped["iteration"] == 2
    assert stopped["last_healthy_step"] == rows[1]["policy/step"] == 1  # newest step whose iteration was clean
    assert Path(stopped["last_healthy_checkpoint"]) == _step(tmp_path, "guard-stop", 1)
    ckpt.verify_checkpoint(Path(stopped["last_healthy_checkpoint"]))  # committed, hashes match
    assert "guard.action=stop" in stopped["reason"]
    assert stopped["collapsed_step"] == rows[2]["policy/next_step"]  # what the firing update produced
    on_disk = json.loads((tmp_path / "runs" / "guard-stop" / "summary.json").read_text())
    assert on_disk["stopped"] == stopped and on_disk["iterations"] == 3
    # The run hands on (and evaluates) its last healthy checkpoint, not the collapsed one.
    assert Path(summary["final_checkpoint"]) == _step(tmp_path, "guard-stop", 1)
    assert "bandit" in summary["eval_after_rl"]
    assert Path(summary["report"]).read_text().count("format_error_rise") >= 1  # the report lists the signal


def test_rollback_restores_exact_weights_then_mitigates_and_is_bounded(tmp_path: Path) -> None:
    run_id = "guard-rollback"
    summary = _train(
        tmp_path, run_id, 8, **{"guard.action": "rollback", "guard.max_rollbacks": 1, "guard.mitigation": "lower_lr"}
    )
    rows = _rows(tmp_path, run_id)
    assert [row["guard/action"] for row in rows] == ["none", "none", "rollback", "none", "none", "stop"]

    # Iteration 2 fired: roll back to the newest clean step (1) as a new checkpoint.
    rolled = rows[2]
    record, _ = pipeline.open_existing_run(str(tmp_path / "runs" / run_id)).store.read_json(
        run_id, 2, "update", "rollback"
    )
    assert (
        record["to_step"] == 1 and record["new_step"] == rolled["policy/next_step"] == 4
    )  # step 3 = iteration 2's update
    healthy, restored, collapsed = (_step(tmp_path, run_id, s) for s in (1, 4, 3))
    want, got, moved = (load_file(str(p / ckpt.WEIGHTS)) for p in (healthy, restored, collapsed))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)  # the EXACT weights of the named checkpoint
    assert not all(torch.equal(want[k], moved[k]) for k in want)  # (the updates in between did move them)
    assert ckpt.verify_checkpoint(healthy)["fingerprint"] == ckpt.verify_checkpoint(restored)["fingerprint"]
    adam_want = torch.load(healthy / "optim_actor.pt", weights_only=True)["state"]
    adam_got = torch.load(restored / "optim_actor.pt", weights_only=True)["state"]
    assert all(torch.equal(adam_want[i]["exp_avg"], adam_got[i]["exp_avg"]) for i in adam_want)

    # Iteration 3 samples the restored policy and updates it with the mitigation: LR halved.
    assert rolled["guard/overrides"] == {"optim.lr": LR / 2} and rolled["guard/rollbacks"] == 1
    assert rows[3]["policy/step"] == 4 and rows[3]["policy/next_step"] == 5
    assert _actor_lr(collapsed) == pytest.approx(LR)  # before the rollback
    assert _actor_lr(_step(tmp_path, run_id, 5)) == pytest.approx(LR / 2)  # the first update after it

    # The detector restarts after a rollback and fires again at its 3rd iteration (5): max_rollbacks=1
    # is spent, so the guard stops, naming the newest clean step since the rollback.
    stopped = summary["stopped"]
    assert stopped["iteration"] == 5 and "rollback limit 1 reached" in stopped["reason"]
    assert stopped["last_healthy_step"] == rows[4]["policy/step"] == 5
    assert rows[-1]["guard/rollbacks"] == 1

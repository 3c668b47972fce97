"""The trainer's lifecycle as library calls (no Prefect): the warm-start cache; the learning rate
each update steps at."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ragen_tasks import pipeline
from ragen_tasks.config import OptimConfig
from ragen_tasks.models.presets import ensure_preset
from ragen_tasks.presets import load_config
from tests.conftest import TINY_RUN


def _run(tmp_path: Path, run_id: str, **extra: object) -> pipeline.Run:
    config = load_config("bandit-tiny", {**TINY_RUN, "store.root": str(tmp_path / "runs"), **extra})
    return pipeline.open_run(config, run_id)


def test_a_second_run_with_the_same_warm_start_inputs_starts_from_the_cached_one(tmp_path: Path) -> None:
    rl_knobs = {"optim.lr": 5e-4, "agent.loss_on_reasoning": False, "algo.demo_loss_coef": 0.5}
    first, second = _run(tmp_path, "first"), _run(tmp_path, "second", iterations=7, **rl_knobs)
    assert pipeline.warm_start_key(first.config) == pipeline.warm_start_key(second.config)  # RL knobs differ only
    made = pipeline.init_run(first)["warm_start"]
    reused = pipeline.init_run(second)["warm_start"]
    assert (made["cache"], reused["cache"]) == ("miss", "hit")
    assert made["cache_run"] == reused["cache_run"] and (tmp_path / "runs" / made["cache_run"]).is_dir()
    assert {k: v for k, v in made.items() if k != "cache"} == {k: v for k, v in reused.items() if k != "cache"}
    assert pipeline.fingerprint(first, 0) == pipeline.fingerprint(second, 0)  # the same warm-started weights
    cached = tmp_path / "runs" / made["cache_run"] / "checkpoints" / "step_000000"
    owner = pipeline.run_of_checkpoint(cached)  # `ragen evaluate` finds the config the warm start was made for
    assert owner is not None and owner.config.envs == first.config.envs


def test_a_changed_warm_start_input_is_a_new_cache_entry(tmp_path: Path) -> None:
    base = _run(tmp_path, "base")
    for key, value in (("warm_start.steps", 5), ("seed", 1), ("agent.max_actions_per_turn", 2)):
        changed = _run(tmp_path, "changed", **{key: value})
        assert pipeline.warm_start_key(changed.config) != pipeline.warm_start_key(base.config), key
    pipeline.init_run(base)
    other = _run(tmp_path, "other", **{"warm_start.steps": 5})
    assert pipeline.init_run(other)["warm_start"]["cache"] == "miss"


def test_a_fixed_warm_start_seed_shares_one_warm_start_across_run_seeds(tmp_path: Path) -> None:
    """``warm_start.seed`` varies RL only: runs with other root seeds reuse the same cached warm start,
    which is the one a run with that root seed would make."""
    shared = {"warm_start.seed": 0}
    keys = {pipeline.warm_start_key(_run(tmp_path, f"s{s}", seed=s, **shared).config) for s in (0, 1, 2)}
    assert keys == {pipeline.warm_start_key(_run(tmp_path, "plain").config)}  # seed 0's own warm start
    assert pipeline.warm_start_key(_run(tmp_path, "s1", seed=1, **{"warm_start.seed": 1}).config) not in keys


def test_a_model_that_is_not_a_preset_starts_rl_as_it_is_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The warm start trains presets only; a folder (or hub) model skips it with a warning naming the
    field and how to silence it, and nothing is warm-started or cached for it."""
    folder = ensure_preset("tiny", tmp_path / "presets")
    run = _run(tmp_path, "folder", **{"model.name_or_path": str(folder)})
    with caplog.at_level(logging.WARNING, logger="ragen_tasks.pipeline.stages"):
        assert pipeline.init_run(run)["warm_start"] == {}
    (message,) = [r.getMessage() for r in caplog.records if "warm start skipped" in r.getMessage()]
    assert str(folder) in message and "warm_start.enabled=false" in message
    assert not any(p.name.startswith("warm-start-") for p in (tmp_path / "runs").iterdir())
    caplog.clear()
    quiet = _run(tmp_path, "quiet", **{"model.name_or_path": str(folder), "warm_start.enabled": False})
    pipeline.init_run(quiet)
    assert not [r for r in caplog.records if "warm start skipped" in r.getMessage()]


def test_lr_at_decays_linearly_from_the_base_rate_over_the_run() -> None:
    optim = OptimConfig(lr=1e-3, critic_lr=4e-3, lr_schedule="linear", lr_end_fraction=0.2)
    actor = [optim.lr_at("actor", i, 4) for i in range(5)]
    assert actor == pytest.approx([1e-3, 0.8e-3, 0.6e-3, 0.4e-3, 0.2e-3])  # the 5th: after the last update
    assert optim.lr_at("critic", 2, 4) == pytest.approx(2.4e-3)
    assert optim.lr_at("actor", 9, 4) == pytest.approx(0.2e-3)  # past the end it stays at the end rate
    with pytest.raises(ValueError, match=r"'value'.*expected 'actor' or 'critic'"):
        optim.lr_at("value", 0, 4)
    constant = OptimConfig(lr=1e-3, critic_lr=4e-3)
    assert {constant.lr_at("actor", i, 4) for i in range(6)} == {1e-3}


def test_each_update_steps_at_its_iterations_scheduled_rate_whether_loaded_or_handed_on(tmp_path: Path) -> None:
    """The rate the optimizers stepped with is the one they saved in the next checkpoint; updates
    that load the trainer from its checkpoint (``handoff=None``) and updates that take it from the
    previous one must both step at their own iteration's rate, never at a saved one."""
    decay = {"optim.lr_schedule": "linear", "optim.lr_end_fraction": 0.5, "optim.lr": 1e-3, "optim.critic_lr": 2e-3}
    run = _run(tmp_path, "decay", iterations=4, **{"algo.advantage": "gae", **decay})
    pipeline.init_run(run)
    handoff = pipeline.TrainerHandoff()
    for k, handed in enumerate((None, handoff, handoff)):
        generated, rolled = pipeline.generate_tasks(run, k), pipeline.rollout(run, k)
        batch = pipeline.filter_and_validate(run, k)
        metrics = pipeline.update(run, k, handed)
        row = pipeline.iteration_row(run, k, generated=generated, rolled=rolled, batch=batch, updated=metrics)
        pipeline.record_iteration(run, k, row)
        saved = {
            name: torch.load(run.checkpoint_path(k + 1) / f"optim_{name}.pt", weights_only=False)["param_groups"][0][
                "lr"
            ]
            for name in ("actor", "critic")
        }
        fraction = 1 - 0.5 * k / 4
        assert saved == pytest.approx({"actor": 1e-3 * fraction, "critic": 2e-3 * fraction}), k
        assert metrics["actor/lr"] == pytest.approx(1e-3 * fraction)


def test_an_update_with_the_supervised_term_imitates_demonstrations_of_its_games(tmp_path: Path) -> None:
    """``algo.demo_loss_coef`` through the update stage: the update builds its demonstrations (the
    warm start's demonstrator for the run's games), and its loss on them is reported; without the
    term there is none. (Rows without advantage are kept: a 4-step warm start may give every rollout the
    same reward, and with no row left there is no optimizer step to add the term to.)"""
    knobs = {"algo.demo_episodes": 4, "algo.drop_zero_advantage": False}
    for coef in (0.0, 0.5):
        run = _run(tmp_path, f"demo-{coef}", iterations=1, **{"algo.demo_loss_coef": coef, **knobs})
        pipeline.init_run(run)
        pipeline.generate_tasks(run, 0)
        pipeline.rollout(run, 0)
        pipeline.filter_and_validate(run, 0)
        metrics = pipeline.update(run, 0)
        if coef == 0:
            assert "actor/demo_nll" not in metrics
        else:
            assert 0 < metrics["actor/demo_nll"] < 20  # a finite loss on real demonstrated tokens

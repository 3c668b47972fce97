"""The StarPO stages as library functions: what the Prefect tasks in ``flows/`` call.

Each stage reads its inputs from the store, commits its outputs there (data first, manifest last)
and returns a small JSON-able summary. Each is idempotent: run again for the same iteration, it
finds its committed output and returns at once, so a retried task or a re-run flow never redoes
or duplicates work.

Per iteration ``k`` (``s = policy_step(k)``, see ``lineage``; the update and the rollback live in
``update_stage``)::

    generate_tasks(k)      -> iter_k/tasks/tasks.json
    rollout(k)             -> iter_k/rollouts/   (trajectories sampled by policy step s)
    filter_and_validate(k) -> iter_k/batch/      (GX-validated, fresh, uncertainty-filtered)
    update(k)              -> checkpoints/step_{s+1}
    rollback(k)            -> checkpoints/step_{s+2}, a healthy step's exact state (guard rollback only)
    evaluate(k)            -> iter_k/eval/eval.json       (every eval.every iterations and the last)
    record_iteration(k)    -> iter_k/summary/summary.json (the iteration's commit: resume starts after it)

``iteration_row`` assembles what ``record_iteration`` commits; ``stop_record`` is what a run the
Echo-Trap guard stopped hands on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ragen_tasks.algos import filter_groups, rollout_health_from_trajectories
from ragen_tasks.config import ConfigError, TrainConfig, with_overrides
from ragen_tasks.data.freshness import freshness_report
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.evaluation import per_seed_outcomes
from ragen_tasks.guard import GuardDecision
from ragen_tasks.models.presets import PRESETS
from ragen_tasks.pipeline.lineage import fingerprint, marker_fingerprint, policy_step, trusted_fingerprints
from ragen_tasks.pipeline.policy import evaluate_checkpoint, play_checkpoint
from ragen_tasks.pipeline.run import (
    PRODUCER,
    Run,
    apply_changes,
    check_resumable,
    check_same_config,
    record_change,
    recorded_changes,
)
from ragen_tasks.pipeline.trainer import (
    build_trainer,
    republish,
    save_trainer,
    step_missing,
    warm_started_policy,
)
from ragen_tasks.rollout.loop import RolloutTask, make_group_tasks
from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.validation.batch import BatchLimits, validate_stored_batch

log = logging.getLogger(__name__)


def init_run(run: Run, *, progress: Any = None, resume_set: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Create (or resume) the run: config recorded, initial policy committed as checkpoint step 0.

    Returns ``{"run_id", "start_iteration", "warm_start"}``. The initial policy is the model of
    ``config.model``; for the built-in presets (random init) the warm start runs first when enabled.
    ``resume_set``: optimizer settings to change on an existing run (``RESUMABLE_KEYS``), recorded in
    the run and in force from the iteration it resumes at.
    """
    config = run.config
    done = run.store.last_committed_iteration(run.run_id, "summary", "summary")
    start = 0 if done is None else done + 1
    if resume_set:
        check_resumable(resume_set)
        if not run.store.has_manifest(run.run_id, 0, "summary", "config"):
            raise ConfigError(f"--resume-set: run {run.uri} does not exist yet; use --set to configure a new run")
    run.store.write_json(run.run_id, 0, "summary", "config", config.model_dump(mode="json"), producer=PRODUCER)
    stored_config, _ = run.store.read_json(run.run_id, 0, "summary", "config")  # the first start's, on a resume
    stored = apply_changes(TrainConfig.model_validate(stored_config), recorded_changes(run.store, run.run_id))
    if resume_set and any(_dotted(stored.model_dump(mode="json"), k) != v for k, v in resume_set.items()):
        previous = {k: _dotted(stored.model_dump(mode="json"), k) for k in resume_set}
        record_change(run.store, run.run_id, {"set": dict(resume_set), "previous": previous, "from_iteration": start})
        log.warning("run %s: from iteration %d on, %s (was %s)", run.run_id, start, dict(resume_set), previous)
        stored = with_overrides(stored, resume_set)
    # What the run records is in force on both sides; what may differ (iterations, store location) is not compared.
    current = apply_changes(config, recorded_changes(run.store, run.run_id))
    check_same_config(stored.model_dump(mode="json"), current.model_dump(mode="json"), run.uri)
    if not run.store.has_manifest(run.run_id, 0, "summary", "initial_policy"):
        # Checkpoint 0 was never committed (a first start, or a crash before its commit). Once it was,
        # the record below says so: a resume after pruning never rebuilds it (nor re-runs the warm start).
        fp: str | None = None
        if not step_missing(run, 0):
            republish(run, 0)
            fp = marker_fingerprint(run, 0)
        elif done is None:
            source: str | Path = config.model.name_or_path
            warm: dict[str, Any] = {}
            if config.warm_start.enabled and config.model.name_or_path in PRESETS:
                source, warm = warm_started_policy(run, progress=progress)
            elif config.warm_start.enabled:
                # A pretrained model follows the prompt's format already, and the presets' supervised
                # settings (rate, steps) are tuned for a model built from scratch: they would damage it.
                log.warning(
                    "warm start skipped: model.name_or_path=%r is not a preset (%s), so RL starts from the "
                    "model as it is; set warm_start.enabled=false to say so and silence this warning",
                    config.model.name_or_path,
                    ", ".join(sorted(PRESETS)),
                )
            # Its record first: a retry after a crash before the checkpoint commit finds the cached warm start.
            run.store.write_json(run.run_id, 0, "summary", "warm_start", warm, producer=PRODUCER)
            ckpt.seed_global_rngs(config.seed, 0)  # rng.pt of checkpoint 0: the same in identical runs
            fp = save_trainer(run, build_trainer(config, source), 0).fingerprint
        # else: a run recorded before this record existed, whose checkpoint 0 was pruned: nothing to rebuild
        if fp is not None:
            run.store.write_json(
                run.run_id,
                0,
                "summary",
                "initial_policy",
                {"step": 0, "fingerprint": fp},
                producer=PRODUCER,
                policy_version=0,
                weights_fingerprint=fp,
            )
    elif not step_missing(run, 0):
        republish(run, 0)
    warm, _ = run.store.read_json(run.run_id, 0, "summary", "warm_start")
    initial_eval(run)  # before RL (after the warm start): what summary.json compares the final policy with
    return {"run_id": run.run_id, "start_iteration": start, "warm_start": warm}


def _dotted(data: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, Mapping) else None  # type: ignore[assignment]
    return data


def initial_eval(run: Run) -> dict[str, Any]:
    """Held-out evaluation of policy version 0, committed once (checkpoint 0 is pruned later)."""
    return evaluate(run, 0, 0, name="initial")


def generate_tasks(run: Run, iteration: int) -> dict[str, Any]:
    """Task generation: ``groups`` initial states x ``group_size`` rollouts (task diversity knob)."""
    config = run.config
    t0 = time.perf_counter()
    if not run.store.has_manifest(run.run_id, iteration, "tasks", "tasks"):
        tasks = make_group_tasks(
            config.envs,
            config.rollout.groups,
            config.rollout.group_size,
            config.seed,
            iteration,
            seed_space=config.eval.seed_offset,
            min_plan_length=config.rollout.min_plan_length,
            long_plan_share=config.rollout.long_plan_share,
        )
        run.store.write_json(run.run_id, iteration, "tasks", "tasks", [t.__dict__ for t in tasks], producer=PRODUCER)
    tasks_json, _ = run.store.read_json(run.run_id, iteration, "tasks", "tasks")
    return {
        "uri": run.store.uri(run.run_id, iteration, "tasks", "tasks"),
        "tasks": len(tasks_json),
        "timing/generate_tasks_s": time.perf_counter() - t0,
    }


def rollout(run: Run, iteration: int) -> dict[str, Any]:
    """Roll out the iteration's tasks with policy step ``policy_step(run, iteration)``; commit them."""
    t0 = time.perf_counter()
    compute_s = 0.0
    if not run.store.has_manifest(run.run_id, iteration, "rollouts"):
        step = policy_step(run, iteration)
        tasks_json, _ = run.store.read_json(run.run_id, iteration, "tasks", "tasks")
        tasks = [RolloutTask(**t) for t in tasks_json]
        t_play = time.perf_counter()
        trajectories = play_checkpoint(
            run.config,
            run.checkpoint_path(step),
            tasks,
            temperature=run.config.rollout.temperature,
            seed=run.config.seed * 1_000_003 + iteration,
            policy_version=step,
            weights_fingerprint=fingerprint(run, step),
        )
        compute_s = time.perf_counter() - t_play
        run.store.write_trajectories(
            run.run_id,
            iteration,
            "rollouts",
            trajectories,
            producer=PRODUCER,
            policy_version=step,
            weights_fingerprint=fingerprint(run, step),
        )
    manifest = run.store.read_manifest(run.run_id, iteration, "rollouts")
    return {
        "uri": run.store.uri(run.run_id, iteration, "rollouts", "trajectories"),
        "trajectories": manifest.objects[0].rows,
        "policy_step": manifest.policy_version,
        "timing/rollout_s": time.perf_counter() - t0,  # the whole stage (store I/O included)
        "timing/rollout_compute_s": compute_s,  # model load + the multi-turn rollout
    }


def batch_limits(config: TrainConfig) -> BatchLimits:
    """What a rollout batch must satisfy before it may be trained on."""
    agent = config.agent
    return BatchLimits(
        reward_min=config.store.reward_min,
        reward_max=config.store.reward_max,
        max_tokens=agent.max_context_tokens + agent.max_tokens_per_turn,
        max_turns=agent.max_turns,
    )


def filter_and_validate(run: Run, iteration: int, *, current_version: int | None = None) -> dict[str, Any]:
    """Great Expectations validation, freshness check, uncertainty-based filtering -> training batch.

    ``current_version`` is the trainer's policy version (default ``policy_step(run, iteration)``:
    on-policy). Returns health metrics of the whole rollout batch and the filter's metrics.
    """
    config = run.config
    version = policy_step(run, iteration) if current_version is None else current_version
    t0 = time.perf_counter()
    if run.store.has_manifest(run.run_id, iteration, "batch", "summary"):  # written last: the stage is done
        summary, _ = run.store.read_json(run.run_id, iteration, "batch", "summary")
        return dict(summary)
    trajectories, manifest = validate_stored_batch(
        run.store, run.run_id, iteration, "rollouts", limits=batch_limits(config)
    )
    known = trusted_fingerprints(run, iteration, config.freshness.max_staleness)
    fresh = freshness_report(trajectories, version, known, config.freshness.max_staleness)
    metrics: dict[str, Any] = {**rollout_health_from_trajectories(trajectories), **fresh.metrics()}
    kept: list[Trajectory] = []
    if fresh.accepted:
        rewards = torch.tensor([t.reward for t in fresh.accepted], dtype=torch.float32)  # (N,)
        group_ids = torch.tensor([t.group_id for t in fresh.accepted], dtype=torch.long)  # (N,)
        keep, filter_metrics = filter_groups(rewards, group_ids, config.algo.filter_keep_ratio, config.algo.filter_mode)
        kept = [fresh.accepted[i] for i in keep.tolist()]
        metrics.update({k: float(v) for k, v in filter_metrics.items()})
    metrics["batch/kept_trajectories"] = float(len(kept))
    # The batch first (idempotent on retry), the summary last: its manifest marks the stage as done.
    run.store.write_trajectories(
        run.run_id,
        iteration,
        "batch",
        kept,
        producer=PRODUCER,
        policy_version=manifest.policy_version,
        weights_fingerprint=manifest.weights_fingerprint,
    )
    metrics["timing/filter_s"] = time.perf_counter() - t0  # read + GX + freshness + filter + batch write
    summary = json_floats(metrics)
    run.store.write_json(run.run_id, iteration, "batch", "summary", summary, producer=PRODUCER, policy_version=version)
    return summary


def json_floats(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Metrics as plain floats (None for non-numbers). NaN / inf are KEPT: the store's JSON keeps
    them (Python's json reads NaN and Infinity back) and the Echo-Trap guard must see a non-finite
    gradient norm; displays sanitise them."""
    return {k: (float(v) if isinstance(v, int | float) else None) for k, v in metrics.items()}


def should_evaluate(config: TrainConfig, iteration: int) -> bool:
    return (iteration + 1) % config.eval.every == 0 or iteration + 1 == config.iterations


def evaluate_step(
    run: Run, step: int, *, seeds: int | None = None, seed_offset: int | None = None, env_names: list[str] | None = None
) -> tuple[dict[str, dict[str, float]], list[Trajectory]]:
    """Held-out evaluation of policy version ``step`` of the run (deterministic given the seeds)."""
    fingerprint(run, step)  # the lineage must agree with the checkpoint's marker
    return evaluate_checkpoint(
        run.config, run.checkpoint_path(step), seeds=seeds, seed_offset=seed_offset, env_names=env_names
    )


def evaluate(run: Run, iteration: int, step: int, *, name: str = "eval") -> dict[str, Any]:
    """Held-out evaluation of checkpoint ``step`` (by default the policy the iteration hands on),
    committed as ``iter_<iteration>/eval/<name>``; a retry or resume reads the committed result
    instead of evaluating again. The result: ``{"envs": per-env metrics, "policy_version": step,
    "per_seed": per_seed_outcomes}`` (results committed before the outcomes were kept lack ``per_seed``)."""
    if not run.store.has_manifest(run.run_id, iteration, "eval", name):
        per_env, trajectories = evaluate_step(run, step)
        run.store.write_json(
            run.run_id,
            iteration,
            "eval",
            name,
            {"envs": per_env, "policy_version": step, "per_seed": per_seed_outcomes(trajectories)},
            producer=PRODUCER,
            policy_version=step,
        )
    result, _ = run.store.read_json(run.run_id, iteration, "eval", name)
    return dict(result)


def flatten_eval(result: Mapping[str, Any]) -> dict[str, float]:
    """An evaluation result as metric-row keys: ``eval/<env>/<metric>``."""
    return {f"eval/{env}/{k}": float(v) for env, metrics in result.get("envs", {}).items() for k, v in metrics.items()}


def iteration_row(
    run: Run,
    iteration: int,
    *,
    generated: Mapping[str, Any],
    rolled: Mapping[str, Any],
    batch: Mapping[str, Any],
    updated: Mapping[str, Any],
) -> dict[str, Any]:
    """The iteration's metric row from its stage summaries: the batch's health and the filter's
    metrics, the update's metrics, the timings (and async ledger metrics) of task generation and
    rollout, and the policy steps it sampled with (``policy/step``) and hands on (``policy/next_step``)."""
    return {
        "iteration": iteration,
        **batch,
        **updated,
        **{k: v for k, v in {**generated, **rolled}.items() if k.startswith(("timing/", "async/"))},
        "policy/step": policy_step(run, iteration),
        "policy/next_step": int(updated["checkpoint/step"]),
    }


def stop_record(run: Run, iteration: int, decision: GuardDecision) -> dict[str, Any]:
    """What a run the guard stopped hands on: where and why, and its last healthy checkpoint."""
    healthy = decision.rollback_to
    return {
        "iteration": iteration,
        "reason": decision.message,
        "last_healthy_step": healthy,
        "last_healthy_checkpoint": None if healthy is None else str(run.checkpoint_path(healthy)),
    }


def record_iteration(run: Run, iteration: int, row: Mapping[str, Any]) -> dict[str, Any]:
    """Commit the iteration's metrics row (it must hold ``policy/next_step``): from now on a resumed
    run starts at ``iteration + 1`` with that policy."""
    if "policy/next_step" not in row:
        raise ValueError(
            f"iteration {iteration}: the row must hold 'policy/next_step' (the policy the next iteration uses)"
        )
    run.store.write_json(
        run.run_id,
        iteration,
        "summary",
        "summary",
        dict(row),
        producer=PRODUCER,
        policy_version=int(row["policy/next_step"]),
    )
    stored, _ = run.store.read_json(run.run_id, iteration, "summary", "summary")
    return dict(stored)

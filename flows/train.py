"""The StarPO training flow: per iteration generate_tasks -> rollout -> filter_and_validate ->
update -> guard -> evaluate (every N) -> record. Orchestration only: every task is a thin wrapper
over a ``ragen_tasks.pipeline`` stage, takes the run's URI and the iteration (never tensors or
trajectories), and is idempotent through the store's manifests, so retries and re-runs never
duplicate work. Re-running with the same run id resumes after the last committed iteration.

How rollout and update run (``rollout.mode``: in this process, as stage deployments, or from async
rollout workers) is chosen once per run (``execution_mode``); every mode runs the same loop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Protocol

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run
from pydantic import Field

from flows import stages
from flows.params import PresetChoice
from flows.progress import Clock, RunDisplay, publish_summary
from flows.retry import retry_unless
from ragen_tasks import guard, pipeline
from ragen_tasks.config import ConfigError, TrainConfig
from ragen_tasks.data.keys import PART_PATTERN
from ragen_tasks.pipeline.lease import RunLease, RunLeaseError
from ragen_tasks.presets import DEFAULT_PRESET, load_config
from ragen_tasks.runs import finish_run as finish
from ragen_tasks.training.checkpoint import CheckpointError
from ragen_tasks.training.update import NonFiniteUpdateError
from ragen_tasks.validation.batch import BatchValidationError

# Idempotent stages retry once: a retry finds what the failed attempt committed and finishes the rest.
# NO_CACHE: idempotence comes from the store's manifests, not from Prefect's result cache.


#: Errors a retry would meet again (bad config, a diverged update, a quarantined batch, a refused
#: checkpoint, another writer): the task fails at once, with its message.
retry_unless_final = retry_unless(
    ConfigError, NonFiniteUpdateError, BatchValidationError, CheckpointError, RunLeaseError
)


@task(name="init-run", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_final)
def init_run(
    config: TrainConfig,
    run_id: str,
    resume_set: dict[str, Any] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """``progress``: called after each warm start step with (step, loss), in this process."""
    return pipeline.init_run(pipeline.open_run(config, run_id), resume_set=resume_set, progress=progress)


@task(
    name="generate-tasks",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_final,
)
def generate_tasks(run_uri: str, iteration: int) -> dict[str, Any]:
    return pipeline.generate_tasks(pipeline.run_for_iteration(run_uri, iteration), iteration)


@task(name="rollout", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_final)
def rollout(run_uri: str, iteration: int) -> dict[str, Any]:
    return pipeline.rollout(pipeline.run_for_iteration(run_uri, iteration), iteration)


@task(name="filter-and-validate", cache_policy=NO_CACHE)  # a failed validation is final: no retry
def filter_and_validate(run_uri: str, iteration: int) -> dict[str, Any]:
    return pipeline.filter_and_validate(pipeline.run_for_iteration(run_uri, iteration), iteration)


@task(name="update", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_final)
def update(run_uri: str, iteration: int, handoff: pipeline.TrainerHandoff | None = None) -> dict[str, Any]:
    return pipeline.update(pipeline.run_for_iteration(run_uri, iteration), iteration, handoff)


@task(name="rollback", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_final)
def rollback(run_uri: str, iteration: int, to_step: int, new_step: int) -> dict[str, Any]:
    return pipeline.rollback(
        pipeline.run_for_iteration(run_uri, iteration), iteration, to_step=to_step, new_step=new_step
    )


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_final)
def evaluate(run_uri: str, iteration: int, step: int) -> dict[str, Any]:
    return pipeline.evaluate(pipeline.run_for_iteration(run_uri, iteration), iteration, step)


@task(
    name="record-iteration",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_final,
)
def record_iteration(run_uri: str, iteration: int, row: dict[str, Any]) -> dict[str, Any]:
    return pipeline.record_iteration(pipeline.open_existing_run(run_uri), iteration, row)


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(run_uri: str, warm_start: dict[str, Any], stopped: dict[str, Any] | None) -> dict[str, Any]:
    return finish(pipeline.open_existing_run(run_uri), warm_start=warm_start, stopped=stopped)


class Stage(Protocol):
    def __call__(self, run_uri: str, iteration: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Mode:
    """How an iteration's task generation, rollout and update run; each is called ``(run_uri, iteration)``."""

    generate_tasks: Stage
    rollout: Stage
    update: Stage


def execution_mode(mode: str, handoff: pipeline.TrainerHandoff) -> Mode:
    """``rollout.mode`` as the tasks that run it (see ``flows/stages.py`` for the non-default ones).
    In-process updates hand the trainer they saved on to the next one (``handoff``)."""
    in_process_update = partial(update, handoff=handoff)
    if mode == "deployment":
        return Mode(generate_tasks, stages.rollout_via_deployment, stages.update_via_deployment)
    if mode == "async":
        return Mode(stages.tasks_from_workers, stages.consume_async_batch, in_process_update)
    return Mode(generate_tasks, rollout, in_process_update)


#: The config keys the form has fields of their own for; ``overrides`` sets any other.
FORM_FIELDS = {"iterations": "iterations", "seed": "seed", "eval_seeds": "eval.seeds", "store_root": "store.root"}


@flow(name="ragen-train", log_prints=False)
def train(
    preset: PresetChoice = DEFAULT_PRESET,
    iterations: Annotated[int | None, Field(ge=1)] = None,
    seed: Annotated[int | None, Field(ge=0)] = None,
    eval_seeds: Annotated[int | None, Field(ge=1)] = None,
    run_id: Annotated[str | None, Field(pattern=f"^{PART_PATTERN}$")] = None,
    store_root: Annotated[str | None, Field(min_length=1)] = None,
    overrides: Annotated[
        dict[str, Any] | None, Field(examples=[{"optim.lr": 1e-4, "rollout.groups": 8, "eval.every": 5}])
    ] = None,
    resume_set: Annotated[dict[str, Any] | None, Field(examples=[{"optim.lr": 1e-4}])] = None,
) -> dict[str, Any]:
    """Train a policy with StarPO / StarPO-S: warm start, then the RL iterations, then the summary.

    Args:
        preset: a shipped preset (ragen train --list); bandit-tiny is the fastest, default is the
            paper's FrozenLake (the frozenlake preset)
        iterations: RL iterations; empty: the preset's
        seed: root seed of the run (tasks, sampling, init); empty: the preset's
        eval_seeds: held-out seeds per env at each evaluation; empty: the preset's
        run_id: name of the run, letters, digits, '.', '_', '-'; an existing run id resumes it. Empty: a
            new name from the preset and this flow run, kept by the flow run's retries (they resume)
        store_root: where runs live, a folder on the worker or s3://bucket/prefix; empty: the preset's (runs/)
        overrides: any other config value, as dotted key -> value, e.g. {"optim.lr": 0.0001,
            "rollout.groups": 8}; keys as in the preset YAML files
        resume_set: optimizer settings or the update's ranks to change on an existing run (e.g. a
            lower optim.lr after a diverged update, update.world_size), recorded in the run; only the
            keys of pipeline.RESUMABLE_KEYS
    """
    fields = {"iterations": iterations, "seed": seed, "eval_seeds": eval_seeds, "store_root": store_root}
    extra = {FORM_FIELDS[name]: value for name, value in fields.items() if value is not None}
    clash = sorted(set(extra) & set(overrides or {}))
    if clash:
        raise ConfigError(f"overrides sets {clash[0]!r}, which has a field of its own: set it in that field only")
    config = load_config(preset, {**(overrides or {}), **extra})  # before any heavy work: a bad value fails here
    run_id = run_id or stable_run_id(config)
    pipeline.check_can_start(config, run_id, resume_set)  # a deployment's run fails here with the CLI's one line
    return run_training(config, run_id=run_id, show_progress=in_terminal(), resume_set=resume_set)


def in_terminal() -> bool:
    """A progress bar only for a run started from a terminal (``ragen train``), never in a deployment."""
    return deployment.id is None and sys.stderr.isatty()


def stable_run_id(config: TrainConfig) -> str | None:
    """For a deployment run started without a run id: one derived from the flow run, so a retry of
    the flow run (the UI's Retry) resumes the same training run instead of starting a new one.
    None outside a deployment (``ragen train`` names the run by the preset and the time)."""
    if deployment.id is None:
        return config.run_id
    return config.run_id or f"{Path(config.preset).stem}-{flow_run.name}-{str(flow_run.id)[:8]}"


def run_training(
    config: TrainConfig,
    *,
    run_id: str | None = None,
    show_progress: bool = False,
    resume_set: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run under its writer lease (one writer per run id; see ``pipeline.lease``)."""
    run = pipeline.open_run(config, run_id)
    lease = RunLease.acquire(run.store, run.run_id, stale_after_s=config.store.lease_stale_s).start()
    try:
        return _iterations(config, run, lease, resume_set, show_progress)
    finally:
        lease.release()


def _iterations(
    config: TrainConfig, run: pipeline.Run, lease: RunLease, resume_set: dict[str, Any] | None, show_progress: bool
) -> dict[str, Any]:
    """The iteration loop (inside a flow run), in the order of the paper's algorithm box."""
    stopped: dict[str, Any] | None = None
    with RunDisplay(run, config.iterations, show_bar=show_progress) as display:  # visible from the first second
        init = init_run(config, run.run_id, resume_set, display.warm_start_step)
        config = pipeline.apply_changes(config, pipeline.recorded_changes(run.store, run.run_id))  # --resume-set
        start, mode = int(init["start_iteration"]), execution_mode(config.rollout.mode, pipeline.TrainerHandoff())
        rows = pipeline.history(run)  # committed rows: a resumed run continues the guard's state from them
        display.started(start, rows)
        for it in range(start, config.iterations):
            lease.check()  # another process took the run over: stop before writing anything more
            clock = Clock()  # wall time of each task call, Prefect's own overhead included
            generated = clock("generate_tasks", mode.generate_tasks, run.uri, it)
            rolled = clock("rollout", mode.rollout, run.uri, it)
            batch = clock("filter_and_validate", filter_and_validate, run.uri, it)
            updated = clock("update", mode.update, run.uri, it)
            row = pipeline.iteration_row(run, it, generated=generated, rolled=rolled, batch=batch, updated=updated)
            # The Echo-Trap guard: a pure function of the rows, called in the flow (not worth a task).
            decision = guard.judge(config, rows, row)
            if decision.action == "rollback" and decision.rollback_to is not None:
                new_step = rollback(run.uri, it, decision.rollback_to, row["policy/next_step"] + 1)["new_step"]
                row["policy/next_step"] = int(new_step)
            row.update(decision.record())
            if pipeline.should_evaluate(config, it) and decision.action != "stop":  # a stop evaluates the healthy one
                row.update(pipeline.flatten_eval(evaluate(run.uri, it, row["policy/next_step"])))
            rows.append(record_iteration(run.uri, it, {**row, **clock.metrics()}))
            display.iteration(rows[-1], decision)
            if decision.action == "stop":
                stopped = pipeline.stop_record(run, it, decision)
                break
    summary = finish_run(run.uri, init["warm_start"], stopped)
    publish_summary(run.run_id, summary)
    return summary

"""Stage deployments and async consumption: how the train flow runs rollout and update when
``rollout.mode`` is not ``inprocess``.

- ``deployment``: the rollout and the update of each iteration run as separate Prefect deployments
  (e.g. vLLM pods vs trainer pods, on different work pools) through ``run_deployment``. Only the run
  URI and the iteration number cross the boundary; the stage flows below re-open the run from the
  store (:func:`ragen_tasks.pipeline.run_for_iteration`) and commit their output there, and the
  trainer reads the committed manifest back (a stage run that "completed" without committing fails).
- ``async``: rollout workers (``flows/rollout_worker.py``) generate their own tasks and commit
  batches continuously; the trainer's rollout step consumes the freshest batch that passes the
  freshness check (:func:`ragen_tasks.pipeline.async_rollout.consume_batch`).

The stage flows are idempotent like the stages they wrap: a retried or duplicated run finds the
committed manifest and returns at once.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from ragen_tasks import pipeline
from ragen_tasks.pipeline import async_rollout


@flow(name="ragen-rollout-stage")
def rollout_stage(run: str, iteration: int) -> dict[str, Any]:
    """Roll out iteration ``iteration`` of the run at ``run`` (its folder or ``s3://bucket/prefix/<run_id>``)."""
    return pipeline.rollout(pipeline.run_for_iteration(run, iteration), iteration)


@flow(name="ragen-update-stage")
def update_stage(run: str, iteration: int) -> dict[str, Any]:
    """Update of iteration ``iteration`` of the run at ``run``: commits the next policy step (see
    ``pipeline.update``), with the guard's mitigations in force and its healthy checkpoint protected."""
    return pipeline.update(pipeline.run_for_iteration(run, iteration), iteration)


def _run_stage(run: pipeline.Run, iteration: int, deployment: str, stage: str, name: str) -> None:
    """Run one stage deployment and wait for it (bounded); fail unless its manifest is committed."""
    logger = get_run_logger()
    if run.store.has_manifest(run.run_id, iteration, stage, name):
        return  # idempotent: committed by an earlier attempt
    timeout = run.config.rollout.stage_timeout_s
    flow_run: FlowRun = run_deployment(  # type: ignore[assignment]  # sync call: async_dispatch returns the FlowRun
        name=deployment,
        parameters={"run": run.uri, "iteration": iteration},
        timeout=timeout,
        poll_interval=min(5.0, timeout / 10),
        as_subflow=True,
    )
    state = flow_run.state
    logger.info("iteration %d: %s run %s ended %s", iteration, deployment, flow_run.id, state.name if state else None)
    if not run.store.has_manifest(run.run_id, iteration, stage, name):
        raise RuntimeError(
            f"iteration {iteration}: deployment {deployment!r} (flow run {flow_run.id}) ended in state "
            f"{state.name if state else 'unknown'} without committing {run.store.uri(run.run_id, iteration, stage, name)}"
            f" (rollout.stage_timeout_s={timeout}); check its logs and that a worker serves its work pool"
        )


@task(name="rollout-via-deployment", cache_policy=NO_CACHE)
def rollout_via_deployment(run_uri: str, iteration: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = pipeline.open_existing_run(run_uri)
    _run_stage(run, iteration, run.config.rollout.rollout_deployment, "rollouts", "trajectories")
    manifest = run.store.read_manifest(run.run_id, iteration, "rollouts")
    return {
        "uri": run.store.uri(run.run_id, iteration, "rollouts", "trajectories"),
        "trajectories": manifest.num_rows,
        "timing/rollout_s": time.perf_counter() - t0,
    }


@task(name="update-via-deployment", cache_policy=NO_CACHE)
def update_via_deployment(run_uri: str, iteration: int) -> dict[str, Any]:
    run = pipeline.open_existing_run(run_uri)
    _run_stage(run, iteration, run.config.rollout.update_deployment, "update", "metrics")
    metrics, _ = run.store.read_json(run.run_id, iteration, "update", "metrics")
    return dict(metrics)


def tasks_from_workers(run_uri: str, iteration: int) -> dict[str, Any]:
    """Async mode's task generation: nothing to do here, each rollout worker generates its own tasks
    (``async_rollout.worker_tasks``)."""
    return {}


@task(name="consume-async-batch", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def consume_async_batch(run_uri: str, iteration: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    metrics = async_rollout.consume_batch(pipeline.run_for_iteration(run_uri, iteration), iteration)
    return {**metrics, "timing/rollout_s": time.perf_counter() - t0}

"""The StarPO training flow: per iteration generate_tasks -> rollout -> filter_and_validate ->
update -> evaluate (every N) -> record. Orchestration only: every task is a thin wrapper over a
``ragen_tasks.pipeline`` stage, passes URIs and small summaries (never tensors or trajectories),
and is idempotent through the store's manifests, so retries and re-runs never duplicate work.
Re-running with the same run id resumes after the last committed iteration.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from flows import stages
from ragen_tasks import pipeline
from ragen_tasks.config import TrainConfig
from ragen_tasks.data.store import Store
from ragen_tasks.presets import DEFAULT_PRESET, load_config

# Idempotent stages retry once: a retry finds what the failed attempt committed and finishes the rest.
# NO_CACHE: idempotence comes from the store's manifests, not from Prefect's result cache.


@task(name="init-run", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def init_run(config: TrainConfig, run_id: str) -> dict[str, Any]:
    return pipeline.init_run(pipeline.Run(config, run_id, Store(config.store.root)))


@task(name="generate-tasks", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def generate_tasks(run: pipeline.Run, iteration: int) -> dict[str, Any]:
    return pipeline.generate_tasks(run, iteration)


@task(name="rollout", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def rollout(run: pipeline.Run, iteration: int) -> dict[str, Any]:
    return pipeline.rollout(run, iteration)


@task(name="filter-and-validate", cache_policy=NO_CACHE)  # a failed validation is final: no retry
def filter_and_validate(run: pipeline.Run, iteration: int) -> dict[str, Any]:
    return pipeline.filter_and_validate(run, iteration)


@task(name="update", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def update(run: pipeline.Run, iteration: int) -> dict[str, Any]:
    return pipeline.update(run, iteration)


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def evaluate(run: pipeline.Run, iteration: int) -> dict[str, Any]:
    return pipeline.evaluate(run, iteration)


@task(name="record-iteration", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def record_iteration(run: pipeline.Run, iteration: int, row: dict[str, Any]) -> dict[str, Any]:
    return pipeline.record_iteration(run, iteration, row)


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(run: pipeline.Run, init: dict[str, Any]) -> dict[str, Any]:
    from ragen_tasks.runs import finish_run as finish  # report + summary.json

    return finish(run, warm_start=init.get("warm_start", {}))


SUMMARY_KEYS = ("rollout/success", "rollout/reward_mean", "rollout/in_group_std", "actor/entropy", "actor/grad_norm",
                "rollout/think_length", "rollout/format_error_rate")


def _publish_iteration(run: pipeline.Run, row: dict[str, Any]) -> None:
    table = [{"metric": k, "value": row[k]} for k in sorted(row) if k in SUMMARY_KEYS or k.startswith("eval/")]
    create_table_artifact(table=table, key=f"{_artifact_key(run.run_id)}-metrics",
                          description=f"iteration {row['iteration']} of {run.run_id}")


def _artifact_key(run_id: str) -> str:
    # Prefect artifact keys: lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())


class _Bar:
    """A rich progress bar on the terminal when asked for (``ragen train``); silent in deployments."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[status]}"), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("StarPO iterations", total=total, completed=start, status="")

    def advance(self, status: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, status=status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@flow(name="ragen-train", log_prints=False)
def train(
    preset: str = DEFAULT_PRESET,
    overrides: dict[str, Any] | None = None,
    run_id: str | None = None,
    store_root: str | None = None,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Train a policy with StarPO. ``preset``: a preset name or YAML file; ``overrides``: dotted
    config keys -> values (``{"optim.lr": 1e-4}``); ``run_id``: resume or name the run;
    ``store_root``: a folder or ``s3://bucket/prefix`` (default: the preset's ``store.root``);
    ``show_progress``: draw a terminal progress bar (the CLI sets it)."""
    extra = dict(overrides or {})
    if store_root:
        extra["store.root"] = store_root
    config = load_config(preset, extra)
    return run_training(config, run_id=run_id, show_progress=show_progress)


def run_training(config: TrainConfig, *, run_id: str | None = None, show_progress: bool = False) -> dict[str, Any]:
    """The iteration loop (inside a flow run): reads like the paper's algorithm box."""
    logger = get_run_logger()
    run = pipeline.open_run(config, run_id)
    init = init_run(config, run.run_id)
    start = int(init["start_iteration"])
    logger.info("run %s: iterations %d..%d (store %s)", run.run_id, start, config.iterations - 1, run.store.root_uri)
    progress: Any = create_progress_artifact(progress=100.0 * start / config.iterations, key=f"{_artifact_key(run.run_id)}-progress",
                                        description=f"StarPO iterations of {run.run_id}")
    bar = _Bar(show_progress, config.iterations, start)
    for it in range(start, config.iterations):
        mode = config.rollout.mode  # inprocess (default) | deployment | async: see flows/stages.py
        if mode != "async":
            generate_tasks(run, it)
        rolled = {"inprocess": rollout, "deployment": stages.rollout_via_deployment,
                  "async": stages.consume_async_batch}[mode](run, it)
        batch = filter_and_validate(run, it)
        updated = stages.update_via_deployment(run, it) if mode == "deployment" else update(run, it)
        row: dict[str, Any] = {"iteration": it, **batch, **updated,
                               **{k: v for k, v in rolled.items() if k.startswith(("timing/", "async/"))}}
        if pipeline.should_evaluate(config, it):
            row.update(pipeline.flatten_eval(evaluate(run, it)))
        row = record_iteration(run, it, row)
        _publish_iteration(run, row)
        update_progress_artifact(progress, 100.0 * (it + 1) / config.iterations)
        logger.info("iteration %d: %s", it, json.dumps({k: row.get(k) for k in SUMMARY_KEYS}))
        bar.advance(f"success {row.get('rollout/success') or 0:.2f}  reward {row.get('rollout/reward_mean') or 0:+.2f}")
    bar.close()
    summary = finish_run(run, init)
    create_markdown_artifact(
        markdown=f"# {run.run_id}\n\nReport: `{summary['report']}`\n\n```json\n{json.dumps(summary, indent=2)}\n```",
        key=f"{_artifact_key(run.run_id)}-summary", description="run summary and report link")
    return summary


logging.getLogger("ragen_tasks").setLevel(logging.INFO)

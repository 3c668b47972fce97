"""The StarPO training flow: per iteration generate_tasks -> rollout -> filter_and_validate ->
update -> evaluate (every N) -> record. Orchestration only: every task is a thin wrapper over a
``ragen_tasks.pipeline`` stage, passes URIs and small summaries (never tensors or trajectories),
and is idempotent through the store's manifests, so retries and re-runs never duplicate work.
Re-running with the same run id resumes after the last committed iteration.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
from transformers.utils import logging as hf_logging

from flows import stages
from ragen_tasks import guard, pipeline
from ragen_tasks.config import TrainConfig
from ragen_tasks.data.store import Store
from ragen_tasks.guard import GuardDecision
from ragen_tasks.presets import DEFAULT_PRESET, load_config

T = TypeVar("T")

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
def update(run: pipeline.Run, iteration: int, handoff: pipeline.TrainerHandoff | None = None) -> dict[str, Any]:
    return pipeline.update(run, iteration, handoff)


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def evaluate(run: pipeline.Run, iteration: int, step: int) -> dict[str, Any]:
    return pipeline.evaluate(run, iteration, step)


@task(name="record-iteration", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def record_iteration(run: pipeline.Run, iteration: int, row: dict[str, Any]) -> dict[str, Any]:
    return pipeline.record_iteration(run, iteration, row)


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(run: pipeline.Run, init: dict[str, Any], stopped: dict[str, Any] | None = None) -> dict[str, Any]:
    from ragen_tasks.runs import finish_run as finish  # report + summary.json

    return finish(run, warm_start=init.get("warm_start", {}), stopped=stopped)


SUMMARY_KEYS = (
    "rollout/success",
    "rollout/reward_mean",
    "rollout/in_group_std",
    "actor/entropy",
    "actor/grad_norm",
    "rollout/think_length",
    "rollout/format_error_rate",
)


def _publish_iteration(run: pipeline.Run, row: dict[str, Any]) -> None:
    # Non-finite values stay in the store (the guard reads them) but JSON APIs refuse NaN: show them as text.
    table = [
        {"metric": k, "value": row[k] if not isinstance(row[k], float) or math.isfinite(row[k]) else str(row[k])}
        for k in sorted(row)
        if k in SUMMARY_KEYS or k.startswith("eval/")
    ]
    create_table_artifact(
        table=table,
        key=f"{_artifact_key(run.run_id)}-metrics",
        description=f"iteration {row['iteration']} of {run.run_id}",
    )


def _quoted(obj: T) -> T:
    """``obj`` for a task parameter, wrapped in Prefect's ``quote`` (which the task engine unwraps
    before the task runs): unquoted, Prefect walks every field of a Run or TrainConfig on each call
    looking for futures to resolve (~1.7 ms a call here); ours hold none. Typed as ``obj`` itself."""
    return cast(T, quote(obj))


def _artifact_key(run_id: str) -> str:
    # Prefect artifact keys: lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())


class _Bar:
    """A rich progress bar on the terminal when asked for (``ragen train``); silent in deployments."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
                transient=False,
            )
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


@task(name="rollback", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def rollback(run: pipeline.Run, iteration: int, to_step: int, new_step: int) -> dict[str, Any]:
    return pipeline.rollback(run, iteration, to_step=to_step, new_step=new_step)


class _Publisher:
    """Publishes Prefect artifacts from one background thread, in submission order, off the
    iteration's critical path (a table artifact costs ~40 ms of API round trips). Each call runs in
    a copy of the caller's context, so the artifact is linked to this flow run. ``close`` waits
    for everything submitted; a failed publication is logged, never fatal (artifacts are displays)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragen-artifacts")
        self._pending: list[Future[Any]] = []

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._pending.append(self._pool.submit(contextvars.copy_context().run, fn, *args, **kwargs))

    def close(self) -> None:
        for future in self._pending:
            if future.exception() is not None:
                logging.getLogger(__name__).warning("a Prefect artifact was not published: %s", future.exception())
        self._pool.shutdown(wait=True)


class _Clock:
    """Times task calls (``timing/<name>_task_s``) and the iteration so far (``timing/iteration_s``),
    and stamps the iteration's start (``timing/iteration_start_unix``): the whole wall time of an
    iteration, its own commit and artifacts included, is the next iteration's start minus its own."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.start_unix = time.time()
        self.tasks: dict[str, float] = {}

    def __call__(self, name: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        result = fn(*args)
        self.tasks[name] = time.perf_counter() - t0
        return result

    def metrics(self) -> dict[str, float]:
        return {
            **{f"timing/{k}_task_s": v for k, v in self.tasks.items()},
            "timing/iteration_s": time.perf_counter() - self.start,
            "timing/iteration_start_unix": self.start_unix,
        }


def run_training(config: TrainConfig, *, run_id: str | None = None, show_progress: bool = False) -> dict[str, Any]:
    """The iteration loop (inside a flow run): reads like the paper's algorithm box."""
    logger = get_run_logger()
    base = pipeline.open_run(config, run_id)
    init = init_run(_quoted(config), base.run_id)
    start = int(init["start_iteration"])
    logger.info("run %s: iterations %d..%d (store %s)", base.run_id, start, config.iterations - 1, base.store.root_uri)
    progress: Any = create_progress_artifact(
        progress=100.0 * start / config.iterations,
        key=f"{_artifact_key(base.run_id)}-progress",
        description=f"StarPO iterations of {base.run_id}",
    )
    bar = _Bar(show_progress, config.iterations, start)
    handoff = pipeline.TrainerHandoff()  # in-process updates hand the saved trainer on to the next one
    publisher = _Publisher()
    # The run shows its own progress (the bar above, the Prefect artifacts); transformers would draw
    # two more bars every iteration (loading the rollout's policy, writing the checkpoint).
    hf_bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers
    try:
        rows = pipeline.history(base)  # committed rows (a resumed run continues the guard's state from them)
        stopped: dict[str, Any] | None = None
        for it in range(start, config.iterations):
            clock = _Clock()  # wall time of each task call, Prefect's own overhead included
            run = pipeline.run_in_force(base, it, rows)  # the guard's mitigations in force, its rollback targets kept
            quoted = _quoted(run)
            mode = run.config.rollout.mode  # inprocess (default) | deployment | async: see flows/stages.py
            generated = clock("generate_tasks", generate_tasks, quoted, it) if mode != "async" else {}
            rolled = clock(
                "rollout",
                {
                    "inprocess": rollout,
                    "deployment": stages.rollout_via_deployment,
                    "async": stages.consume_async_batch,
                }[mode],
                quoted,
                it,
            )
            batch = clock("filter_and_validate", filter_and_validate, quoted, it)
            updated = (
                clock("update", stages.update_via_deployment, quoted, it)
                if mode == "deployment"
                else clock("update", update, quoted, it, _quoted(handoff))
            )
            next_step = int(updated["checkpoint/step"])  # the policy the next iteration samples with
            row: dict[str, Any] = {
                "iteration": it,
                **batch,
                **updated,
                **{k: v for k, v in {**generated, **rolled}.items() if k.startswith(("timing/", "async/"))},
                "policy/step": pipeline.policy_step(run, it),
                "policy/next_step": next_step,
            }
            # The Echo-Trap guard: a pure function of the metric rows, called in the flow itself (a task
            # call would cost Prefect state tracking every iteration for well under a millisecond of work).
            decision: GuardDecision = guard.judge(base.config, rows, row)
            if decision.action == "rollback" and decision.rollback_to is not None:
                rolled_back = rollback(quoted, it, decision.rollback_to, next_step + 1)
                row["policy/next_step"] = next_step = int(rolled_back["new_step"])
            row.update(decision.record())
            if pipeline.should_evaluate(config, it) and decision.action != "stop":  # a stop evaluates the healthy one
                row.update(pipeline.flatten_eval(evaluate(quoted, it, next_step)))
            row.update(clock.metrics())
            row = record_iteration(quoted, it, row)
            rows.append(row)
            if decision.action != "none":
                logger.warning(decision.message)
                create_markdown_artifact(
                    markdown=f"**Echo-Trap guard: {decision.action}**\n\n{decision.message}",
                    key=f"{_artifact_key(base.run_id)}-guard",
                    description="Echo-Trap guard",
                )
            publisher.submit(_publish_iteration, run, row)
            publisher.submit(update_progress_artifact, progress, 100.0 * (it + 1) / config.iterations)
            logger.info("iteration %d: %s", it, json.dumps({k: row.get(k) for k in SUMMARY_KEYS}))
            bar.advance(
                f"success {row.get('rollout/success') or 0:.2f}  reward {row.get('rollout/reward_mean') or 0:+.2f}"
            )
            if decision.action == "stop":
                stopped = {
                    "iteration": it,
                    "reason": decision.message,
                    "last_healthy_step": decision.rollback_to,
                    "last_healthy_checkpoint": None
                    if decision.rollback_to is None
                    else str(run.checkpoint_path(decision.rollback_to)),
                }
                break
    finally:  # also on a failed iteration: the artifacts already submitted still get published
        if hf_bars_were_on:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        bar.close()
        publisher.close()
    summary = finish_run(_quoted(base), init, stopped)
    create_markdown_artifact(
        markdown=f"# {base.run_id}\n\nReport: `{summary['report']}`\n\n```json\n{json.dumps(summary, indent=2)}\n```",
        key=f"{_artifact_key(base.run_id)}-summary",
        description="run summary and report link",
    )
    return summary


logging.getLogger("ragen_tasks").setLevel(logging.INFO)

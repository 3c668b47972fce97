"""What a training flow run shows while it runs: a terminal progress bar, Prefect artifacts (progress,
each iteration's metrics, guard notices, the run summary), log lines, and the wall time of each task.

Artifacts are displays: the store holds the record. A failed publication is logged, never fatal.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from transformers.utils import logging as hf_logging

from ragen_tasks.guard import GuardDecision
from ragen_tasks.pipeline import Run

#: The metrics of each iteration that the log line and the metrics artifact show (with eval/...).
SUMMARY_KEYS = (
    "rollout/success",
    "rollout/reward_mean",
    "rollout/in_group_std",
    "actor/entropy",
    "actor/grad_norm",
    "rollout/think_length",
    "rollout/format_error_rate",
)


def artifact_key(run_id: str) -> str:
    """A run id as a Prefect artifact key prefix: lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())


def metrics_table(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The metrics artifact's rows. Non-finite values stay in the store (the guard reads them) but
    JSON APIs refuse NaN: they are shown as text."""
    return [
        {"metric": k, "value": row[k] if not isinstance(row[k], float) or math.isfinite(row[k]) else str(row[k])}
        for k in sorted(row)
        if k in SUMMARY_KEYS or k.startswith("eval/")
    ]


class Clock:
    """Times task calls (``timing/<name>_task_s``) and the iteration so far (``timing/iteration_s``),
    and stamps the iteration's start (``timing/iteration_start_unix``): the whole wall time of an
    iteration, its own commit and artifacts included, is the next iteration's start minus its own."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.start_unix = time.time()
        self.tasks: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
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


class _Publisher:
    """Publishes Prefect artifacts from one background thread, in submission order: each is a few
    API round trips, which would otherwise sit on the iteration's critical path. Each call runs in
    a copy of the caller's context, so the artifact is linked to this flow run; ``close`` waits for
    everything submitted."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragen-artifacts")
        self._pending: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._pending.append(self._pool.submit(contextvars.copy_context().run, fn, *args, **kwargs))

    def close(self) -> None:
        for future in self._pending:
            if future.exception() is not None:
                logging.getLogger(__name__).warning("a Prefect artifact was not published: %s", future.exception())
        self._pool.shutdown(wait=True)


class RunDisplay:
    """Everything a training flow run shows, from its first iteration to its end (a context manager).

    While open, the library's INFO logs reach the flow run's log, and transformers draws no progress
    bars of its own (loading the rollout's policy, writing a checkpoint: two per iteration); both
    settings are restored on exit, also after a failed iteration.
    """

    def __init__(self, run: Run, iterations: int, start: int, *, show_bar: bool) -> None:
        self.run_id, self.store_uri = run.run_id, run.store.root_uri
        self.iterations, self.start, self.show_bar = iterations, start, show_bar

    def __enter__(self) -> RunDisplay:
        self._logger = get_run_logger()
        self._logger.info(
            "run %s: iterations %d..%d (store %s)", self.run_id, self.start, self.iterations - 1, self.store_uri
        )
        self._ragen_level = logging.getLogger("ragen_tasks").level
        logging.getLogger("ragen_tasks").setLevel(logging.INFO)
        self._hf_bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers
        self._progress: Any = create_progress_artifact(
            progress=100.0 * self.start / self.iterations,
            key=f"{artifact_key(self.run_id)}-progress",
            description=f"StarPO iterations of {self.run_id}",
        )
        self._bar = _Bar(self.show_bar, self.iterations, self.start)
        self._publisher = _Publisher()
        return self

    def iteration(self, row: Mapping[str, Any], decision: GuardDecision) -> None:
        """Show a committed iteration: its log line, a guard notice, the metrics table, the progress."""
        it = int(row["iteration"])
        if decision.action != "none":
            self._logger.warning(decision.message)
            create_markdown_artifact(
                markdown=f"**Echo-Trap guard: {decision.action}**\n\n{decision.message}",
                key=f"{artifact_key(self.run_id)}-guard",
                description="Echo-Trap guard",
            )
        self._publisher.submit(
            create_table_artifact,
            table=metrics_table(row),
            key=f"{artifact_key(self.run_id)}-metrics",
            description=f"iteration {it} of {self.run_id}",
        )
        self._publisher.submit(update_progress_artifact, self._progress, 100.0 * (it + 1) / self.iterations)
        self._logger.info("iteration %d: %s", it, json.dumps({k: row.get(k) for k in SUMMARY_KEYS}))
        self._bar.advance(
            f"success {row.get('rollout/success') or 0:.2f}  reward {row.get('rollout/reward_mean') or 0:+.2f}"
        )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._hf_bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        logging.getLogger("ragen_tasks").setLevel(self._ragen_level)
        self._bar.close()
        self._publisher.close()  # the artifacts already submitted still get published


def publish_summary(run_id: str, summary: Mapping[str, Any]) -> None:
    """The run's summary and a link to its report, as a markdown artifact."""
    create_markdown_artifact(
        markdown=f"# {run_id}\n\nReport: `{summary['report']}`\n\n```json\n{json.dumps(summary, indent=2)}\n```",
        key=f"{artifact_key(run_id)}-summary",
        description="run summary and report link",
    )

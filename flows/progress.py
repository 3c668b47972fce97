"""What a training flow run shows while it runs: a terminal progress bar, Prefect artifacts (warm
start and iteration progress, one metrics table, guard notices, the run summary), the library's log
lines in the flow run's log, and the wall time of each task.

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
from pathlib import Path
from types import TracebackType
from typing import Any

from prefect import get_client, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.logging.handlers import APILogHandler
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


def metrics_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One iteration's row of the metrics table: the iteration, the summary keys and eval/... .
    Non-finite values stay in the store (the guard reads them) but JSON APIs refuse NaN: they are
    shown as text."""
    shown = {k: row[k] for k in sorted(row) if k in SUMMARY_KEYS or k.startswith("eval/")}
    return {
        "iteration": row.get("iteration"),
        **{k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in shown.items()},
    }


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
    """Everything a training flow run shows, from its first second to its end (a context manager).

    Opened before the warm start: its progress artifact exists at once and moves with the warm
    start's steps (``warm_start_step``, the warm start's callback), the iterations' progress
    artifact follows from ``started``. While open, the library's log lines (the ``ragen_tasks``
    loggers, INFO and up) go to the flow run's log in the Prefect UI, not only to the worker's
    stdout, and transformers draws no progress bars of its own; both are restored on exit, also
    after a failure. The metrics are ONE table artifact, a row per iteration, updated in place.
    """

    #: Seconds between two updates of the warm start's progress artifact (each is an API call).
    WARM_START_UPDATE_S = 2.0

    def __init__(self, run: Run, iterations: int, *, show_bar: bool) -> None:
        self.run_id, self.store_uri = run.run_id, run.store.root_uri
        self.iterations, self.start, self.show_bar = iterations, 0, show_bar
        self.warm_start_steps = run.config.warm_start.turn_steps + run.config.warm_start.steps
        self._key = artifact_key(run.run_id)
        self._rows: list[dict[str, Any]] = []
        self._metrics: Any = None  # the metrics table artifact's id, once created
        self._last_warm_update = 0.0
        self._bar = _Bar(False, iterations, 0)

    def __enter__(self) -> RunDisplay:
        self._logger = get_run_logger()
        library = logging.getLogger("ragen_tasks")
        self._ragen_level = library.level
        library.setLevel(logging.INFO)
        self._api_handler = APILogHandler()  # the flow run's log in the UI (stdout keeps its own copy)
        self._api_handler.setLevel(logging.INFO)
        library.addHandler(self._api_handler)
        self._hf_bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers
        self._publisher = _Publisher()
        self._warm: Any = create_progress_artifact(
            progress=0.0,
            key=f"{self._key}-warm-start",
            description=f"warm start of {self.run_id} (supervised steps; 100 at once when cached or resumed)",
        )
        self._progress: Any = create_progress_artifact(
            progress=0.0, key=f"{self._key}-progress", description=f"StarPO iterations of {self.run_id}"
        )
        self._logger.info("run %s: starting (store %s)", self.run_id, self.store_uri)
        return self

    def warm_start_step(self, step: int, loss: float) -> None:
        """The warm start's per-step callback: moves its progress artifact (at most every
        ``WARM_START_UPDATE_S``) and logs about ten lines over the whole warm start."""
        done, total = step + 1, max(1, self.warm_start_steps)
        now = time.monotonic()
        if done == total or now - self._last_warm_update >= self.WARM_START_UPDATE_S:
            self._last_warm_update = now
            self._publisher.submit(update_progress_artifact, self._warm, 100.0 * done / total)
        if done % max(1, total // 10) == 0 or done == total:
            self._logger.info("warm start: step %d/%d, loss %.4f", done, total, loss)

    def started(self, start: int, rows: list[dict[str, Any]]) -> None:
        """The run is initialised (warm start done or reused): iterations ``start..`` follow;
        ``rows`` are the iterations already committed (a resumed run shows them too)."""
        self.start = start
        self._publisher.submit(update_progress_artifact, self._warm, 100.0)
        self._publisher.submit(update_progress_artifact, self._progress, 100.0 * start / self.iterations)
        self._logger.info("run %s: iterations %d..%d", self.run_id, start, self.iterations - 1)
        self._rows = [metrics_row(r) for r in rows]
        if self._rows:
            self._publisher.submit(self._publish_metrics, list(self._rows))
        self._bar = _Bar(self.show_bar, self.iterations, start)

    def _publish_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Create the metrics table once, then replace its rows in place (one table per run)."""
        if self._metrics is None:
            self._metrics = create_table_artifact(
                table=rows, key=f"{self._key}-metrics", description=f"metrics per iteration of {self.run_id}"
            )
        else:
            with get_client(sync_client=True) as client:
                client.update_artifact(self._metrics, ArtifactUpdate(data=json.dumps(rows)))

    def iteration(self, row: Mapping[str, Any], decision: GuardDecision) -> None:
        """Show a committed iteration: its log line, a guard notice, a metrics row, the progress."""
        it = int(row["iteration"])
        if decision.action != "none":
            self._logger.warning(decision.message)
            create_markdown_artifact(
                markdown=f"**Echo-Trap guard: {decision.action}**\n\n{decision.message}",
                key=f"{self._key}-guard",
                description="Echo-Trap guard",
            )
        self._rows.append(metrics_row(row))
        self._publisher.submit(self._publish_metrics, list(self._rows))
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
        library = logging.getLogger("ragen_tasks")
        library.removeHandler(self._api_handler)
        library.setLevel(self._ragen_level)
        self._bar.close()
        self._publisher.close()  # the artifacts already submitted still get published


def publish_summary(run_id: str, summary: Mapping[str, Any]) -> None:
    """The run's summary and a link to its report (a file:// link on the machine that ran it), as a
    markdown artifact."""
    report = Path(summary["report"])
    create_markdown_artifact(
        markdown=f"# {run_id}\n\nReport: [{report.name}]({report.resolve().as_uri()}) (`{report}`, on the machine "
        f"that ran the flow; `ragen report {summary['store']}` writes it anew)\n\n"
        f"```json\n{json.dumps(summary, indent=2)}\n```",
        key=f"{artifact_key(run_id)}-summary",
        description="run summary and report link",
    )

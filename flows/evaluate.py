"""Evaluation flows: a checkpoint on fixed held-out seeds, and the regression gate (CI-driven).

``evaluate`` is deterministic given the seeds (greedy decoding by default). ``regression_eval``
compares the result with a baseline JSON (as written by ``evaluate`` or ``ragen evaluate --json``)
and FAILS the flow run on a statistically real drop in success rate, so a deployment or a CI job
running it goes red.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from ragen_tasks import pipeline
from ragen_tasks.config import TrainConfig
from ragen_tasks.evaluation import eval_record, regression_gate
from ragen_tasks.presets import DEFAULT_PRESET, load_config


class RegressionError(RuntimeError):
    """The regression gate found a real drop; the message holds the per-env verdicts."""


def config_for_checkpoint(checkpoint: str, preset: str | None) -> TrainConfig:
    """The config a checkpoint was trained with (from its run), else the named preset."""
    run = pipeline.run_of_checkpoint(Path(checkpoint))
    if run is not None and preset is None:
        return run.config
    return load_config(preset or DEFAULT_PRESET)


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, retries=1)
def evaluate_checkpoint(
    config: TrainConfig, checkpoint: str, envs: list[str] | None, seeds: int, seed_offset: int
) -> dict[str, Any]:
    per_env, _ = pipeline.evaluate_checkpoint(
        config, Path(checkpoint), seeds=seeds, seed_offset=seed_offset, env_names=envs
    )
    return eval_record(per_env, checkpoint=str(checkpoint), seeds=seeds, seed_offset=seed_offset)


@flow(name="ragen-evaluate")
def evaluate(
    checkpoint: str,
    envs: list[str] | None = None,
    seeds: int = 32,
    seed_offset: int = 1_000_000,
    preset: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` (a checkpoint folder) on ``seeds`` held-out seeds per env."""
    config = config_for_checkpoint(checkpoint, preset)
    record = evaluate_checkpoint(config, checkpoint, envs, seeds, seed_offset)
    create_table_artifact(
        table=[{"env": env, **m} for env, m in record["envs"].items()],
        key="ragen-evaluation",
        description=f"held-out evaluation of {checkpoint}",
    )
    return record


@flow(name="ragen-regression-eval")
def regression_eval(
    checkpoint: str,
    baseline: str,
    seeds: int = 64,
    seed_offset: int = 1_000_000,
    alpha: float = 0.01,
    min_drop: float = 0.05,
    preset: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` and gate it against the ``baseline`` JSON file; fail on a regression."""
    logger = get_run_logger()
    base = json.loads(Path(baseline).read_text())
    config = config_for_checkpoint(checkpoint, preset)
    record = evaluate_checkpoint(config, checkpoint, sorted(base["envs"]), seeds, seed_offset)
    result = regression_gate(record["envs"], base["envs"], alpha=alpha, min_drop=min_drop)
    create_markdown_artifact(
        markdown=f"```\n{result.summary()}\n```", key="ragen-regression-gate", description=f"{checkpoint} vs {baseline}"
    )
    logger.info(result.summary())
    if not result.passed:
        raise RegressionError(result.summary())
    return {"passed": True, **record}

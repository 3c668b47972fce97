"""Evaluation flows: a checkpoint on fixed held-out seeds, and the regression gate (CI-driven).

``evaluate`` is deterministic given the seeds (greedy or seeded sampling at ``temperature``, default
the config's ``eval.temperature``) and returns the one evaluation record (``ragen evaluate --json``
prints the same), optionally written to ``output`` (a path or ``s3://`` URI) where a later
``regression_eval`` run takes it as its ``baseline``.
``regression_eval`` plays the candidate on the baseline's seeds, pairs the outcomes seed by seed
and FAILS the flow run on a statistically real drop in success rate, so a deployment or a CI job
running it goes red. Checkpoints and baselines may be local paths or ``s3://`` URIs.
"""

from __future__ import annotations

from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import Field

from flows.params import EnvChoice, PresetChoice
from flows.retry import retry_unless
from ragen_tasks.pipeline import gate
from ragen_tasks.training.checkpoint import CheckpointError


class RegressionError(RuntimeError):
    """The regression gate found a real drop; the message holds the per-env verdicts."""


def run_artifact_key(prefix: str) -> str:
    """An artifact key of this flow run alone (keys are shared by every run that uses them)."""
    return f"{prefix}-{flow_run.id}"


#: Retry a failed attempt unless its input was bad (a retry would fail the same way).
transient = retry_unless(ValueError, FileNotFoundError, CheckpointError)


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, retries=1, retry_condition_fn=transient)
def evaluate_checkpoint(
    checkpoint: str,
    envs: list[str] | None,
    seeds: int,
    seed_offset: int,
    temperature: float | None,
    preset: str | None,
) -> dict[str, Any]:
    return gate.evaluate(
        checkpoint, preset=preset, envs=envs, seeds=seeds, seed_offset=seed_offset, temperature=temperature
    )


@task(name="write-record", cache_policy=NO_CACHE, retries=1)
def write_record(output: str, record: dict[str, Any]) -> str:
    return gate.write_json(output, record)


@flow(name="ragen-evaluate", persist_result=True)
def evaluate(
    checkpoint: Annotated[str, Field(min_length=1)],
    envs: list[EnvChoice] | None = None,
    seeds: Annotated[int, Field(ge=1)] = 32,
    seed_offset: Annotated[int, Field(ge=0)] = 1_000_000,
    temperature: Annotated[float | None, Field(ge=0)] = None,
    preset: PresetChoice | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint on fixed held-out seeds (one episode per seed and env, deterministic).
    Returns the evaluation record: per-env metrics (envs) and per-seed outcomes (per_seed).

    Args:
        checkpoint: checkpoint folder or s3:// URI, e.g. runs/RUN/checkpoints/step_000020 or
            s3://bucket/runs/RUN/checkpoints/step_000020
        envs: envs to evaluate, e.g. ["bandit"]; empty: the envs of the checkpoint's run
        seeds: held-out seeds per env (one episode each)
        seed_offset: first held-out seed; the seeds are seed_offset .. seed_offset + seeds - 1
        temperature: sampling temperature, 0 = greedy; empty: the config's eval.temperature
        preset: config for a checkpoint outside a run folder; empty: the config of the checkpoint's run
        output: also write the evaluation record (JSON) here, a path or s3://bucket/key.json, for a
            later regression-eval run to take as its baseline; empty: only the run's result
    """
    record = evaluate_checkpoint(checkpoint, envs, seeds, seed_offset, temperature, preset)
    if output:
        record["output"] = write_record(output, record)
        get_run_logger().info("evaluation record written to %s", output)
    create_table_artifact(
        table=[{"env": env, **m} for env, m in record["envs"].items()],
        key=run_artifact_key("ragen-evaluation"),
        description=f"held-out evaluation of {checkpoint} ({seeds} seeds from {seed_offset}, "
        f"temperature {record['temperature']:g})" + (f"; record: {output}" if output else ""),
    )
    return record


@task(name="regression-gate", cache_policy=NO_CACHE, retries=1, retry_condition_fn=transient)
def run_gate(
    checkpoint: str,
    baseline: str,
    alpha: float,
    min_drop: float,
    seeds: int | None,
    seed_offset: int | None,
    temperature: float | None,
    preset: str | None,
) -> dict[str, Any]:
    outcome = gate.gate(
        checkpoint,
        baseline,
        alpha=alpha,
        min_drop=min_drop,
        seeds=seeds,
        seed_offset=seed_offset,
        temperature=temperature,
        preset=preset,
    )
    return {"passed": outcome.result.passed, "summary": outcome.summary(), "candidate": outcome.candidate}


@flow(name="ragen-regression-eval", persist_result=True)
def regression_eval(
    checkpoint: Annotated[str, Field(min_length=1)],
    baseline: Annotated[str, Field(min_length=1)],
    alpha: Annotated[float, Field(gt=0, lt=1)] = 0.01,
    min_drop: Annotated[float, Field(ge=0, lt=1)] = 0.05,
    seeds: Annotated[int | None, Field(ge=1)] = None,
    seed_offset: Annotated[int | None, Field(ge=0)] = None,
    temperature: Annotated[float | None, Field(ge=0)] = None,
    preset: PresetChoice | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Gate a checkpoint against a baseline: the candidate plays the baseline's seeds at the
    baseline's sampling temperature, the outcomes are paired seed by seed (exact McNemar test), and
    the run FAILS on a real drop in success rate.

    Args:
        checkpoint: the candidate: checkpoint folder or s3:// URI
        baseline: an evaluation record (a .json file, or s3://bucket/key.json, written by
            `ragen evaluate --json` or the evaluate flow's output) or a baseline checkpoint
        alpha: significance level of the paired test
        min_drop: smallest drop in success rate that counts as a regression
        seeds: seeds per env, only when the baseline is a checkpoint (a record fixes the seeds)
        seed_offset: first seed, only when the baseline is a checkpoint
        temperature: sampling temperature of both sides (0 = greedy), only when the baseline is a
            checkpoint; empty: the candidate's config's eval.temperature (a record fixes it)
        preset: config for checkpoints outside a run folder; empty: the config of each checkpoint's run
        output: also write the candidate's evaluation record here (path or s3://bucket/key.json), e.g.
            as the next baseline
    """
    logger = get_run_logger()
    outcome = run_gate(checkpoint, baseline, alpha, min_drop, seeds, seed_offset, temperature, preset)
    create_markdown_artifact(
        markdown=f"**{checkpoint}** vs **{baseline}**\n\n```\n{outcome['summary']}\n```",
        key=run_artifact_key("ragen-regression-gate"),
        description=f"regression gate: {'PASS' if outcome['passed'] else 'FAIL'}",
    )
    logger.info(outcome["summary"])
    if output:
        write_record(output, outcome["candidate"])
    if not outcome["passed"]:
        raise RegressionError(outcome["summary"])
    return {"passed": True, **outcome["candidate"]}

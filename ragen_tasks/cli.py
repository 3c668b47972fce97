"""The ``ragen`` command line. Thin: each command parses arguments and calls the library.

Commands import their heavy dependencies inside the command body so ``ragen --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    name="ragen",
    help="RAGEN: train LLM agents with multi-turn RL (StarPO / StarPO-S).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


@app.callback()
def _main() -> None:
    """RAGEN: train LLM agents with multi-turn RL (StarPO / StarPO-S)."""
    # Without a Prefect API configured, flows start Prefect's temporary server and wait for it for
    # 20 s by default: too short on a loaded 2-core machine, where the run then dies before it
    # starts. A user's own setting wins.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # `kill PID` ends a command the way Ctrl-C does: the stack unwinds and atexit handlers run. By
    # default SIGTERM kills the process outright, and the temporary Prefect server a flow started
    # (stopped by an atexit handler) stayed behind, holding its port and memory.
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error (no traceback) and return the Exit to raise."""
    one_line = " ".join(str(message).split())
    typer.echo(f"error: {one_line}", err=True)
    return typer.Exit(code)


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user can cause and fix (bad input, a damaged or busy run, a diverged update): each
    is reported as one line with exit code 2. Anything else is a bug and keeps its traceback."""
    from safetensors import SafetensorError

    from ragen_tasks.data.manifest import ManifestError
    from ragen_tasks.pipeline.lease import RunLeaseError
    from ragen_tasks.training.checkpoint import CheckpointError
    from ragen_tasks.training.update import NonFiniteUpdateError

    # ValueError covers ConfigError, UnsafeKeyError, StoreNotWritableError, BatchValidationError.
    return (ValueError, OSError, ManifestError, CheckpointError, RunLeaseError, NonFiniteUpdateError, SafetensorError)


@app.command()
def train(
    preset: Annotated[str, typer.Argument(help="preset name (see --list) or a YAML file")] = "default",
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override a config value: --set optim.lr=1e-4")
    ] = None,
    run_id: Annotated[str | None, typer.Option(help="name of the run; an existing run id resumes it")] = None,
    store: Annotated[
        str | None, typer.Option(help="store root: a folder or s3://bucket/prefix (default runs/)")
    ] = None,
    resume_set: Annotated[
        list[str] | None,
        typer.Option(
            "--resume-set",
            help="on resume, change an optimizer setting or where the update runs (update.*) from now on, "
            "recorded in the run: --resume-set optim.lr=1e-6, --resume-set update.world_size=2",
        ),
    ] = None,
    list_presets: Annotated[
        bool, typer.Option("--list", help="list the presets, each with what it is for, and exit")
    ] = False,
) -> None:
    """Train a policy with StarPO through the Prefect training flow.

    Prints the run folder and the report path at the end; the run folder holds summary.json
    (eval before and after RL per env), report.html and the checkpoints.
    """
    from ragen_tasks.presets import available_presets, load_config, parse_override, preset_summary

    if list_presets:
        names = available_presets()
        width = max(map(len, names))
        typer.echo("\n".join(f"{name:<{width}}  {preset_summary(name)}" for name in names))
        return
    errors = _user_errors()
    try:
        overrides = {".".join(path): value for path, value in map(parse_override, set_ or [])}
        changes = {".".join(path): value for path, value in map(parse_override, resume_set or [])}
        if store:
            overrides["store.root"] = store
        load_config(preset, set_ or [])  # a bad --set fails in --set's words
        # Fail fast, in one line, before Prefect starts: config values, env names, run id, store, lease.
        from ragen_tasks.pipeline.run import check_can_start

        check_can_start(load_config(preset, overrides), run_id, changes)
    except errors as exc:
        raise _fail(str(exc)) from None
    from flows.train import train as train_flow

    try:  # the flow draws the progress bar on a terminal
        summary = train_flow(preset=preset, overrides=overrides, run_id=run_id, resume_set=changes or None)
    except errors as exc:
        raise _fail(str(exc)) from None
    typer.echo(_summary_text(summary))


def _quiet_model_loading() -> None:
    """No per-file progress bars from transformers while a command loads checkpoints: the command's
    own output (a table, JSON) is what the user reads."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers


def _rate(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def _summary_text(summary: dict[str, Any]) -> str:
    lines = [
        f"run: {summary['store']}",
        f"report: {summary['report']}",
        f"final checkpoint: {summary['final_checkpoint']}",
    ]
    if summary.get("warm_start", {}).get("bandit_high_ev_choice_rate") is not None:
        lines.append(
            f"warm start: Bandit higher-EV arm chosen {summary['warm_start']['bandit_high_ev_choice_rate']:.2f} "
            "of the time (0.5 = arm-neutral)"
        )
    if summary.get("warm_start", {}).get("cache") == "hit":
        lines.append(f"warm start: reused from the cache ({summary['warm_start'].get('cache_run')})")
    lines.append("held-out success   before RL -> after RL   z      paired p  random  ceiling")
    for env, before in summary.get("eval_before_rl", {}).items():
        after = summary.get("eval_after_rl", {}).get(env, {})
        reference = summary.get("reference", {}).get(env, {})
        z = summary.get("rl_gain_z", {}).get(env)
        paired = summary.get("rl_gain_paired", {}).get(env)
        lines.append(
            f"  {env:<16} {before['success']:.3f}  ->  {after.get('success', float('nan')):.3f}"
            f"   {'   -' if z is None else f'{z:+5.1f}'}  {'-' if paired is None else format(paired['p'], '.2g'):>8}"
            f"  {_rate(reference.get('random'))}   {_rate(reference.get('ceiling'))}"
        )
    if summary.get("rl_gain_paired"):
        lines.append("  (z: two proportions; paired p: exact McNemar on the same held-out seeds, one-sided)")
    if summary.get("stopped"):
        lines.append(f"stopped early: {summary['stopped']}")
    return "\n".join(lines)


@app.command()
def evaluate(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="checkpoint folder or s3:// URI, e.g. runs/RUN/checkpoints/step_000020 or s3://bucket/runs/RUN/checkpoints/step_000020"
        ),
    ],
    env: Annotated[
        list[str] | None, typer.Option("--env", help="env to evaluate (repeatable; default: the run's mixture)")
    ] = None,
    seeds: Annotated[int, typer.Option(min=1, help="held-out seeds per env")] = 32,
    seed_offset: Annotated[int, typer.Option(min=0, help="first held-out seed")] = 1_000_000,
    temperature: Annotated[
        float | None,
        typer.Option(min=0, help="sampling temperature, 0 = greedy (default: the config's eval.temperature)"),
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="config to use if the checkpoint is not inside a run folder")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print the evaluation record (per-env metrics and per-seed outcomes) as JSON on stdout: "
            "the baseline format of `ragen regress`",
        ),
    ] = False,
) -> None:
    """Evaluate a checkpoint on fixed held-out seeds (deterministic given the seeds: greedy or seeded
    sampling at --temperature, default the config's eval.temperature). Exit 2 on bad input."""
    from ragen_tasks.envs import ENV_NAMES
    from ragen_tasks.evaluation import MAX_EVAL_SEEDS
    from ragen_tasks.pipeline import gate

    bad = [e for e in env or [] if e not in ENV_NAMES]
    if bad:
        raise _fail(f"--env {bad[0]!r} is not an env; valid: {', '.join(ENV_NAMES)}")
    if seeds > MAX_EVAL_SEEDS:
        raise _fail(f"--seeds {seeds} is more than {MAX_EVAL_SEEDS} per env; evaluate in blocks with --seed-offset")
    _quiet_model_loading()
    try:
        record = gate.evaluate(
            checkpoint, preset=preset, envs=env, seeds=seeds, seed_offset=seed_offset, temperature=temperature
        )
    except _user_errors() as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(record, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"held-out evaluation of {checkpoint} ({seeds} seeds from {seed_offset}, "
        f"temperature {record['temperature']:g})"
    )
    for column in ("env", "success", "reward", "format errors", "turns", "think chars"):
        table.add_column(column)
    for name, m in record["envs"].items():
        table.add_row(
            name,
            f"{m['success']:.3f}",
            f"{m['reward']:.3f}",
            f"{m['format_error_rate']:.3f}",
            f"{m['mean_turns']:.2f}",
            f"{m['think_length']:.1f}",
        )
    Console().print(table)


@app.command()
def regress(
    candidate: Annotated[str, typer.Argument(help="candidate checkpoint: a folder or s3:// URI")],
    baseline: Annotated[
        str,
        typer.Option(
            help="evaluation record (`ragen evaluate --json` output: a .json file or s3://bucket/key.json) "
            "or a baseline checkpoint (folder or s3:// URI)"
        ),
    ],
    alpha: Annotated[float, typer.Option(min=0, max=1, help="significance level of the paired test")] = 0.01,
    min_drop: Annotated[
        float, typer.Option(min=0, max=1, help="smallest drop in success rate that counts as a regression")
    ] = 0.05,
    seeds: Annotated[
        int | None, typer.Option(min=1, help="seeds per env when the baseline is a checkpoint (a record fixes them)")
    ] = None,
    seed_offset: Annotated[int | None, typer.Option(min=0, help="first seed when the baseline is a checkpoint")] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="sampling temperature of both sides when the baseline is a checkpoint, 0 = greedy (default: the "
            "candidate's eval.temperature; a record fixes it)",
        ),
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="config for checkpoints outside a run folder (default: each one's run)")
    ] = None,
    output: Annotated[
        str | None, typer.Option(help="also write the candidate's evaluation record here (path or s3:// URI)")
    ] = None,
) -> None:
    """Regression gate: play CANDIDATE on the baseline's seeds at its temperature and compare seed by
    seed (exact McNemar test). Prints the table; exit 0 on pass, 1 on a regression, 2 on bad input."""
    from ragen_tasks.pipeline import gate

    _quiet_model_loading()
    try:
        outcome = gate.gate(
            candidate,
            baseline,
            alpha=alpha,
            min_drop=min_drop,
            seeds=seeds,
            seed_offset=seed_offset,
            temperature=temperature,
            preset=preset,
        )
        if output:
            gate.write_json(output, outcome.candidate)
    except _user_errors() as exc:  # bad input (exit 2), never a verdict
        raise _fail(str(exc)) from None
    typer.echo(outcome.summary())
    if not outcome.result.passed:
        raise typer.Exit(1)


@app.command()
def report(run: Annotated[str, typer.Argument(help="run folder (runs/RUN) or s3://bucket/prefix/RUN")]) -> None:
    """(Re)write the HTML report of a run and print its path."""
    from ragen_tasks import pipeline
    from ragen_tasks.runs import stored_summary, write_run_report

    try:
        opened = pipeline.open_existing_run(run)
        path = write_run_report(opened, stored_summary(opened))
    except _user_errors() as exc:
        raise _fail(str(exc)) from None
    typer.echo(str(path) if opened.is_local else f"{opened.uri}/report.html")


BENCHMARKS = ("envs", "rollout", "update", "store", "orchestration")


@app.command()
def bench(
    name: Annotated[
        list[str] | None, typer.Argument(help=f"benchmarks to run (default all): {', '.join(BENCHMARKS)}")
    ] = None,
) -> None:
    """Run the benchmarks under bench/ (results are printed; record them in bench/RESULTS.md)."""
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    chosen = list(name or BENCHMARKS)
    for item in chosen:
        script = bench_dir / f"{item}.py"
        if item not in BENCHMARKS or not script.exists():
            raise _fail(
                f"unknown benchmark {item!r}; available: {', '.join(b for b in BENCHMARKS if (bench_dir / f'{b}.py').exists())}"
            )
    for item in chosen:
        typer.echo(f"== bench/{item}.py")
        code = subprocess.call([sys.executable, str(bench_dir / f"{item}.py")])
        if code:
            raise typer.Exit(code)


@app.command()
def play(
    env: str = typer.Argument(..., help="game to play: bandit, sokoban or frozen_lake"),
    seed: int | None = typer.Option(None, "--seed", help="task seed (default: a random one, printed)"),
    options: list[str] | None = typer.Option(
        None, "--set", help="game option KEY=VALUE (YAML value), repeatable, e.g. --set num_boxes=2"
    ),
) -> None:
    """Play a game in the terminal with the text the agent sees; one action per line ('quit' stops)."""
    import random
    import sys

    from ragen_tasks.envs import make
    from ragen_tasks.play import parse_options, play_episode

    try:
        game = make(env, **parse_options(options or []))
        chosen = seed if seed is not None else random.SystemRandom().randrange(2**31)
        play_episode(game, sys.stdin, typer.echo, seed=chosen)
    except (ValueError, RuntimeError) as err:  # bad name/option, or a room that cannot be generated
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

"""The ``ragen`` command line. Thin: each command parses arguments and calls the library.

Commands import their heavy dependencies inside the command body so ``ragen --help`` stays fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ragen",
    help="RAGEN: train LLM agents with multi-turn RL (StarPO / StarPO-S).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main() -> None:
    """RAGEN: train LLM agents with multi-turn RL (StarPO / StarPO-S)."""


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

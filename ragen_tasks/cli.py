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

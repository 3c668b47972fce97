"""Pieces shared by the three games: config validation with readable errors, text spaces, step info.

Kept private: the public surface of a game is its class, its config model and ``envs.make``.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from gymnasium import spaces
from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Characters every text space admits besides the game's own symbols.
BASE_CHARSET = frozenset(string.ascii_letters + string.digits + string.punctuation + " \n")

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class GameConfig(BaseModel):
    """Fields every game accepts. Frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_actions_per_episode: int = Field(
        10, ge=1, description="valid actions per episode; reaching it truncates the episode"
    )


#: The four diagonal steps, named by the two moves that make each: (name, (row, col) step). Both
#: grid games' action names include Up, Down, Left and Right, so the names read the same in either.
DIAGONALS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("Up Left", (-1, -1)),
    ("Up Right", (-1, 1)),
    ("Down Left", (1, -1)),
    ("Down Right", (1, 1)),
)


def load_config(model: type[ConfigT], game: str, config: Mapping[str, Any]) -> ConfigT:
    """Validate ``config`` against ``model``; raise ``ValueError`` naming ``game.field=value`` and the fix."""
    try:
        return model.model_validate(dict(config))
    except ValidationError as err:
        problems = []
        for error in err.errors():
            message = str(error["msg"]).removeprefix("Value error, ")
            if not error["loc"]:  # a model validator: its message starts with "field=value: "
                problems.append(f"{game}.{message}")
                continue
            field = ".".join(str(part) for part in error["loc"])
            if error["type"] == "extra_forbidden":
                allowed = ", ".join(sorted(model.model_fields))
                message = f"unknown option; allowed options: {allowed}"
            value = error.get("input")
            shown = "" if isinstance(value, dict) else f"={value!r}"
            problems.append(f"{game}.{field}{shown}: {message}")
        raise ValueError("; ".join(problems)) from None


def text_space(max_length: int, extra_chars: Iterable[str] = ()) -> spaces.Text:
    """A ``Text`` space over the base charset plus ``extra_chars`` (e.g. '√'), lengths 1..max_length."""
    charset = BASE_CHARSET | frozenset("".join(extra_chars))
    return spaces.Text(max_length=max_length, min_length=1, charset=frozenset(charset))


def action_space(action_names: Iterable[str]) -> spaces.Text:
    """Free text actions (any string may be sent; only ``action_names`` are valid)."""
    names = list(action_names)
    return text_space(max(len(name) for name in names) + 8, names)


def step_info(*, valid: bool, effective: bool, success: bool) -> dict[str, Any]:
    """The ``info`` dict of every ``step`` (keys fixed by ``envs.base``)."""
    return {"action_is_valid": valid, "action_is_effective": effective, "success": success}


def direction_words(src: tuple[int, int], dst: tuple[int, int]) -> str:
    """Where ``dst`` lies from ``src`` ((row, col) each) in action names: "Down 2 and Left 1",
    "Up 3", or "" when they are the same cell."""
    (row, col), (dst_row, dst_col) = src, dst
    return " and ".join(
        f"{name} {abs(delta)}"
        for name, delta in (
            ("Down" if dst_row > row else "Up", dst_row - row),
            ("Right" if dst_col > col else "Left", dst_col - col),
        )
        if delta
    )

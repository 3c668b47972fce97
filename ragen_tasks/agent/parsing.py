"""Parsing of the agent's answer: ``<think>..</think><answer>A1 || A2</answer>`` -> action names.

Two steps, both pure and total (they never raise on any text):

1. ``parse_response(text, think=...)`` checks the tags and splits the answer on ``||``.
   Think mode needs exactly ``<think>..</think>`` then ``<answer>..</answer>`` (whitespace around
   them is allowed, nothing else); no-think mode needs ``<answer>..</answer>`` only (a ``<think>``
   block there is a format error). An answer with no action, or an empty action between ``||``,
   is a format error.
2. ``map_actions(actions, action_names, max_actions=...)`` cuts the list to ``max_actions`` (extra
   actions are dropped silently: they are not executed and not judged), then maps each action to
   its canonical name case-insensitively (``envs.base.canonical_action``).

Decision on invalid actions: actions run in order, so the valid actions BEFORE the first invalid
one are kept (and executed by the loop); the first invalid action and everything after it are
dropped, and the turn is a format error (it costs the format penalty). This matches the original
RAGEN behaviour of executing the valid part, while "consume the turn" still holds: the turn ends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ragen_tasks.envs.base import canonical_action

ACTION_SEPARATOR = "||"
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_THINK_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_NO_THINK_RE = re.compile(r"\s*<answer>(.*?)</answer>\s*", re.DOTALL)


@dataclass(frozen=True)
class ParsedResponse:
    """The answer of one turn, before it is checked against the game's action names."""

    ok: bool  # the tags were well formed and the answer held at least one non-empty action
    think: str  # text inside <think>..</think>, stripped ("" if none or on a format error)
    actions: tuple[str, ...]  # raw action strings, stripped, in order (empty on a format error)
    error: str  # why ok is False ("" when ok)


def _fail(error: str, think: str = "") -> ParsedResponse:
    return ParsedResponse(ok=False, think=think, actions=(), error=error)


def parse_response(text: str, *, think: bool) -> ParsedResponse:
    """Parse one response. Never raises; a malformed answer gives ``ok=False`` and an ``error``."""
    match = (_THINK_RE if think else _NO_THINK_RE).fullmatch(text)
    if match is None:
        wanted = "<think>..</think><answer>..</answer>" if think else "<answer>..</answer>"
        return _fail(f"expected {wanted}")
    thought = match.group(1).strip() if think else ""
    answer = match.group(2 if think else 1)
    if any(tag in answer for tag in _TAGS) or any(tag in thought for tag in _TAGS):
        return _fail("nested or repeated tags", thought)
    pieces = [piece.strip() for piece in answer.split(ACTION_SEPARATOR)]
    if not any(pieces):
        return _fail("the answer holds no action", thought)
    if not all(pieces):
        return _fail(f"empty action between {ACTION_SEPARATOR!r}", thought)
    return ParsedResponse(ok=True, think=thought, actions=tuple(pieces), error="")


def map_actions(actions: Sequence[str], action_names: Sequence[str], *, max_actions: int) -> tuple[list[str], bool]:
    """Cut ``actions`` to ``max_actions``, map them to canonical names; stop at the first invalid one.

    Returns ``(canonical names of the valid prefix, every kept action was valid)``.
    """
    if max_actions < 0:
        raise ValueError(f"max_actions={max_actions} must be >= 0")
    mapped: list[str] = []
    for raw in actions[:max_actions]:
        name = canonical_action(raw, action_names)
        if name is None:
            return mapped, False
        mapped.append(name)
    return mapped, True

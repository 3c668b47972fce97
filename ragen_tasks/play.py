"""Play a game in the terminal, seeing exactly the board text the agent sees.

``play_episode`` reads one action per line from any iterable of lines (stdin in ``ragen play``,
a list in tests) and writes through a callback, so it has no terminal dependency. Empty lines are
ignored, ``help`` shows the legend, ``quit`` stops, end of input stops cleanly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from ragen_tasks.envs.base import TextGame, canonical_action

QUIT_WORDS = frozenset({"quit", "exit", "q"})
HELP_WORDS = frozenset({"help", "?"})


@dataclass(frozen=True)
class PlaySummary:
    """How a played episode ended."""

    total_reward: float
    actions: int  # valid actions taken
    success: bool
    ended: str  # "terminated", "truncated", "quit" or "end of input"


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["dim_room=[8, 8]", "num_boxes=2"]`` -> ``{"dim_room": [8, 8], "num_boxes": 2}``.

    Values are YAML, except multi-line values or values starting with ``#`` (a room's text form),
    which are kept as strings.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set num_boxes=2")
        if "\n" in value or value.lstrip().startswith("#"):
            options[key.strip()] = value
            continue
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ValueError(f"--set {item!r}: the value is not valid YAML ({err})") from None
    return options


def _actions_line(env: TextGame) -> str:
    return "Valid actions: " + ", ".join(env.action_names)


def play_episode(env: TextGame, lines: Iterable[str], write: Callable[[str], None], *, seed: int) -> PlaySummary:
    """Reset ``env`` with ``seed`` and play one episode from ``lines`` (one action per line)."""
    obs, _ = env.reset(seed=seed)
    write(f"{env.name} (seed {seed})\n{obs}\n{_actions_line(env)}")
    total, actions, success = 0.0, 0, False
    for line in lines:
        text = line.strip()
        if not text:
            continue
        name = canonical_action(text, env.action_names)
        if name is None:
            word = text.casefold()
            if word in QUIT_WORDS:
                return PlaySummary(total, actions, success, "quit")
            if word in HELP_WORDS:
                legend = ", ".join(f"{symbol} = {meaning}" for symbol, meaning in env.legend.items())
                write((f"Legend: {legend}\n" if legend else "") + f"{_actions_line(env)}; 'quit' to stop.")
            else:
                write(f"{text!r} is not a valid action. {_actions_line(env)} (case does not matter; 'help', 'quit').")
            continue
        obs, reward, terminated, truncated, info = env.step(name)
        total += float(reward)
        actions += 1
        success = bool(info["success"])
        note = "" if info["action_is_effective"] else " (no effect)"
        write(f"{name}: reward {reward:g}{note}\n{obs}")
        if terminated or truncated:
            ended = "terminated" if terminated else "truncated"
            verdict = "success" if success else ("out of actions" if truncated else "failed")
            write(f"Episode over ({verdict}): total reward {total:g} in {actions} action(s).")
            return PlaySummary(total, actions, success, ended)
        write(_actions_line(env))
    write(f"End of input: total reward {total:g} in {actions} action(s).")
    return PlaySummary(total, actions, success, "end of input")

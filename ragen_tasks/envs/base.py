"""The contract every RAGEN game keeps. The agent layer (prompts, parsing) relies on nothing else.

A game is a ``gymnasium.Env[str, str]``:

* ``reset(*, seed, options) -> (observation, info)`` and
  ``step(action) -> (observation, reward, terminated, truncated, info)``;
  observations are the text board (``render()``), actions are ONE action name per ``step``
  (multi-action turns are the agent layer's job). All randomness comes from ``self.np_random``.
* ``action_names``: the canonical valid action names for the current episode, in the order the
  prompt should list them (for Bandit they depend on the seed). Matching is case-insensitive and
  ignores surrounding whitespace; ``canonical_action`` does that mapping.
* ``legend``: symbol -> meaning, for the prompt's legend of the board (Sokoban's symbol set is
  configurable, so the legend belongs to the game instance, the wording of the prompt does not).
* ``info`` after every ``step`` holds ``action_is_valid`` (the name mapped to an action),
  ``action_is_effective`` (the state changed), ``success`` (the task is solved); ``reset``'s info
  holds ``success=False``.
* An invalid action leaves the state unchanged, gives reward 0 and does not count towards
  ``max_actions_per_episode``; the format penalty is applied by the agent layer.
* Hitting ``max_actions_per_episode`` sets ``truncated=True``.

Prompt text (instructions, answer format) lives in ``ragen_tasks.agent``, never here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import gymnasium as gym

from ragen_tasks.envs._common import GameConfig


def canonical_action(text: str, action_names: Sequence[str]) -> str | None:
    """Map ``text`` to one of ``action_names`` case-insensitively (whitespace stripped), else None."""
    wanted = text.strip().casefold()
    for name in action_names:
        if name.casefold() == wanted:
            return name
    return None


class TextGame(gym.Env[str, str]):
    """Base class for the text games: holds the shared contract, no game logic."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012 (gymnasium declares it an instance attribute)
    #: Registry name of the game, e.g. ``"sokoban"``.
    name: ClassVar[str] = ""
    #: The game's validated options (its own ``GameConfig`` subclass), ``max_actions_per_episode`` among them.
    config: GameConfig

    @property
    def action_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def legend(self) -> Mapping[str, str]:
        raise NotImplementedError

    def render(self) -> str:
        raise NotImplementedError

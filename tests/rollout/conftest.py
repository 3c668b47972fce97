"""Fixtures for rollout tests: a toy game (the ``chatml_tokenizer`` fixture lives in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from ragen_tasks.envs.base import TextGame, canonical_action

# ---------------------------------------------------------------------------------------------
# A tiny TextGame for loop tests (independent of the real games).


class LineWalk(TextGame):
    """Walk on a line of ``size`` cells from P to G. Reward 1 at G (terminated, success)."""

    name = "line_walk"

    def __init__(self, size: int = 6, max_actions_per_episode: int = 10) -> None:
        self.size = size
        self.max_actions = max_actions_per_episode
        self.pos = self.goal = self.used = 0

    @property
    def action_names(self) -> tuple[str, ...]:
        return ("Left", "Right")

    @property
    def legend(self) -> Mapping[str, str]:
        return {"P": "player", "G": "goal", "_": "empty"}

    def render(self) -> str:
        return "".join("P" if i == self.pos else "G" if i == self.goal else "_" for i in range(self.size))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos, self.goal = (int(x) for x in self.np_random.choice(self.size, size=2, replace=False))
        self.used = 0
        return self.render(), {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        name = canonical_action(action, self.action_names)
        if name is None:
            return (
                self.render(),
                0.0,
                False,
                False,
                {"action_is_valid": False, "action_is_effective": False, "success": False},
            )
        old = self.pos
        self.pos = max(0, self.pos - 1) if name == "Left" else min(self.size - 1, self.pos + 1)
        self.used += 1
        success = self.pos == self.goal
        info = {"action_is_valid": True, "action_is_effective": self.pos != old, "success": success}
        return self.render(), 1.0 if success else 0.0, success, (not success) and self.used >= self.max_actions, info


def line_walk_factory(name: str, config: Mapping[str, Any]) -> TextGame:
    assert name == "line_walk", name
    return LineWalk(**dict(config))


@pytest.fixture
def line_walk() -> Any:
    return line_walk_factory

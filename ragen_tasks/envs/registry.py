"""Games by name: ``make(name, **config)`` is the one entry point (every entry has the same signature)."""

from __future__ import annotations

from typing import Any

from ragen_tasks.envs._common import GameConfig
from ragen_tasks.envs.bandit import BanditConfig, BanditEnv
from ragen_tasks.envs.base import TextGame
from ragen_tasks.envs.frozen_lake import FrozenLakeConfig, FrozenLakeEnv
from ragen_tasks.envs.sokoban import SokobanConfig, SokobanEnv

#: name -> (game class, its config model). Add a line here for a new game.
_REGISTRY: dict[str, tuple[type[TextGame], type[GameConfig]]] = {
    "bandit": (BanditEnv, BanditConfig),
    "sokoban": (SokobanEnv, SokobanConfig),
    "frozen_lake": (FrozenLakeEnv, FrozenLakeConfig),
}

ENV_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def _lookup(name: str) -> tuple[type[TextGame], type[GameConfig]]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown env {name!r}; valid names: {', '.join(ENV_NAMES)}") from None


def config_model(name: str) -> type[GameConfig]:
    """The frozen pydantic model validating ``make(name, **config)``'s keyword options."""
    return _lookup(name)[1]


def has_solver(name: str) -> bool:
    """Whether the game can compute the shortest solution of its initial state (``solve()``)."""
    return callable(getattr(_lookup(name)[0], "solve", None))


def make(name: str, **config: Any) -> TextGame:
    """A ready game: ``make("sokoban", dim_room=(8, 8), num_boxes=2)``. Call ``reset(seed=...)`` next.

    Raises ``ValueError`` for an unknown name (listing the valid ones) or a bad option (naming
    ``game.field=value`` and the allowed values).
    """
    env_class, _ = _lookup(name)
    return env_class(**config)

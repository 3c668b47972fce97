"""The RAGEN text games (``gymnasium.Env[str, str]``): Bandit, Sokoban, FrozenLake, resolved by name.

``make(name, **config)`` returns a ready game; ``ENV_NAMES`` lists the names. The contract every
game keeps is in ``ragen_tasks.envs.base``.
"""

from ragen_tasks.envs.base import TextGame, canonical_action
from ragen_tasks.envs.registry import ENV_NAMES, config_model, make

__all__ = ["ENV_NAMES", "TextGame", "canonical_action", "config_model", "make"]

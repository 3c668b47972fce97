"""Two-armed bandit: the single-turn, stochastic RAGEN game.

The agent sees the two arm names (in a seed-randomised order) and pulls one. The payoffs are NOT in
the observation: the agent has to learn which arm is better from rewards (and from what the names
evoke, which is what held-out name pairs probe).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from ragen_tasks.envs._common import GameConfig, action_space, load_config, step_info, text_space
from ragen_tasks.envs.base import TextGame, canonical_action

#: Arm-name pairs (low-risk, high-risk) kept out of training to test generalisation.
HELD_OUT_ARM_NAMES: tuple[tuple[str, str], ...] = (("Trader", "Librarian"), ("Tortoise", "Hare"))

#: Longest arm name accepted (the observation space is sized from it).
MAX_NAME_LENGTH = 40


class BanditConfig(GameConfig):
    """Bandit options. Index 0 is the low-risk arm, index 1 the high-risk arm."""

    arm_names: tuple[str, str] = Field(
        ("Phoenix", "Dragon"),
        description="(low-risk, high-risk) arm names; see HELD_OUT_ARM_NAMES for the held-out pairs",
    )
    payoffs: tuple[float, float] = Field(
        (0.1, 1.0), description="reward of each arm when it pays (the paper's text says 0.15 for the low-risk arm)"
    )
    probabilities: tuple[float, float] = Field(
        (1.0, 0.25), description="probability that each arm pays its payoff (else 0), each in [0, 1]"
    )
    max_actions_per_episode: int = Field(
        10, ge=1, description="valid actions per episode; the first valid pull ends the episode anyway"
    )

    @field_validator("arm_names")
    @classmethod
    def _names_ok(cls, names: tuple[str, str]) -> tuple[str, str]:
        for name in names:
            if not name.strip() or name != name.strip() or "\n" in name or len(name) > MAX_NAME_LENGTH:
                raise ValueError(
                    f"each arm name must be 1..{MAX_NAME_LENGTH} characters, one line, no surrounding spaces"
                )
        if names[0].casefold() == names[1].casefold():
            raise ValueError("the two arm names must differ (case-insensitively)")
        return names

    @field_validator("payoffs")
    @classmethod
    def _payoffs_ok(cls, payoffs: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(x) for x in payoffs):
            raise ValueError("payoffs must be finite numbers")
        return payoffs

    @field_validator("probabilities")
    @classmethod
    def _probabilities_ok(cls, probabilities: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= p <= 1.0 for p in probabilities):
            raise ValueError("each probability must be in [0, 1]")
        return probabilities

    @property
    def expected_values(self) -> tuple[float, float]:
        return (self.payoffs[0] * self.probabilities[0], self.payoffs[1] * self.probabilities[1])


class BanditEnv(TextGame):
    """Pull one of two arms once.

    ## Action Space
    One of the two arm names (``action_names``, seed-randomised order), case-insensitive.

    ## Observation
    ``"Arms: A, B"``; after the pull a second line ``"You pulled A: reward R"``. The payoffs and
    probabilities are never shown.

    ## Rewards
    The pulled arm's payoff with its probability, else 0. An invalid action gives 0.

    ## Episode End
    Terminated after the first valid pull. ``info["success"]`` is True when the pulled arm has the
    higher (or an equal) expected value.

    ## Arguments
    See ``BanditConfig`` (``arm_names``, ``payoffs``, ``probabilities``, ``max_actions_per_episode``).
    """

    name = "bandit"
    config: BanditConfig
    render_mode = "ansi"

    def __init__(self, config: BanditConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = load_config(BanditConfig, self.name, overrides)
        elif overrides:
            raise ValueError(f"bandit: pass either a BanditConfig or keyword options, not both ({sorted(overrides)})")
        self.config = config
        #: The two arm names in config order (low-risk, high-risk).
        self.arm_names: tuple[str, str] = config.arm_names
        self._order: tuple[str, str] = config.arm_names
        self._pulled: str | None = None
        self._reward = 0.0
        longest = max(len(name) for name in config.arm_names)
        payoff_width = max(len(f"{p:g}") for p in (*config.payoffs, 0.0))
        self.observation_space = text_space(32 + 3 * longest + payoff_width, config.arm_names)
        self.action_space = action_space(config.arm_names)

    @property
    def action_names(self) -> tuple[str, ...]:
        return self._order

    @property
    def legend(self) -> Mapping[str, str]:
        return {}

    def render(self) -> str:
        text = "Arms: " + ", ".join(self._order)
        if self._pulled is not None:
            text += f"\nYou pulled {self._pulled}: reward {self._reward:g}"
        return text

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        names = self.config.arm_names
        swap = bool(self.np_random.integers(2))
        self._order = (names[1], names[0]) if swap else names
        self._pulled = None
        self._reward = 0.0
        return self.render(), {"success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        done = self._pulled is not None
        name = canonical_action(action, self._order) if isinstance(action, str) else None
        if done or name is None:  # after the pull, or an invalid name: nothing changes
            info = step_info(valid=name is not None, effective=False, success=self._is_success(self._pulled))
            return self.render(), 0.0, done, False, info
        arm = self.config.arm_names.index(name)
        pays = self.np_random.random() < self.config.probabilities[arm]
        self._reward = float(self.config.payoffs[arm]) if pays else 0.0
        self._pulled = name
        info = step_info(valid=True, effective=True, success=self._is_success(name))
        return self.render(), self._reward, True, False, info

    def _is_success(self, pulled: str | None) -> bool:
        if pulled is None:
            return False
        ev = self.config.expected_values
        arm = self.config.arm_names.index(pulled)
        return ev[arm] >= ev[1 - arm]

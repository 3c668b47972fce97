"""Bandit: seed-randomised arm order, payoffs never shown, success = higher-EV arm, held-out names."""

from __future__ import annotations

import math

import pytest

from ragen_tasks.envs import make
from ragen_tasks.envs.bandit import HELD_OUT_ARM_NAMES, BanditEnv


def test_arm_order_depends_on_the_seed_and_obs_reveals_nothing() -> None:
    env = make("bandit")
    assert isinstance(env, BanditEnv)
    orders = set()
    for seed in range(40):
        obs, info = env.reset(seed=seed)
        orders.add(env.action_names)
        assert obs == "Arms: " + ", ".join(env.action_names)
        assert not any(ch.isdigit() for ch in obs), "payoffs/probabilities must not be in the observation"
        assert info == {"success": False}
    assert orders == {("Phoenix", "Dragon"), ("Dragon", "Phoenix")}
    assert env.arm_names == ("Phoenix", "Dragon")


@pytest.mark.parametrize(("arm", "payoff", "p", "success"), [("Phoenix", 0.1, 1.0, False), ("dragon", 1.0, 0.25, True)])
def test_rewards_follow_payoff_and_probability(arm: str, payoff: float, p: float, success: bool) -> None:
    env = make("bandit")
    n = 2000
    rewards = []
    for seed in range(n):
        env.reset(seed=seed)
        obs, reward, terminated, truncated, info = env.step(arm)
        assert terminated and not truncated and info["success"] is success and info["action_is_effective"]
        assert reward in (0.0, payoff)
        assert obs.endswith(f"reward {reward:g}")
        rewards.append(reward)
    mean = sum(rewards) / n
    assert abs(mean - payoff * p) < 5 * payoff * math.sqrt(p * (1 - p) / n) + 1e-12


def test_invalid_action_changes_nothing_and_episode_ends_after_one_pull() -> None:
    env = make("bandit")
    obs0, _ = env.reset(seed=0)
    assert env.step("Unicorn") == (
        obs0,
        0.0,
        False,
        False,
        {"action_is_valid": False, "action_is_effective": False, "success": False},
    )
    obs, _, terminated, _, _ = env.step(" PHOENIX ")
    assert terminated and "You pulled Phoenix" in obs
    again = env.step("Dragon")
    assert again[1] == 0.0 and again[2] and not again[4]["action_is_effective"]


def test_held_out_names_and_equal_ev_success() -> None:
    assert ("Trader", "Librarian") in HELD_OUT_ARM_NAMES
    env = make("bandit", arm_names=("Trader", "Librarian"))
    env.reset(seed=1)
    assert set(env.action_names) == {"Trader", "Librarian"}
    assert env.step("librarian")[4]["success"]
    env = make("bandit", payoffs=(0.15, 0.6), probabilities=(1.0, 0.25))  # EV 0.15 vs 0.15: both count
    env.reset(seed=0)
    assert env.step("Phoenix")[4]["success"]

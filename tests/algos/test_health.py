"""Echo-Trap health metrics from plain sequences and from Trajectory objects."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_tasks.algos import mean_metrics, rollout_health, rollout_health_from_trajectories, staleness_health
from ragen_tasks.data.synthetic import trajectory
from ragen_tasks.data.trajectory import Trajectory


def _traj(i: int, group: int, reward: float, think: list[str], fmt: list[bool], n_resp: int) -> Trajectory:
    n_turns = len(think)
    t = 2 + n_resp
    return trajectory(
        list(range(t)),
        [0, 0] + [1] * n_resp,
        [2] * n_turns,
        [t] * n_turns,
        [reward] + [0.0] * (n_turns - 1),
        prompt_length=2,
        traj_id=f"t{i}",
        env_name="bandit",
        seed=group,
        group_id=group,
        weights_fingerprint="x",
        turn_format_ok=fmt,
        turn_think=think,
        success=reward > 0,
    )


def test_rollout_health_hand_computed() -> None:
    h = rollout_health(
        rewards=[1.0, 0.0, 0.5, 0.5],
        group_ids=[0, 0, 1, 1],
        successes=[True, False, False, False],
        response_lengths=[4, 6, 10, 0],
        think_lengths=[3.0, 0.0, 1.0, 0.0],
        turn_think_nonempty=[[True, False], [False], [True], [False, False, False]],
        turn_format_ok=[[True, True], [False], [True], [True, False, True]],
    )
    assert h["rollout/in_group_std"] == pytest.approx(math.sqrt(0.5) / 2)
    assert h["rollout/in_group_std_max"] == pytest.approx(math.sqrt(0.5))
    assert h["rollout/zero_std_group_fraction"] == 0.5
    assert h["rollout/reward_mean"] == pytest.approx(0.5)
    assert h["rollout/reward_std"] == pytest.approx(float(torch.tensor([1.0, 0.0, 0.5, 0.5]).std()))
    assert h["rollout/success"] == 0.25
    assert h["rollout/response_length"] == 5.0
    assert h["rollout/response_length_max"] == 10.0
    assert h["rollout/think_length"] == 1.0
    assert h["rollout/think_fraction"] == pytest.approx(2 / 7)
    assert h["rollout/format_error_rate"] == pytest.approx(2 / 7)
    assert h["rollout/turns"] == pytest.approx(7 / 4)
    assert h["rollout/num_groups"] == 2


def test_rollout_health_errors_and_empty() -> None:
    with pytest.raises(ValueError, match="successes has 1 entries"):
        rollout_health([1.0, 2.0], [0, 0], [True], [1, 1], [0, 0], [[True], [True]], [[True], [True]])
    empty = rollout_health([], [], [], [], [], [], [])
    assert all(v == 0.0 for v in empty.values())


def test_from_trajectories_matches_plain_call() -> None:
    trajs = [
        _traj(0, 0, 1.0, ["go left", "  "], [True, False], 5),
        _traj(1, 0, 0.0, [""], [False], 3),
        _traj(2, 1, 0.2, ["abc"], [True], 4),
    ]
    for t in trajs:
        t.check()
    got = rollout_health_from_trajectories(trajs)
    want = rollout_health(
        [1.0, 0.0, 0.2],
        [0, 0, 1],
        [True, False, True],
        [5, 3, 4],
        [3.5, 0.0, 3.0],
        [[True, False], [False], [True]],
        [[True, False], [False], [True]],
    )
    assert got == pytest.approx(want)


def test_a_mixture_also_gets_per_game_metrics() -> None:
    from dataclasses import replace

    trajs = [
        _traj(0, 0, 1.0, ["a"], [True], 3),
        _traj(1, 0, 0.0, ["b"], [True], 3),
        replace(_traj(2, 1, 1.0, ["c", "d"], [False, True], 3), env_name="frozen_lake"),
    ]
    got = rollout_health_from_trajectories(trajs)
    assert got["rollout/bandit/success"] == 0.5 and got["rollout/frozen_lake/success"] == 1.0
    assert got["rollout/bandit/reward_mean"] == 0.5 and got["rollout/frozen_lake/format_error_rate"] == 0.5
    assert got["rollout/success"] == pytest.approx(2 / 3)  # the mixture's own metrics are unchanged
    assert not any(k.startswith("rollout/bandit/") for k in rollout_health_from_trajectories(trajs[:2]))


def test_staleness_and_mean_metrics() -> None:
    assert staleness_health([3, 5, 5], 5) == {"rollout/staleness_mean": 2 / 3, "rollout/staleness_max": 2.0}
    avg = mean_metrics([{"actor/entropy": torch.tensor(1.0), "a": 2.0}, {"actor/entropy": torch.tensor(3.0)}])
    assert avg == {"actor/entropy": 2.0, "a": 2.0}

"""The loop on the real games (bandit, sokoban, frozen_lake) with scripted answers."""

from __future__ import annotations

import pytest

from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.data.trajectory import TrajectoryStatus
from ragen_tasks.envs import make
from ragen_tasks.rollout.engine import SamplingParams
from ragen_tasks.rollout.loop import make_group_tasks, run_rollouts
from ragen_tasks.rollout.scripted import ScriptedEngine

AGENT = AgentConfig(max_turns=6, max_actions_per_turn=3, max_actions_per_episode=18, max_context_tokens=4096)
SAMPLING = SamplingParams(max_new_tokens=64)


def _answer(actions: list[str]) -> str:
    return "<think>plan</think><answer>" + " || ".join(actions) + "</answer>"


def test_solver_script_solves_sokoban_groups(chatml_tokenizer) -> None:
    tasks = make_group_tasks([EnvSpec(name="sokoban")], groups=3, group_size=2, seed=0, iteration=0)
    plans = {}
    for t in tasks:
        env = make("sokoban", max_actions_per_episode=18)
        env.reset(seed=t.seed)
        plans[t.traj_id] = env.solve()
        assert plans[t.traj_id] is not None and len(plans[t.traj_id]) <= 18

    def reply(sid: str, i: int) -> str:
        return _answer(plans[sid][3 * i : 3 * i + 3])

    engine = ScriptedEngine(chatml_tokenizer, reply)
    tasks = [t.__class__(t.traj_id, t.env_name, {"max_actions_per_episode": 18}, t.seed, t.group_id) for t in tasks]
    trajs = run_rollouts(
        engine, chatml_tokenizer, tasks, agent=AGENT, sampling=SAMPLING, policy_version=1, weights_fingerprint="w"
    )
    for traj in trajs:
        plan = plans[traj.traj_id]
        if len(plan) > 3 * AGENT.max_turns:
            continue
        assert traj.success and traj.status == TrajectoryStatus.TERMINATED, traj.turn_responses
        assert [a for turn in traj.turn_actions for a in turn] == plan
        assert all(traj.turn_format_ok)
        assert traj.reward == pytest.approx(sum(traj.turn_rewards)) and traj.reward > 9  # +10 for solving
    # a group shares the initial state: same board, same deterministic play
    by_group = {}
    for traj in trajs:
        by_group.setdefault(traj.group_id, []).append(traj)
    for group in by_group.values():
        assert len({g.turn_observations[0] for g in group}) == 1
        assert len({tuple(g.input_ids) for g in group}) == 1


def test_mixed_groups_of_all_three_games(chatml_tokenizer) -> None:
    specs = [EnvSpec(name="bandit"), EnvSpec(name="sokoban"), EnvSpec(name="frozen_lake")]
    tasks = make_group_tasks(specs, groups=3, group_size=4, seed=1, iteration=5)
    names = {t.traj_id: t.env_name for t in tasks}

    def reply(sid: str, i: int) -> str:
        if names[sid] == "bandit":
            return _answer(["phoenix"])  # case-insensitive mapping
        return _answer(["Left", "Down", "Right"] if i % 2 == 0 else ["Up", "Right", "Down"])

    engine = ScriptedEngine(chatml_tokenizer, reply)
    trajs = run_rollouts(
        engine, chatml_tokenizer, tasks, agent=AGENT, sampling=SAMPLING, policy_version=2, weights_fingerprint="w"
    )
    assert [t.traj_id for t in trajs] == [t.traj_id for t in tasks]
    for traj in trajs:
        traj.check()
        if traj.env_name == "bandit":
            assert traj.num_turns == 1 and traj.status == TrajectoryStatus.TERMINATED
            assert traj.turn_actions == [["Phoenix"]] and traj.turn_format_ok == [True]
            assert "Phoenix" in chatml_tokenizer.decode(traj.input_ids[: traj.prompt_length])
        else:
            assert traj.status in {s.value for s in TrajectoryStatus}
            assert 1 <= traj.num_turns <= AGENT.max_turns
    assert sorted(engine.released) == sorted(names)

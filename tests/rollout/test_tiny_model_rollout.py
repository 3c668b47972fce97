"""End to end with the real tiny model: all three games, token-in/token-out log-probs, determinism."""

from __future__ import annotations

import pytest
import torch

from ragen_tasks.config import AgentConfig, EnvSpec
from ragen_tasks.data.trajectory import TrajectoryStatus
from ragen_tasks.rollout.engine import SamplingParams
from ragen_tasks.rollout.loop import make_group_tasks, run_rollouts

models = pytest.importorskip("ragen_tasks.models")
hf_engine = pytest.importorskip("ragen_tasks.rollout.hf_engine")

AGENT = AgentConfig(max_turns=2, max_tokens_per_turn=12, max_context_tokens=1024)
SPECS = [EnvSpec(name="bandit"), EnvSpec(name="sokoban"), EnvSpec(name="frozen_lake")]


@pytest.fixture(scope="module")
def policy():
    model, tok = models.load_policy("tiny", dtype="float32", device="cpu")
    return model, tok


def _rollout(model, tok, seed: int, temperature: float = 0.7):
    tasks = make_group_tasks(SPECS, groups=3, group_size=2, seed=seed, iteration=0)
    engine = hf_engine.HFEngine(model, tok, seed=seed)
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature, seed=seed)
    return run_rollouts(engine, tok, tasks, agent=AGENT, sampling=sampling, policy_version=0, weights_fingerprint="t")


@pytest.fixture(scope="module")
def rollouts(policy):
    model, tok = policy
    return _rollout(model, tok, seed=11)


def test_groups_of_all_three_games_roll_out(rollouts) -> None:
    assert sorted({t.env_name for t in rollouts}) == ["bandit", "frozen_lake", "sokoban"]
    for traj in rollouts:
        traj.check()
        assert traj.status in {s.value for s in TrajectoryStatus}
        assert traj.response_length > 0 and traj.loss_mask == traj.response_mask
        assert all(0 < e - s <= 12 for s, e in zip(traj.turn_starts, traj.turn_ends, strict=True))
    by_group = {}
    for traj in rollouts:
        by_group.setdefault(traj.group_id, set()).add(traj.turn_observations[0])
    assert all(len(boards) == 1 for boards in by_group.values())  # a group shares its initial state


def test_rollout_logprobs_match_a_forward_pass(policy, rollouts) -> None:
    model, _ = policy
    for traj in rollouts:
        ids = torch.tensor([traj.input_ids])  # (1, T)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()  # (1, T, V)
        logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,) log p(t | <t)
        mask = torch.tensor(traj.response_mask[1:], dtype=torch.bool)  # 1 = sampled token
        rollout = torch.tensor(traj.rollout_logprobs[1:])
        assert mask.any()
        torch.testing.assert_close(logp[mask], rollout[mask], atol=1e-4, rtol=0)


def test_same_seed_same_trajectories(policy, rollouts) -> None:
    model, tok = policy
    again = _rollout(model, tok, seed=11)
    assert [t.input_ids for t in again] == [t.input_ids for t in rollouts]
    assert [t.rollout_logprobs for t in again] == [t.rollout_logprobs for t in rollouts]
    assert [t.turn_rewards for t in again] == [t.turn_rewards for t in rollouts]
    other = _rollout(model, tok, seed=12)
    assert [t.input_ids for t in other] != [t.input_ids for t in rollouts]


@pytest.mark.gpu
def test_cuda_rollout_logprobs_match_a_forward_pass_and_repeat() -> None:
    """The same token-in/token-out contract on a CUDA device (fp32): stored log-probs equal a forward
    pass on the stored sequence, and a fixed seed reproduces the trajectories."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, tok = models.load_policy("tiny", dtype="float32", device="cuda")
    rollouts = _rollout(model, tok, seed=11)
    for traj in rollouts:
        ids = torch.tensor([traj.input_ids], device="cuda")  # (1, T)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()  # (1, T, V)
        logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()  # (T-1,)
        mask = torch.tensor(traj.response_mask[1:], dtype=torch.bool)  # 1 = sampled token
        torch.testing.assert_close(logp[mask], torch.tensor(traj.rollout_logprobs[1:])[mask], atol=1e-4, rtol=0)
    again = _rollout(model, tok, seed=11)
    assert [t.input_ids for t in again] == [t.input_ids for t in rollouts]

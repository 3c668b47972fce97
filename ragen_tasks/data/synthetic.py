"""Synthetic trajectories, consistent by construction (no model, no env): for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragen_tasks.data.trajectory import Trajectory


def trajectory(
    input_ids: Sequence[int],
    response_mask: Sequence[int],
    turn_starts: Sequence[int],
    turn_ends: Sequence[int],
    turn_rewards: Sequence[float],
    *,
    prompt_length: int,
    traj_id: str = "t0",
    env_name: str = "synthetic",
    seed: int = 0,
    group_id: int = 0,
    policy_version: int = 0,
    weights_fingerprint: str = "",
    rollout_logprobs: Sequence[float] | None = None,
    turn_actions: Sequence[Sequence[str]] | None = None,
    turn_format_ok: Sequence[bool] | None = None,
    turn_think: Sequence[str] | None = None,
    turn_responses: Sequence[str] | None = None,
    turn_observations: Sequence[str] | None = None,
    success: bool = False,
    status: str = "terminated",
) -> Trajectory:
    """A trajectory from its tokens and turns; everything else defaults to a plain, valid value.

    ``response_mask``: 1 = token the policy sampled (the loss mask is the same); the reward is the
    sum of ``turn_rewards``; per-turn text is empty, every turn's format ok, no actions.
    """
    turns = len(turn_starts)
    return Trajectory(
        traj_id=traj_id,
        env_name=env_name,
        seed=seed,
        group_id=group_id,
        policy_version=policy_version,
        weights_fingerprint=weights_fingerprint,
        input_ids=list(input_ids),
        response_mask=list(response_mask),
        loss_mask=list(response_mask),
        rollout_logprobs=list(rollout_logprobs) if rollout_logprobs is not None else [0.0] * len(input_ids),
        turn_starts=list(turn_starts),
        turn_ends=list(turn_ends),
        turn_rewards=list(turn_rewards),
        turn_actions=[list(a) for a in turn_actions] if turn_actions is not None else [[] for _ in range(turns)],
        turn_format_ok=list(turn_format_ok) if turn_format_ok is not None else [True] * turns,
        turn_think=list(turn_think) if turn_think is not None else [""] * turns,
        turn_responses=list(turn_responses) if turn_responses is not None else [""] * turns,
        turn_observations=list(turn_observations) if turn_observations is not None else [""] * turns,
        reward=sum(turn_rewards),
        success=success,
        status=status,
        prompt_length=prompt_length,
    )


def turn_layout(tokens: int, prompt: int, turns: int) -> tuple[list[int], list[int], list[int]]:
    """``(response_mask, turn_starts, turn_ends)`` of a ``tokens``-long episode: ``prompt`` prompt
    tokens, then per turn an equal share split into a response span (half of it, at least one
    token) and an observation span; tokens left over at the end are observation."""
    span = (tokens - prompt) // turns
    resp = max(1, span // 2)
    mask = [0] * prompt
    starts, ends = [], []
    for k in range(turns):
        starts.append(prompt + k * span)
        ends.append(prompt + k * span + resp)
        mask += [1] * resp + [0] * (span - resp)
    return mask + [0] * (tokens - len(mask)), starts, ends


def synthetic_trajectories(
    n_groups: int = 4,
    group_size: int = 4,
    seed: int = 0,
    *,
    vocab: int = 64,
    turns: int = 2,
    prompt_len: int = 6,
    resp_len: int = 4,
    obs_len: int = 3,
) -> list[Trajectory]:
    """Fixed multi-turn groups: per group a random prompt, then per turn sampled ids + observation
    ids (random in ``[2, vocab)``); rewards vary within a group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(n_groups):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        for k in range(group_size):
            ids, rmask = list(prompt), [0] * prompt_len
            starts, ends = [], []
            for _ in range(turns):
                starts.append(len(ids))
                ids += torch.randint(2, vocab, (resp_len,), generator=g).tolist()
                rmask += [1] * resp_len
                ends.append(len(ids))
                ids += torch.randint(2, vocab, (obs_len,), generator=g).tolist()
                rmask += [0] * obs_len
            ids, rmask = ids[: ends[-1]], rmask[: ends[-1]]  # a trajectory ends on the policy's last turn
            turn_rewards = [float((gid + k) % 3) / 2, 0.0 if k % 2 else -0.1][:turns] + [0.0] * max(0, turns - 2)
            out.append(
                trajectory(
                    ids,
                    rmask,
                    starts,
                    ends,
                    turn_rewards,
                    prompt_length=prompt_len,
                    traj_id=f"g{gid}-{k}",
                    seed=gid,
                    group_id=gid,
                )
            )
    return out

"""A small training driver for resume / crash tests and the update benchmark.

It trains a tiny randomly initialised Qwen2 model (built from a ``Qwen2Config``, nothing is
downloaded) on fixed synthetic trajectories, checkpointing every iteration, and resumes from the
latest committed checkpoint when one exists. Run::

    python -m ragen_tasks.training.resume_harness --root DIR --iterations 4 [--algo gae|grpo]

Crash injection for tests (the process SIGKILLs itself): ``--kill-after K`` right after the
checkpoint of iteration K commits; ``--kill-in-save K:write`` while the files of checkpoint K are
being written; ``--kill-in-save K:commit`` after checkpoint K's folder is renamed into place but
before its marker is written.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.token_batch import TokenBatch, collate
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.critic import make_critic
from ragen_tasks.training.update import ppo_update

VOCAB = 64


def tiny_actor(seed: int = 0, *, hidden: int = 64, layers: int = 2, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    """A Qwen2 model shaped like the ``tiny`` preset (small vocab), seeded init, float32."""
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def synthetic_trajectories(
    n_groups: int = 4,
    group_size: int = 4,
    seed: int = 0,
    *,
    vocab: int = VOCAB,
    turns: int = 2,
    prompt_len: int = 6,
    resp_len: int = 4,
    obs_len: int = 3,
) -> list[Trajectory]:
    """Fixed multi-turn trajectories: prompt, then per turn sampled ids + observation ids; varied rewards."""
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
                Trajectory(
                    traj_id=f"g{gid}-{k}",
                    env_name="synthetic",
                    seed=gid,
                    group_id=gid,
                    policy_version=0,
                    weights_fingerprint="",
                    input_ids=ids,
                    response_mask=rmask,
                    loss_mask=list(rmask),
                    rollout_logprobs=[0.0] * len(ids),
                    turn_starts=starts,
                    turn_ends=ends,
                    turn_rewards=turn_rewards,
                    turn_actions=[[] for _ in range(turns)],
                    turn_format_ok=[True] * turns,
                    turn_think=[""] * turns,
                    turn_responses=[""] * turns,
                    turn_observations=[""] * turns,
                    reward=sum(turn_rewards),
                    success=False,
                    status="terminated",
                    prompt_length=prompt_len,
                )
            )
    return out


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run(
    root: Path,
    iterations: int,
    *,
    algo_name: str = "gae",
    kill_after: int | None = None,
    kill_in_save: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """Train to ``iterations`` (resuming from ``root``'s latest committed checkpoint); return the last metrics."""
    algo = AlgoConfig.model_validate({"advantage": algo_name, "clip_high": 0.28, "filter_keep_ratio": 1.0})
    optim = OptimConfig(lr=1e-3, critic_lr=1e-3, ppo_epochs=2, minibatch_size=8, micro_batch_size=4)
    actor_module = tiny_actor(0)
    actor_opt = make_optimizer(actor_module, lr=optim.lr, weight_decay=optim.weight_decay)
    actor = make_train_model(actor_module, actor_opt, optim)
    critic = None
    optimizers: dict[str, Any] = {"actor": actor_opt}
    models: dict[str, torch.nn.Module] = {}
    if algo.advantage == "gae":
        critic_module = make_critic(actor_module)
        critic_opt = make_optimizer(critic_module, lr=optim.critic_lr, weight_decay=optim.weight_decay)
        critic = make_train_model(critic_module, critic_opt, optim)
        optimizers["critic"] = critic_opt
        models["critic"] = critic_module
    generator = torch.Generator().manual_seed(optim.seed)
    start = 0
    latest = ckpt.latest_checkpoint(root)
    if latest is not None:
        info = ckpt.load_checkpoint(latest.path, actor=actor_module, optimizers=optimizers, models=models)
        generator.set_state(info.extra_state["generator"])
        start = info.step
    batch: TokenBatch = collate(synthetic_trajectories())
    metrics: dict[str, Any] = {}
    for it in range(start + 1, iterations + 1):
        metrics = ppo_update(batch, actor=actor, critic=critic, algo=algo, optim=optim, generator=generator)
        if kill_in_save is not None and kill_in_save[0] == it:
            _arm_kill_in_save(kill_in_save[1])
        ckpt.save_checkpoint(
            root,
            it,
            actor=actor_module,
            optimizers=optimizers,
            models=models,
            extra_state={"generator": generator.get_state()},
            keep_last=2,
        )
        if kill_after == it:
            _kill_self()
    return metrics


def _arm_kill_in_save(point: str) -> None:
    """Make the next save SIGKILL this process at ``point`` ('write' or 'commit')."""
    if point == "write":
        real = torch.save

        def save_then_die(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
            real(obj, f, *a, **kw)
            _kill_self()

        torch.save = save_then_die  # checkpoint.py calls torch.save through the same module object
    elif point == "commit":
        ckpt.__dict__["sha256_file"] = lambda path: _kill_self()  # first call comes after the rename
    else:
        raise ValueError(f"kill point {point!r}: expected 'write' or 'commit'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--algo", choices=["gae", "grpo", "batch_norm"], default="gae")
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--kill-in-save", default=None, help="STEP:write or STEP:commit")
    args = parser.parse_args()
    kis = None
    if args.kill_in_save:
        step, point = args.kill_in_save.split(":")
        kis = (int(step), point)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    run(args.root, args.iterations, algo_name=args.algo, kill_after=args.kill_after, kill_in_save=kis)


if __name__ == "__main__":
    main()

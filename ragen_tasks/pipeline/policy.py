"""A committed policy at work: rollouts with the policy in a checkpoint folder, and its held-out
evaluation (deterministic given the seeds; its engine is handed at most ``EVAL_BLOCK_SEEDS`` episodes per
env evaluated at a time, so that its memory does not grow with the number of seeds).

Rollouts may be sharded (``rollout.shards`` local processes, or one shard per server of the openai
engine's ``engine_options.base_urls``): ``play_shard`` is what each shard runs, from plain data
only (the config, the checkpoint path, its tasks), so a spawned process builds its own engine.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ragen_tasks.config import EnvSpec, TrainConfig
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.evaluation import MAX_EVAL_SEEDS, aggregate
from ragen_tasks.models.loading import load_policy, load_tokenizer
from ragen_tasks.rollout.engine import SamplingParams
from ragen_tasks.rollout.loop import RolloutTask, make_eval_tasks, run_rollouts
from ragen_tasks.rollout.registry import make_engine
from ragen_tasks.rollout.shards import run_sharded
from ragen_tasks.training import checkpoint as ckpt

logger = logging.getLogger(__name__)

#: Seeds per env evaluated that an evaluation hands its engine at once (a block is
#: ``EVAL_BLOCK_SEEDS`` x envs episodes): an engine batches every episode it is handed
#: (the hf engine keeps each one's keys and values), so without blocks an evaluation's memory grows with
#: its seeds.
EVAL_BLOCK_SEEDS = 4096


def _sampling(config: TrainConfig, *, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=config.agent.max_tokens_per_turn,
        temperature=temperature,
        top_p=config.rollout.top_p,
        top_k=config.rollout.top_k,
        seed=seed,
    )


def play_checkpoint(
    config: TrainConfig,
    path: Path,
    tasks: list[RolloutTask],
    *,
    temperature: float,
    seed: int,
    policy_version: int,
    weights_fingerprint: str,
    block_tasks: int | None = None,
) -> list[Trajectory]:
    """Roll out ``tasks`` with the policy saved in folder ``path`` (engine per ``config.rollout``);
    one trajectory per task, in task order, whether one engine or several shards play them. Each
    engine is handed at most ``block_tasks`` of its tasks at a time (None: all of them at once)."""
    play = functools.partial(
        play_shard,
        config,
        str(path),
        sampling=_sampling(config, temperature=temperature, seed=seed),
        policy_version=policy_version,
        weights_fingerprint=weights_fingerprint,
        block_tasks=block_tasks,
    )
    options = config.rollout.shard_engine_options
    if len(options) == 1:
        return play(list(tasks), options[0])
    # Servers (openai) are driven from threads of this process; local engines each get a process
    # and an equal share of this process's torch threads.
    local = config.rollout.engine != "openai"
    threads = max(1, torch.get_num_threads() // len(options))
    return run_sharded(tasks, options, play, processes=local, threads_per_process=threads)


def play_shard(
    config: TrainConfig,
    path: str,
    tasks: list[RolloutTask],
    engine_options: dict[str, Any],
    *,
    sampling: SamplingParams,
    policy_version: int,
    weights_fingerprint: str,
    block_tasks: int | None = None,
) -> list[Trajectory]:
    """Roll out ``tasks`` on one engine built here from ``engine_options`` and the checkpoint folder
    ``path``: hf (or a dotted path) loads the weights into this process; vllm loads the folder
    itself; openai needs only the tokenizer (the server holds the weights).

    The engine is handed ``block_tasks`` tasks at a time (None: all), so the memory their episodes
    hold is one block's while the engine is built once. Blocks change no episode: every engine seeds an
    episode's sampling from ``sampling.seed`` and the episode's id (``rollout/seeding.py``), not from
    its place in the batch."""
    if block_tasks is not None and block_tasks < 1:
        raise ValueError(f"block_tasks={block_tasks}: must be >= 1 (tasks handed to the engine at once)")
    block = block_tasks or max(len(tasks), 1)
    name = config.rollout.engine
    engine: Any
    if name in ("openai", "vllm"):
        tokenizer = load_tokenizer(path)
        if name == "vllm":
            engine = make_engine(name, model=path, **{"dtype": config.model.dtype, **engine_options})
        else:
            engine = make_engine(name, **engine_options)
    else:
        model, tokenizer = load_policy(path, dtype=config.model.dtype, device=config.model.device)
        engine = make_engine(name, model=model, tokenizer=tokenizer, **engine_options)
    try:
        played: list[Trajectory] = []
        for start in range(0, len(tasks), block):
            if len(tasks) > block:
                last = min(start + block, len(tasks))
                logger.info("rollouts: episodes %d..%d of %d", start + 1, last, len(tasks))
            played += run_rollouts(
                engine,
                tokenizer,
                tasks[start : start + block],
                agent=config.agent,
                sampling=sampling,
                policy_version=policy_version,
                weights_fingerprint=weights_fingerprint,
            )
        return played
    finally:
        close = getattr(engine, "close", None)  # the openai engine's HTTP client
        if callable(close):
            close()


def evaluate_checkpoint(
    config: TrainConfig,
    path: Path,
    *,
    seeds: int | None = None,
    seed_offset: int | None = None,
    env_names: list[str] | None = None,
    temperature: float | None = None,
    block_seeds: int = EVAL_BLOCK_SEEDS,
) -> tuple[dict[str, dict[str, float]], list[Trajectory]]:
    """Held-out evaluation of the policy in folder ``path`` on the envs of ``config`` (or ``env_names``;
    a name not in the mixture is evaluated with its default config), sampled at ``temperature``
    (default ``config.eval.temperature``; 0 = greedy). Deterministic given the seeds.

    The engine, built once, is handed ``block_seeds`` x (envs evaluated) episodes at a time
    (``play_shard``'s blocks), so the memory an evaluation needs is one block's; the blocks change no
    episode."""
    temperature = config.eval.temperature if temperature is None else temperature
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy decoding)")
    by_name = {s.name: s for s in config.envs}
    specs = list(config.envs) if not env_names else [by_name.get(n, EnvSpec(name=n)) for n in env_names]
    offset = config.eval.seed_offset if seed_offset is None else seed_offset
    count = seeds or config.eval.seeds
    if count > MAX_EVAL_SEEDS:
        raise ValueError(f"seeds={count}: at most {MAX_EVAL_SEEDS} held-out seeds per env in one evaluation")
    if block_seeds < 1:
        raise ValueError(f"block_seeds={block_seeds}: must be >= 1 (seeds per env played at once)")
    # A RAGEN checkpoint must be committed and intact; a plain model folder (no training state) is evaluated as is.
    verified = ckpt.verify_checkpoint(Path(path)) if ckpt.is_checkpoint_folder(Path(path)) else {}
    tasks = make_eval_tasks(specs, count, offset)
    # The sampling noise follows the seed offset too: evaluations at two offsets get independent samples.
    sampling_seed = int(np.random.SeedSequence([config.seed, offset]).generate_state(1, dtype=np.uint64)[0] >> 2)
    trajectories = play_checkpoint(
        config,
        Path(path),
        tasks,
        temperature=temperature,
        seed=sampling_seed,
        policy_version=int(verified.get("policy_version", 0)),
        weights_fingerprint=str(verified.get("fingerprint", "")),
        block_tasks=block_seeds * len(specs),
    )
    return aggregate(trajectories), trajectories

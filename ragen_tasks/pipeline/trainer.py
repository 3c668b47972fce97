"""The trainer's lifecycle: build it for a model, save it as a checkpoint, load it back; and the
warm-started initial policy, cached in the store by what it is a function of."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ragen_tasks.config import TrainConfig
from ragen_tasks.models.loading import load_policy
from ragen_tasks.pipeline.lineage import fingerprint, marker_fingerprint
from ragen_tasks.pipeline.run import PRODUCER, Run
from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.training.backend import TrainModel, make_optimizer, make_train_model
from ragen_tasks.training.critic import make_critic
from ragen_tasks.training.distributed import barrier, current_ranks

log = logging.getLogger(__name__)


@dataclass
class Trainer:
    """Models of one update, each wrapped with its optimizer in the configured backend (torch or
    DeepSpeed). Rebuilt from a checkpoint for every update: the stages stay separable."""

    actor_module: torch.nn.Module
    tokenizer: Any
    models: dict[str, torch.nn.Module]  # extra checkpointed modules: {"critic": ...} when GAE
    train_models: dict[str, TrainModel]  # "actor" (+ "critic"): module + optimizer, checkpointed by name
    generator: torch.Generator  # minibatch shuffling, saved in checkpoints for exact resume


def _modules(config: TrainConfig, source: str | Path) -> tuple[torch.nn.Module, Any, dict[str, torch.nn.Module]]:
    """Actor (+ a critic when GAE) from a model folder or preset name, in train mode."""
    actor, tokenizer = load_policy(str(source), dtype=config.model.dtype, device=config.model.device)
    actor.train()
    models: dict[str, torch.nn.Module] = {"critic": make_critic(actor)} if config.algo.advantage == "gae" else {}
    return actor, tokenizer, models


def _wrap(config: TrainConfig, actor: torch.nn.Module, models: Mapping[str, torch.nn.Module]) -> dict[str, TrainModel]:
    """Each trained module with a fresh AdamW in the configured backend (at the first iteration's
    learning rate; ``set_learning_rates`` sets the rate of the iteration an update runs). Wrap only
    after every weight is loaded: ZeRO copies the weights into its fp32 partitions when it wraps."""
    return {
        name: make_train_model(
            module,
            make_optimizer(
                module, lr=config.optim.lr_at(name, 0, config.iterations), weight_decay=config.optim.weight_decay
            ),
            config.optim,
        )
        for name, module in {"actor": actor, **models}.items()
    }


def build_trainer(config: TrainConfig, source: str | Path) -> Trainer:
    """A trainer with fresh optimizers for the model at ``source`` (a folder or a preset name)."""
    actor, tokenizer, models = _modules(config, source)
    return Trainer(
        actor, tokenizer, models, _wrap(config, actor, models), torch.Generator().manual_seed(config.optim.seed)
    )


def save_trainer(
    run: Run, trainer: Trainer, step: int, *, metadata: dict[str, Any] | None = None
) -> ckpt.CheckpointInfo:
    """Commit the trainer as checkpoint ``step`` (with ``metadata``: what the step's commit must
    cover, see ``checkpoint.save_checkpoint``), prune old ones (never ``run.protect_steps``), mirror
    it to the store (where old ones are pruned too). With several data-parallel ranks every rank
    calls it: each writes its part, rank 0 commits, prunes and mirrors."""
    ranks = current_ranks()
    with contextlib.ExitStack() as stack:  # the whole weights on every rank while rank 0 writes them
        for train_model in trainer.train_models.values():
            stack.enter_context(train_model.full_weights())
        info = ckpt.save_checkpoint(
            run.checkpoint_root,
            step,
            actor=trainer.actor_module,
            tokenizer=trainer.tokenizer,
            optimizers=dict(trainer.train_models),
            models=trainer.models,
            extra_state={"generator": trainer.generator.get_state()},
            metadata=metadata,
            ranks=ranks,
        )
    if ranks.is_main:
        _prune_and_publish(run, step)
    barrier()  # no rank reads the store's checkpoints before rank 0 mirrored this one
    return info


def copy_trainer(run: Run, from_step: int, to_step: int) -> ckpt.CheckpointInfo:
    """Commit checkpoint ``to_step`` holding checkpoint ``from_step``'s exact state, file for file
    (whatever number of ranks wrote it), then prune and mirror it like ``save_trainer``."""
    fingerprint(run, from_step)  # the run's lineage must agree with the marker (a re-signed checkpoint is refused)
    info = ckpt.copy_checkpoint(run.checkpoint_root, run.checkpoint_path(from_step), to_step)
    _prune_and_publish(run, to_step)
    return info


def _prune_and_publish(run: Run, step: int) -> None:
    """After checkpoint ``step`` committed locally: prune old ones (never ``run.protect_steps``),
    mirror it to the store, prune the store's."""
    ckpt.prune(run.checkpoint_root, keep_last=run.config.checkpoint.keep_last, protect=run.protect_steps)
    run.publish_checkpoint(step)
    run.prune_store_checkpoints()


def load_trainer(run: Run, step: int) -> Trainer:
    """Weights, optimizer state and shuffling RNG of checkpoint ``step`` (weights first, then the
    backend wraps, then the optimizer state goes in through the wrapper). The optimizers keep the
    saved learning rates: the update sets its iteration's (``set_learning_rates``)."""
    ranks = current_ranks()
    if ranks.local_rank == 0:  # one fetch per node from an s3:// store; the node's other ranks wait
        run.checkpoint_path(step, verify=False)
    barrier()
    path = run.checkpoint_path(step)
    fingerprint(run, step)  # the run's lineage must agree with the marker (a re-signed checkpoint is refused)
    actor, tokenizer, models = _modules(run.config, path)
    info = ckpt.load_checkpoint(path, actor=actor, models=models)
    train_models = _wrap(run.config, actor, models)
    ckpt.load_optimizers(path, dict(train_models), ranks=ranks)
    generator = torch.Generator().manual_seed(run.config.optim.seed)
    generator.set_state(info.extra_state["generator"])
    return Trainer(actor, tokenizer, models, train_models, generator)


def set_learning_rates(config: TrainConfig, train_models: Mapping[str, TrainModel], iteration: int) -> dict[str, float]:
    """Set the learning rates of the config in force (a guard mitigation or ``--resume-set`` may have
    changed them) at ``iteration`` of its ``optim.lr_schedule``, over the ones a checkpoint saved.
    Returns the rate set per model name."""
    rates = {name: config.optim.lr_at(name, iteration, config.iterations) for name in train_models}
    for name, train_model in train_models.items():
        for group in train_model.optimizer.param_groups:
            group["lr"] = rates[name]
    return rates


class TrainerHandoff:
    """The trainer the last update saved, handed to the next update run by the same owner (the train
    flow's in-process mode). That update starts from exactly the saved state (weights, optimizer
    moments, shuffling RNG), so it takes it from here instead of rebuilding it from the checkpoint
    files. Taking empties the handoff and only a successful save refills it, so a failed update
    never leaves a half-updated trainer behind; a rollback, a resume or another process misses and
    loads the checkpoint."""

    def __init__(self) -> None:
        self._held: tuple[Path, str, Trainer] | None = None  # (checkpoint folder, fingerprint, trainer)

    def take(self, run: Run, step: int) -> Trainer:
        """The trainer at checkpoint ``step``."""
        held, self._held = self._held, None
        if held is None or held[:2] != (run.checkpoint_path(step, verify=False), fingerprint(run, step)):
            return load_trainer(run, step)
        return held[2]

    def keep(self, run: Run, trainer: Trainer, step: int) -> None:
        """Hold ``trainer``, just saved as checkpoint ``step``."""
        self._held = (run.checkpoint_path(step, verify=False), marker_fingerprint(run, step), trainer)


def step_missing(run: Run, step: int) -> bool:
    """Checkpoint ``step`` is committed neither locally nor in the store."""
    if (ckpt.step_dir(run.checkpoint_root, step) / ckpt.MARKER).exists():
        return False
    return run.is_local or step not in run.store.list_checkpoints(run.run_id)


def republish(run: Run, step: int) -> None:
    """A retry that finds ``step`` committed locally completes an upload its crashed attempt may
    have left unfinished (no-op on a local store, or once the local copy was pruned)."""
    if not run.is_local and (ckpt.step_dir(run.checkpoint_root, step) / ckpt.MARKER).exists():
        run.publish_checkpoint(step)


def warm_start_key(config: TrainConfig) -> str:
    """What a warm start is a pure function of, hashed: the model and its device, the games, the
    agent turn, the warm-start settings, the seeds, the preset's build and torch's version."""
    from ragen_tasks.models.presets import PRESET_VERSION
    from ragen_tasks.training.warm_start import WARM_START_VERSION

    material = {
        "code": [WARM_START_VERSION, PRESET_VERSION, torch.__version__],
        "model": config.model.model_dump(mode="json"),
        "envs": [spec.model_dump(mode="json") for spec in config.envs],
        "agent": config.agent.model_dump(mode="json", exclude={"loss_on_reasoning"}),  # RL's only
        "warm_start": config.warm_start.model_dump(mode="json", exclude={"seed"}),  # in "seeds"
        "seeds": [config.warm_start.seed_for(config.seed), config.eval.seed_offset],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]


def warm_started_policy(run: Run, *, progress: Any = None) -> tuple[Path, dict[str, Any]]:
    """The warm-started policy for ``run.config``: (its committed checkpoint folder, the warm start's
    record). Warm starts are cached in the store as the checkpoint 0 of a run named
    ``warm-start-<key>`` (``warm_start_key``): a second run with the same warm-start inputs starts
    RL at once. The record says ``cache: hit`` or ``miss``. Every run, hit or miss, builds its
    trainer from that folder, so both take the same path from there on."""
    config, key = run.config, warm_start_key(run.config)
    cache = replace(run, run_id=f"warm-start-{key}", protect_steps=frozenset())
    if step_missing(cache, 0):
        from ragen_tasks.training.warm_start import warm_start  # only needed for fresh presets

        trainer = build_trainer(config, config.model.name_or_path)
        record = warm_start(trainer.actor_module, trainer.tokenizer, config, progress=progress)
        # the config too: `ragen evaluate` on the cached checkpoint then plays the games it was made for
        run.store.write_json(cache.run_id, 0, "summary", "config", config.model_dump(mode="json"), producer=PRODUCER)
        run.store.write_json(cache.run_id, 0, "summary", "warm_start", record, producer=PRODUCER)
        ckpt.save_checkpoint(
            cache.checkpoint_root, 0, actor=trainer.actor_module, tokenizer=trainer.tokenizer, optimizers={}
        )
        cache.publish_checkpoint(0)
        outcome = "miss"
    else:
        outcome = "hit"
        log.info("warm start: cache hit %s (RL starts from it at once)", run.store.uri(cache.run_id))
    record, _ = run.store.read_json(cache.run_id, 0, "summary", "warm_start")
    return cache.checkpoint_path(0), {**record, "cache": outcome, "cache_run": cache.run_id}

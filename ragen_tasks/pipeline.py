"""The StarPO stages as plain library functions: what the Prefect tasks in ``flows/`` call.

Each stage reads its inputs from the store, commits its outputs there (data first, manifest last)
and returns a small JSON-able summary. Each is idempotent: run again for the same iteration, it
finds its committed output and returns at once, so a retried task or a re-run flow never redoes
or duplicates work.

Policy versions are checkpoint steps. Iteration ``k`` samples with ``policy_step(run, k)`` (0 for
the first iteration, then the ``policy/next_step`` recorded by iteration ``k-1``), and its update
commits the next step. Usually that is just ``k -> k+1``; after a guard rollback the next step is a
new checkpoint holding an older, healthy checkpoint's exact weights, and the numbering moves on.

Per iteration ``k``::

    generate_tasks(k)      -> iter_k/tasks/tasks.json
    rollout(k)             -> iter_k/rollouts/   (trajectories sampled by policy step s = policy_step(k))
    filter_and_validate(k) -> iter_k/batch/      (GX-validated, fresh, uncertainty-filtered)
    update(k)              -> checkpoints/step_{s+1}
    evaluate(k)            -> iter_k/eval/eval.json       (every eval.every iterations and the last)
    record_iteration(k)    -> iter_k/summary/summary.json (the iteration's commit: resume starts after it)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ragen_tasks.algos import filter_groups, rollout_health_from_trajectories
from ragen_tasks.config import TrainConfig
from ragen_tasks.data.freshness import freshness_report
from ragen_tasks.data.keys import check_run_id
from ragen_tasks.data.store import Store
from ragen_tasks.data.token_batch import collate_table
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.evaluation import aggregate
from ragen_tasks.models.loading import load_policy
from ragen_tasks.models.presets import PRESETS
from ragen_tasks.rollout.engine import SamplingParams
from ragen_tasks.rollout.loop import RolloutTask, make_eval_tasks, make_group_tasks, run_rollouts
from ragen_tasks.rollout.registry import make_engine
from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.training.backend import TrainModel, make_optimizer, make_train_model
from ragen_tasks.training.critic import make_critic, make_reference
from ragen_tasks.training.update import ppo_update
from ragen_tasks.validation.batch import BatchLimits, validate_stored_batch

log = logging.getLogger(__name__)

PRODUCER = "ragen_tasks.pipeline"


# ----------------------------------------------------------------------------------- run context
@dataclass(frozen=True)
class Run:
    """Where a run lives. Checkpoints are written to a local folder (the run folder itself on a
    local store; a scratch cache mirrored to the store on ``s3://``)."""

    config: TrainConfig  # the config in force (the run's config + any guard mitigation overrides)
    run_id: str
    store: Store
    protect_steps: frozenset[int] = frozenset()  # checkpoints never pruned (the guard's last healthy one)

    def with_overrides(self, overrides: Mapping[str, Any], *, protect: Iterable[int] = ()) -> Run:
        """This run with config ``overrides`` (dotted keys, as ``--set``) in force and ``protect`` kept."""
        from ragen_tasks.presets import apply_overrides

        data = apply_overrides(self.config.model_dump(mode="json"), overrides)
        return replace(self, config=TrainConfig.model_validate(data), protect_steps=frozenset(protect))

    @property
    def is_local(self) -> bool:
        return self.store.protocol == "file"

    @property
    def run_dir(self) -> Path:
        """Local folder of the run (reports, summary.json, checkpoints on a local store)."""
        if self.is_local:
            return Path(self.store.uri(self.run_id).removeprefix("file://"))
        return Path(os.environ.get("RAGEN_SCRATCH", Path(tempfile.gettempdir()) / "ragen")) / self.run_id

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint_path(self, step: int, *, verify: bool = True) -> Path:
        """Local path of committed checkpoint ``step``, fetched from the store if only there.
        ``verify`` re-hashes every file against the marker (do it once per stage, before loading)."""
        path = ckpt.step_dir(self.checkpoint_root, step)
        if not (path / ckpt.MARKER).exists() and not self.is_local:
            self.store.download_checkpoint(self.run_id, step, path)
        if verify:
            ckpt.verify_checkpoint(path)
        elif not (path / ckpt.MARKER).exists():
            raise ckpt.CheckpointError(f"checkpoint {path} is not committed (no {ckpt.MARKER})")
        return path

    def publish_checkpoint(self, step: int) -> None:
        """Mirror committed checkpoint ``step`` to an s3:// store (idempotent; the marker goes last).
        Called on every save AND on retries that find the step already committed locally, so a failed
        upload is completed by the retry."""
        if not self.is_local:
            self.store.upload_checkpoint(ckpt.step_dir(self.checkpoint_root, step), self.run_id, step)


def open_run(config: TrainConfig, run_id: str | None = None) -> Run:
    """The run for ``config``: ``run_id`` (or ``config.run_id``, or ``<preset>-<UTC time>``)."""
    rid = run_id or config.run_id or f"{Path(config.preset).stem}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    return Run(config=config, run_id=check_run_id(rid), store=Store(config.store.root))


def open_existing_run(run: str) -> Run:
    """An existing run from its folder (``runs/<id>``) or URI (``s3://bucket/prefix/<id>``), with the
    config it was started with. Raises FileNotFoundError naming what is missing."""
    root, _, run_id = run.rstrip("/").rpartition("/")
    store = Store(root or ".")
    if not store.has_manifest(check_run_id(run_id), 0, "summary", "config"):
        raise FileNotFoundError(
            f"{run!r} is not a RAGEN run: no committed config at {store.uri(run_id, 0, 'summary', 'config')}"
        )
    stored, _ = store.read_json(run_id, 0, "summary", "config")
    return Run(config=TrainConfig.model_validate(stored), run_id=run_id, store=store)


def run_of_checkpoint(path: Path) -> Run | None:
    """The run a local checkpoint folder belongs to (``<root>/<run>/checkpoints/step_k``), if any."""
    run_dir = Path(path).resolve().parent.parent
    try:
        return open_existing_run(str(run_dir))
    except (FileNotFoundError, ValueError):
        return None


# ----------------------------------------------------------------------------------- policy state
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
    """Each trained module with a fresh AdamW in the configured backend. Wrap only after every weight
    is loaded: ZeRO copies the weights into its fp32 partitions when it wraps."""
    return {
        name: make_train_model(
            module, make_optimizer(module, lr=_lr(config, name), weight_decay=config.optim.weight_decay), config.optim
        )
        for name, module in {"actor": actor, **models}.items()
    }


def _lr(config: TrainConfig, name: str) -> float:
    """Learning rate of the optimizer called ``name`` ("actor" or "critic")."""
    return config.optim.lr if name == "actor" else config.optim.critic_lr


def build_trainer(config: TrainConfig, source: str | Path) -> Trainer:
    """A trainer with fresh optimizers for the model at ``source`` (a folder or a preset name)."""
    actor, tokenizer, models = _modules(config, source)
    return Trainer(
        actor, tokenizer, models, _wrap(config, actor, models), torch.Generator().manual_seed(config.optim.seed)
    )


def save_trainer(run: Run, trainer: Trainer, step: int) -> ckpt.CheckpointInfo:
    info = ckpt.save_checkpoint(
        run.checkpoint_root,
        step,
        actor=trainer.actor_module,
        tokenizer=trainer.tokenizer,
        optimizers=dict(trainer.train_models),
        models=trainer.models,
        extra_state={"generator": trainer.generator.get_state()},
    )
    ckpt.prune(run.checkpoint_root, keep_last=run.config.checkpoint.keep_last, protect=run.protect_steps)
    run.publish_checkpoint(step)
    return info


def load_trainer(run: Run, step: int) -> Trainer:
    """Weights, optimizer state and shuffling RNG of checkpoint ``step`` (weights first, then the
    backend wraps, then the optimizer state goes in through the wrapper). The learning rates of the
    config in force win over the saved ones (a guard mitigation may have lowered them)."""
    path = run.checkpoint_path(step)
    actor, tokenizer, models = _modules(run.config, path)
    info = ckpt.load_checkpoint(path, actor=actor, models=models)
    train_models = _wrap(run.config, actor, models)
    ckpt.load_optimizers(path, dict(train_models))
    _set_learning_rates(run.config, train_models)
    generator = torch.Generator().manual_seed(run.config.optim.seed)
    generator.set_state(info.extra_state["generator"])
    return Trainer(actor, tokenizer, models, train_models, generator)


# The trainer an in-process update saved last, keyed by (checkpoint folder, weights fingerprint): the
# next update starts from exactly that state (weights, optimizer moments, shuffling RNG), so it takes
# it from memory instead of rebuilding it from the files (~50 ms per iteration on the tiny model).
# An entry is removed when taken and re-added only after a successful save, so a failed update never
# leaves a half-updated trainer behind; a rollback, a resume or another process misses and loads.
_SAVED_TRAINER: dict[tuple[str, str], Trainer] = {}


def _take_trainer(run: Run, step: int) -> Trainer:
    """The trainer at checkpoint ``step``: the one this process saved there if it still holds it,
    else loaded from the checkpoint. Either way the learning rates of the config in force apply."""
    path = run.checkpoint_path(step, verify=False)
    trainer = _SAVED_TRAINER.pop((str(path), fingerprint(run, step)), None)
    if trainer is None:
        return load_trainer(run, step)
    _set_learning_rates(run.config, trainer.train_models)
    return trainer


def _keep_trainer(run: Run, trainer: Trainer, step: int) -> None:
    _SAVED_TRAINER.clear()  # one trainer at most: the newest
    _SAVED_TRAINER[(str(run.checkpoint_path(step, verify=False)), fingerprint(run, step))] = trainer


def _set_learning_rates(config: TrainConfig, train_models: Mapping[str, TrainModel]) -> None:
    """The learning rates of the config in force win over the saved ones (a guard mitigation may
    have lowered them)."""
    for name, train_model in train_models.items():
        for group in train_model.optimizer.param_groups:
            group["lr"] = _lr(config, name)


def fingerprint(run: Run, step: int) -> str:
    """sha256 of checkpoint ``step``'s weight file, as recorded in its commit marker."""
    import json

    marker = run.checkpoint_path(step, verify=False) / ckpt.MARKER
    return str(json.loads(marker.read_text())["fingerprint"])


def trusted_fingerprints(run: Run, iteration: int, max_staleness: int) -> dict[int, str]:
    """{step: fingerprint} of the steps a batch for ``iteration`` may come from: the current step and
    the steps of the policy's LINEAGE (the ``policy/step`` each recent iteration actually sampled with)
    up to ``max_staleness`` behind it. A checkpoint replaced by a guard rollback is never in the
    lineage, and a pruned one has no fingerprint: batches from either are rejected as
    unknown_fingerprint (keep checkpoint.keep_last > max_staleness)."""
    current = policy_step(run, iteration)
    # Steps grow by >= 1 per iteration, so the last max_staleness + 1 rows hold every step in the window.
    recent = history(run, before=iteration, last=max_staleness + 1)
    trusted: dict[int, str] = {}
    for step in sorted({current, *(int(r["policy/step"]) for r in recent if "policy/step" in r)}):
        if current - max_staleness <= step <= current:
            try:
                trusted[step] = fingerprint(run, step)
            except (ckpt.CheckpointError, FileNotFoundError, OSError) as exc:
                log.warning("policy step %d: fingerprint unknown (%s); its batches will be rejected", step, exc)
    return trusted


def run_in_force(base: Run, iteration: int, rows: Sequence[Mapping[str, Any]] | None = None) -> Run:
    """``base`` as iteration ``iteration`` must see it: the guard's mitigation overrides recorded by
    the previous iteration, and protection from pruning for the guard's last healthy checkpoint and
    the step this iteration samples with. ``rows``: the committed rows before ``iteration`` if the
    caller holds them (the flow does); else the recent ones are read from the store."""
    from ragen_tasks.guard import max_patience, rollback_candidates, rules, since_last_rollback

    if rows is None:  # the guard looks back at most max_patience + 1 signal-free rows since a rollback
        rows = history(base, before=iteration, last=4 * (max_patience(rules(base.config.guard)) + 1))
    overrides = dict(rows[-1].get("guard/overrides", {})) if rows else {}
    protect = {policy_step(base, iteration)} | rollback_candidates(since_last_rollback(rows), rules(base.config.guard))
    return base.with_overrides(overrides, protect=protect)


# ----------------------------------------------------------------------------------- stages
def init_run(run: Run, *, progress: Any = None) -> dict[str, Any]:
    """Create (or resume) the run: config recorded, initial policy committed as checkpoint step 0.

    Returns ``{"run_id", "start_iteration", "warm_start"}``. The initial policy is the model of
    ``config.model``; for the built-in presets (random init) the warm start runs first when enabled.
    """
    config = run.config
    run.store.write_json(run.run_id, 0, "summary", "config", config.model_dump(mode="json"), producer=PRODUCER)
    stored_config, _ = run.store.read_json(run.run_id, 0, "summary", "config")  # the first start's, on a resume
    _check_same_config(stored_config, config.model_dump(mode="json"), run.store.uri(run.run_id))
    if _step_missing(run, 0):
        source: str | Path = config.model.name_or_path
        warm: dict[str, Any] = {}
        if config.warm_start.enabled and config.model.name_or_path in PRESETS:
            source, warm = warm_started_policy(run, progress=progress)
        # Its record first: a retry after a crash before the checkpoint commit finds the cached warm start.
        run.store.write_json(run.run_id, 0, "summary", "warm_start", warm, producer=PRODUCER)
        save_trainer(run, build_trainer(config, source), 0)
    else:
        _republish(run, 0)
    warm, _ = run.store.read_json(run.run_id, 0, "summary", "warm_start")
    initial_eval(run)  # before RL (after the warm start): what summary.json compares the final policy with
    done = run.store.last_committed_iteration(run.run_id, "summary", "summary")
    return {"run_id": run.run_id, "start_iteration": 0 if done is None else done + 1, "warm_start": warm}


def initial_eval(run: Run) -> dict[str, Any]:
    """Held-out evaluation of policy version 0, committed once (checkpoint 0 is pruned later)."""
    return _evaluate_once(run, 0, "initial", 0)


def warm_start_key(config: TrainConfig) -> str:
    """What a warm start is a pure function of, hashed: the model and its device, the games, the
    agent turn, the warm-start settings, the seeds, the preset's build and torch's version."""
    import hashlib
    import json

    from ragen_tasks.models.presets import PRESET_VERSION
    from ragen_tasks.training.warm_start import WARM_START_VERSION

    material = {
        "code": [WARM_START_VERSION, PRESET_VERSION, torch.__version__],
        "model": config.model.model_dump(mode="json"),
        "envs": [spec.model_dump(mode="json") for spec in config.envs],
        "agent": config.agent.model_dump(mode="json"),
        "warm_start": config.warm_start.model_dump(mode="json"),
        "seeds": [config.seed, config.eval.seed_offset],
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
    if _step_missing(cache, 0):
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


def _republish(run: Run, step: int) -> None:
    """A retry that finds ``step`` committed locally completes an upload its crashed attempt may
    have left unfinished (no-op on a local store, or once the local copy was pruned)."""
    if not run.is_local and (ckpt.step_dir(run.checkpoint_root, step) / ckpt.MARKER).exists():
        run.publish_checkpoint(step)


def _store_has_checkpoint(run: Run, step: int) -> bool:
    return not run.is_local and step in run.store.list_checkpoints(run.run_id)


def _check_same_config(stored: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Resuming with another config would silently mix two experiments: refuse, naming the keys.
    ``iterations`` may grow (extend a finished run)."""
    diffs = sorted(
        k for k in set(stored) | set(current) if k not in ("iterations", "preset") and stored.get(k) != current.get(k)
    )
    if diffs:
        raise ValueError(
            f"run {where} already exists with a different config (differs in: {', '.join(diffs)}); "
            "use a new run id, or the same settings to resume"
        )


def policy_step(run: Run, iteration: int) -> int:
    """The checkpoint step that samples iteration ``iteration`` (see the module docstring)."""
    if iteration == 0:
        return 0
    previous, _ = run.store.read_json(run.run_id, iteration - 1, "summary", "summary")
    return int(previous["policy/next_step"])


def generate_tasks(run: Run, iteration: int) -> dict[str, Any]:
    """Task generation: ``groups`` initial states x ``group_size`` rollouts (task diversity knob)."""
    config = run.config
    t0 = time.perf_counter()
    if not run.store.has_manifest(run.run_id, iteration, "tasks", "tasks"):
        tasks = make_group_tasks(
            config.envs,
            config.rollout.groups,
            config.rollout.group_size,
            config.seed,
            iteration,
            seed_space=config.eval.seed_offset,
        )
        run.store.write_json(run.run_id, iteration, "tasks", "tasks", [t.__dict__ for t in tasks], producer=PRODUCER)
    tasks_json, _ = run.store.read_json(run.run_id, iteration, "tasks", "tasks")
    return {
        "uri": run.store.uri(run.run_id, iteration, "tasks", "tasks"),
        "tasks": len(tasks_json),
        "timing/generate_tasks_s": time.perf_counter() - t0,
    }


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
) -> list[Trajectory]:
    """Roll out ``tasks`` with the policy saved in folder ``path`` (engine per ``config.rollout``)."""
    model, tokenizer = load_policy(str(path), dtype=config.model.dtype, device=config.model.device)
    engine = make_engine(config.rollout.engine, model=model, tokenizer=tokenizer, **config.rollout.engine_options)
    return run_rollouts(
        engine,
        tokenizer,
        tasks,
        agent=config.agent,
        sampling=_sampling(config, temperature=temperature, seed=seed),
        policy_version=policy_version,
        weights_fingerprint=weights_fingerprint,
    )


def _play(run: Run, step: int, tasks: list[RolloutTask], *, temperature: float, seed: int) -> list[Trajectory]:
    """Roll out ``tasks`` with policy version ``step`` of the run."""
    return play_checkpoint(
        run.config,
        run.checkpoint_path(step),
        tasks,
        temperature=temperature,
        seed=seed,
        policy_version=step,
        weights_fingerprint=fingerprint(run, step),
    )


def evaluate_checkpoint(
    config: TrainConfig,
    path: Path,
    *,
    seeds: int | None = None,
    seed_offset: int | None = None,
    env_names: list[str] | None = None,
) -> tuple[dict[str, dict[str, float]], list[Trajectory]]:
    """Held-out evaluation of the policy in folder ``path`` on the envs of ``config`` (or ``env_names``;
    a name not in the mixture is evaluated with its default config). Deterministic given the seeds."""
    from ragen_tasks.config import EnvSpec

    by_name = {s.name: s for s in config.envs}
    specs = list(config.envs) if not env_names else [by_name.get(n, EnvSpec(name=n)) for n in env_names]
    offset = config.eval.seed_offset if seed_offset is None else seed_offset
    tasks = make_eval_tasks(specs, seeds or config.eval.seeds, offset)
    verified = ckpt.verify_checkpoint(Path(path)) if (Path(path) / ckpt.MARKER).exists() else {}
    # The sampling noise follows the seeds too: two blocks of held-out seeds get independent samples.
    sampling_seed = int(np.random.SeedSequence([config.seed, offset]).generate_state(1, dtype=np.uint64)[0] >> 2)
    trajectories = play_checkpoint(
        config,
        Path(path),
        tasks,
        temperature=config.eval.temperature,
        seed=sampling_seed,
        policy_version=int(verified.get("policy_version", 0)),
        weights_fingerprint=str(verified.get("fingerprint", "")),
    )
    return aggregate(trajectories), trajectories


def rollout(run: Run, iteration: int) -> dict[str, Any]:
    """Roll out the iteration's tasks with policy step ``policy_step(run, iteration)``; commit them."""
    t0 = time.perf_counter()
    compute_s = 0.0
    if not run.store.has_manifest(run.run_id, iteration, "rollouts"):
        step = policy_step(run, iteration)
        tasks_json, _ = run.store.read_json(run.run_id, iteration, "tasks", "tasks")
        tasks = [RolloutTask(**t) for t in tasks_json]
        t_play = time.perf_counter()
        trajectories = _play(
            run, step, tasks, temperature=run.config.rollout.temperature, seed=run.config.seed * 1_000_003 + iteration
        )
        compute_s = time.perf_counter() - t_play
        run.store.write_trajectories(
            run.run_id,
            iteration,
            "rollouts",
            trajectories,
            producer=PRODUCER,
            policy_version=step,
            weights_fingerprint=fingerprint(run, step),
        )
    manifest = run.store.read_manifest(run.run_id, iteration, "rollouts")
    return {
        "uri": run.store.uri(run.run_id, iteration, "rollouts", "trajectories"),
        "trajectories": manifest.objects[0].rows,
        "policy_step": manifest.policy_version,
        "timing/rollout_s": time.perf_counter() - t0,  # the whole stage (store I/O included)
        "timing/rollout_compute_s": compute_s,
    }  # model load + the multi-turn rollout


def batch_limits(config: TrainConfig) -> BatchLimits:
    """What a rollout batch must satisfy before it may be trained on."""
    agent = config.agent
    return BatchLimits(
        reward_min=config.store.reward_min,
        reward_max=config.store.reward_max,
        max_tokens=agent.max_context_tokens + agent.max_tokens_per_turn,
        max_turns=agent.max_turns,
    )


def filter_and_validate(run: Run, iteration: int, *, current_version: int | None = None) -> dict[str, Any]:
    """Great Expectations validation, freshness check, uncertainty-based filtering -> training batch.

    ``current_version`` is the trainer's policy version (default ``policy_step(run, iteration)``:
    on-policy). Returns health metrics of the whole rollout batch and the filter's metrics.
    """
    config = run.config
    version = policy_step(run, iteration) if current_version is None else current_version
    t0 = time.perf_counter()
    if run.store.has_manifest(run.run_id, iteration, "batch", "summary"):  # written last: the stage is done
        summary, _ = run.store.read_json(run.run_id, iteration, "batch", "summary")
        return dict(summary)
    trajectories, manifest = validate_stored_batch(
        run.store, run.run_id, iteration, "rollouts", limits=batch_limits(config)
    )
    known = trusted_fingerprints(run, iteration, config.freshness.max_staleness)
    fresh = freshness_report(trajectories, version, known, config.freshness.max_staleness)
    metrics: dict[str, Any] = {**rollout_health_from_trajectories(trajectories), **fresh.metrics()}
    kept: list[Trajectory] = []
    if fresh.accepted:
        rewards = torch.tensor([t.reward for t in fresh.accepted], dtype=torch.float32)  # (N,)
        group_ids = torch.tensor([t.group_id for t in fresh.accepted], dtype=torch.long)  # (N,)
        keep, filter_metrics = filter_groups(rewards, group_ids, config.algo.filter_keep_ratio, config.algo.filter_mode)
        kept = [fresh.accepted[i] for i in keep.tolist()]
        metrics.update({k: float(v) for k, v in filter_metrics.items()})
    metrics["batch/kept_trajectories"] = float(len(kept))
    # The batch first (idempotent on retry), the summary last: its manifest marks the stage as done.
    run.store.write_trajectories(
        run.run_id,
        iteration,
        "batch",
        kept,
        producer=PRODUCER,
        policy_version=manifest.policy_version,
        weights_fingerprint=manifest.weights_fingerprint,
    )
    metrics["timing/filter_s"] = time.perf_counter() - t0  # read + GX + freshness + filter + batch write
    summary = _json_floats(metrics)
    run.store.write_json(run.run_id, iteration, "batch", "summary", summary, producer=PRODUCER, policy_version=version)
    return summary


def rollback(run: Run, iteration: int, *, to_step: int, new_step: int) -> dict[str, Any]:
    """Commit checkpoint ``new_step`` holding checkpoint ``to_step``'s exact weights, optimizer and
    RNG state (the guard's rollback), so the next iteration continues from the healthy policy."""
    if not run.store.has_manifest(run.run_id, iteration, "update", "rollback"):
        if _step_missing(run, new_step):
            save_trainer(run, load_trainer(run, to_step), new_step)
        else:
            _republish(run, new_step)
        run.store.write_json(
            run.run_id,
            iteration,
            "update",
            "rollback",
            {"to_step": to_step, "new_step": new_step, "fingerprint": fingerprint(run, new_step)},
            producer=PRODUCER,
            policy_version=new_step,
        )
    result, _ = run.store.read_json(run.run_id, iteration, "update", "rollback")
    return dict(result)


def _json_floats(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Metrics as plain floats (None for non-numbers). NaN / inf are KEPT: the store's JSON keeps
    them (Python's json reads NaN and Infinity back) and the Echo-Trap guard must see a non-finite
    gradient norm; displays sanitise them (flows/train.py)."""
    return {k: (float(v) if isinstance(v, int | float) else None) for k, v in metrics.items()}


def update(run: Run, iteration: int) -> dict[str, Any]:
    """One StarPO update on the iteration's batch: policy step ``s = policy_step(run, iteration)`` ->
    ``s + 1`` (always the newest step: steps only grow)."""
    config = run.config
    t0 = time.perf_counter()
    step = policy_step(run, iteration)
    new_step = step + 1
    if run.store.has_manifest(run.run_id, iteration, "update", "metrics"):
        stored, _ = run.store.read_json(run.run_id, iteration, "update", "metrics")
        return dict(stored)
    trainer = _take_trainer(run, step) if _step_missing(run, new_step) else None
    metrics: dict[str, Any] = {}
    if trainer is None:  # a retry after the checkpoint committed but before the metrics did
        _republish(run, new_step)
    else:
        held = run.store.own_write(run.run_id, iteration, "batch")  # the filter's batch, if written in this process
        batch = held.table if held else run.store.read_table(run.run_id, iteration, "batch")[0]
        if batch.num_rows:
            pad_id = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else 0
            ref = make_reference(trainer.actor_module) if config.algo.kl_mode != "none" else None
            device = next(trainer.actor_module.parameters()).device
            metrics = ppo_update(
                collate_table(batch, pad_id=pad_id).to(device),
                actor=trainer.train_models["actor"],
                algo=config.algo,
                optim=config.optim,
                generator=trainer.generator,
                critic=trainer.train_models.get("critic"),
                ref_model=ref,
            )
        else:
            log.warning("iteration %d: the filtered batch is empty; the policy is carried over unchanged", iteration)
            metrics = {"batch/trajectories": 0.0}
        save_trainer(run, trainer, new_step)
        _keep_trainer(run, trainer, new_step)
    metrics["checkpoint/step"] = float(new_step)
    metrics["timing/update_stage_s"] = time.perf_counter() - t0  # checkpoint load/save + ppo_update (timing/update_s)
    finite = _json_floats(metrics)
    run.store.write_json(
        run.run_id,
        iteration,
        "update",
        "metrics",
        finite,
        producer=PRODUCER,
        policy_version=new_step,
        weights_fingerprint=fingerprint(run, new_step),
    )
    return finite


def _step_missing(run: Run, step: int) -> bool:
    path = ckpt.step_dir(run.checkpoint_root, step)
    return not (path / ckpt.MARKER).exists() and not _store_has_checkpoint(run, step)


def should_evaluate(config: TrainConfig, iteration: int) -> bool:
    return (iteration + 1) % config.eval.every == 0 or iteration + 1 == config.iterations


def evaluate_step(
    run: Run, step: int, *, seeds: int | None = None, seed_offset: int | None = None, env_names: list[str] | None = None
) -> tuple[dict[str, dict[str, float]], list[Trajectory]]:
    """Held-out evaluation of policy version ``step`` of the run (deterministic given the seeds)."""
    return evaluate_checkpoint(
        run.config, run.checkpoint_path(step), seeds=seeds, seed_offset=seed_offset, env_names=env_names
    )


def evaluate(run: Run, iteration: int, step: int, *, name: str = "eval") -> dict[str, Any]:
    """Evaluate checkpoint ``step`` (by default the policy the iteration hands on); commit the result
    as ``iter_<iteration>/eval/<name>``."""
    return _evaluate_once(run, iteration, name, step)


def _evaluate_once(run: Run, iteration: int, name: str, step: int) -> dict[str, Any]:
    """Held-out evaluation of checkpoint ``step`` committed as ``iter_<iteration>/eval/<name>``; a retry
    or resume reads the committed result instead of evaluating again."""
    if not run.store.has_manifest(run.run_id, iteration, "eval", name):
        per_env, _ = evaluate_step(run, step)
        run.store.write_json(
            run.run_id,
            iteration,
            "eval",
            name,
            {"envs": per_env, "policy_version": step},
            producer=PRODUCER,
            policy_version=step,
        )
    result, _ = run.store.read_json(run.run_id, iteration, "eval", name)
    return dict(result)


def record_iteration(run: Run, iteration: int, row: Mapping[str, Any]) -> dict[str, Any]:
    """Commit the iteration's metrics row (it must hold ``policy/next_step``): from now on a resumed
    run starts at ``iteration + 1`` with that policy."""
    if "policy/next_step" not in row:
        raise ValueError(
            f"iteration {iteration}: the row must hold 'policy/next_step' (the policy the next iteration uses)"
        )
    run.store.write_json(
        run.run_id,
        iteration,
        "summary",
        "summary",
        dict(row),
        producer=PRODUCER,
        policy_version=int(row["policy/next_step"]),
    )
    stored, _ = run.store.read_json(run.run_id, iteration, "summary", "summary")
    return dict(stored)


def history(run: Run, *, before: int | None = None, last: int | None = None) -> list[dict[str, Any]]:
    """Committed iteration rows in order: all of them, or those before iteration ``before``, or only
    the ``last`` few of those (reads only what it returns: per-iteration callers stay O(1))."""
    end = before
    if end is None:
        done = run.store.last_committed_iteration(run.run_id, "summary", "summary")
        end = 0 if done is None else done + 1
    start = 0 if last is None else max(0, end - last)
    return [run.store.read_json(run.run_id, k, "summary", "summary")[0] for k in range(start, end)]


def flatten_eval(result: Mapping[str, Any]) -> dict[str, float]:
    return {f"eval/{env}/{k}": float(v) for env, metrics in result.get("envs", {}).items() for k, v in metrics.items()}


def cleanup_scratch(run: Run) -> None:
    if not run.is_local:
        shutil.rmtree(run.run_dir, ignore_errors=True)

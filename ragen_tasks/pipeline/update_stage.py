"""The update stage: one StarPO update of the policy (checkpoint step ``s`` -> ``s + 1``), on one
process or on ``update.world_size`` data-parallel ranks, and the guard's rollback.

With more than one rank (``update.world_size`` > 1, or ``update.nnodes`` > 1) the stage launches
the ranks (torchrun on this node, or a Kubernetes Indexed Job) and waits; each rank runs
``python -m ragen_tasks.pipeline.update_ranks RUN ITERATION``, which calls :func:`update` inside
the process group. There every rank loads the same checkpoint and batch, trains on its shard of
each minibatch (``ragen_tasks.training.update``), and writes its part of the next checkpoint; rank 0
commits it and the metrics. The launching process then finds the committed metrics, exactly as a
retry would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

from ragen_tasks.config import TURN_ADVANTAGES
from ragen_tasks.data.token_batch import TokenBatch, collate, collate_table
from ragen_tasks.data.trajectory import from_table
from ragen_tasks.pipeline.lineage import marker_fingerprint, policy_step
from ragen_tasks.pipeline.run import PRODUCER, Run
from ragen_tasks.pipeline.stages import json_floats
from ragen_tasks.pipeline.trainer import (
    Trainer,
    TrainerHandoff,
    copy_trainer,
    load_trainer,
    republish,
    save_trainer,
    set_learning_rates,
    step_missing,
)
from ragen_tasks.training import checkpoint as ckpt
from ragen_tasks.training.critic import make_reference
from ragen_tasks.training.distributed import (
    all_gather,
    current_ranks,
    launch_update_ranks,
    resolve_world_size,
)
from ragen_tasks.training.turn_values import turn_advantages_batch
from ragen_tasks.training.update import DivergedUpdateError, NonFiniteUpdateError, diverged_weights, ppo_update
from ragen_tasks.validation.batch import BatchValidationError, read_or_quarantine

log = logging.getLogger(__name__)

#: Errors a failed rank reports that the launcher raises as the same type (the flow's retries treat
#: a diverged update as final; a checkpoint problem names its folder).
RANK_ERRORS: dict[str, Any] = {
    "DivergedUpdateError": DivergedUpdateError,
    "NonFiniteUpdateError": NonFiniteUpdateError,
    "CheckpointError": ckpt.CheckpointError,
    "BatchValidationError": BatchValidationError,
}


def update(run: Run, iteration: int, handoff: TrainerHandoff | None = None) -> dict[str, Any]:
    """One StarPO update on the iteration's batch: policy step ``s = policy_step(run, iteration)`` ->
    ``s + 1`` (always the newest step: steps only grow). ``handoff``: where the previous update of
    this process left its trainer (None: load it from the checkpoint; unused with several ranks).

    The update's metrics commit inside checkpoint ``s + 1`` (its ``metadata.json``), so a retry that
    finds the checkpoint committed but not the metrics manifest restores them exactly. An update
    whose weights come out non-finite or beyond ``optim.max_weight_abs`` is never committed: it
    raises DivergedUpdateError naming the cause and how to continue the run."""
    config = run.config
    t0 = time.perf_counter()
    ranks = current_ranks()
    if run.store.has_manifest(run.run_id, iteration, "update", "metrics"):
        stored, _ = run.store.read_json(run.run_id, iteration, "update", "metrics")
        return dict(stored)
    nproc = resolve_world_size(config.update)
    if ranks.world_size == 1 and (nproc > 1 or config.update.nnodes > 1):
        _launch(run, iteration, nproc)
        stored, _ = run.store.read_json(run.run_id, iteration, "update", "metrics")
        return dict(stored)
    step = policy_step(run, iteration)
    new_step = step + 1
    metrics: dict[str, Any]
    if not step_missing(run, new_step):  # a retry after the checkpoint committed but before the metrics did
        if ranks.is_main:
            republish(run, new_step)
        recorded = ckpt.read_metadata(run.checkpoint_path(new_step)) or {}
        metrics = dict(recorded.get("update_metrics", {"checkpoint/step": float(new_step)}))
    else:
        trainer = handoff.take(run, step) if handoff is not None else load_trainer(run, step)
        rates = set_learning_rates(config, trainer.train_models, iteration)
        ckpt.seed_global_rngs(config.seed, new_step)  # rng.pt: the same whether the trainer was loaded or handed on
        metrics = _train(run, iteration, trainer, step)
        metrics["actor/lr"] = rates["actor"]
        metrics["checkpoint/step"] = float(new_step)
        save_trainer(run, trainer, new_step, metadata={"update_metrics": json_floats(metrics)})
        if handoff is not None:
            handoff.keep(run, trainer, new_step)
    metrics["timing/update_stage_s"] = time.perf_counter() - t0  # checkpoint load/save + ppo_update (timing/update_s)
    finite = json_floats(metrics)
    if ranks.is_main:
        run.store.write_json(
            run.run_id,
            iteration,
            "update",
            "metrics",
            finite,
            producer=PRODUCER,
            policy_version=new_step,
            weights_fingerprint=marker_fingerprint(run, new_step),  # the lineage's record of step new_step
        )
    return finite


def _launch(run: Run, iteration: int, nproc: int) -> None:
    """Run the update's ranks and wait: an Indexed Job across ``update.nnodes`` pods, else torchrun here."""
    if run.config.update.nnodes > 1:
        from ragen_tasks.training.k8s_launch import launch_indexed_job  # lazy: the kubernetes client

        launch_indexed_job(run.uri, iteration, run.config)
    else:
        launch_update_ranks(run.uri, iteration, nproc, known_errors=RANK_ERRORS)
    if not run.store.has_manifest(run.run_id, iteration, "update", "metrics"):
        raise RuntimeError(
            f"iteration {iteration}: the update ranks exited cleanly but committed no metrics at "
            f"{run.store.uri(run.run_id, iteration, 'update', 'metrics')}"
        )


def _train(run: Run, iteration: int, trainer: Trainer, step: int) -> dict[str, Any]:
    """``ppo_update`` on the iteration's batch (on this rank's shards); refuse weights that diverged."""
    config = run.config
    batch = _read_batch(run, iteration)
    if not batch.num_rows:
        log.warning("iteration %d: the filtered batch is empty; the policy is carried over unchanged", iteration)
        return {"batch/trajectories": 0.0}
    pad_id = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else 0
    ref = make_reference(trainer.actor_module) if config.algo.kl_mode != "none" else None
    device = next(trainer.actor_module.parameters()).device
    demos = _demonstrations(run, iteration, trainer, batch.num_rows, pad_id)
    tokens = collate_table(batch, pad_id=pad_id)
    if config.algo.advantage in TURN_ADVANTAGES:
        tokens = turn_advantages_batch(tokens, from_table(batch), config)
    try:
        metrics = ppo_update(
            tokens.to(device),
            actor=trainer.train_models["actor"],
            algo=config.algo,
            optim=config.optim,
            generator=trainer.generator,
            critic=trainer.train_models.get("critic"),
            ref_model=ref,
            demos=demos.to(device) if demos is not None else None,
        )
    except NonFiniteUpdateError as exc:
        raise NonFiniteUpdateError(f"iteration {iteration}: {exc}. {_continue_hint(run, step, 'lr')}") from None
    with contextlib.ExitStack() as stack:  # every rank checks the whole weights (ZeRO-3 gathers them)
        for train_model in trainer.train_models.values():
            stack.enter_context(train_model.full_weights())
        found = diverged_weights({"actor": trainer.actor_module, **trainer.models}, config.optim.max_weight_abs)
    problem = next((p for p in all_gather(found) if p), None)  # all ranks raise, or none
    if problem is not None:
        lr = "critic_lr" if problem.startswith("critic") else "lr"
        steps, skipped = metrics.get("actor/steps", 0), metrics.get("actor/skipped_steps", 0)
        raise DivergedUpdateError(
            f"iteration {iteration}: the update from checkpoint step {step} diverged: {problem} "
            f"(optim.{lr}={getattr(config.optim, lr):g}; {skipped:.0f} of {steps + skipped:.0f} optimizer "
            f"steps skipped for a non-finite gradient norm). Checkpoint step {step + 1} was NOT committed. "
            f"{_continue_hint(run, step, lr)}"
        )
    return metrics


def _demonstrations(run: Run, iteration: int, trainer: Trainer, rows: int, pad_id: int) -> TokenBatch | None:
    """The demonstration episodes of the update's supervised term (None when ``algo.demo_loss_coef``
    is 0): ``algo.demo_episodes`` for each optimizer step the batch of ``rows`` trajectories can take."""
    algo, optim = run.config.algo, run.config.optim
    if algo.demo_loss_coef == 0:
        return None
    from ragen_tasks.training.warm_start import rl_demonstrations  # lazy: the demonstrators and their games

    steps = optim.ppo_epochs * math.ceil(rows / optim.minibatch_size)
    episodes = rl_demonstrations(
        trainer.tokenizer, run.config, iteration=iteration, episodes=steps * algo.demo_episodes
    )
    return collate(episodes, pad_id=pad_id)


def _continue_hint(run: Run, step: int, lr: str) -> str:
    return (
        f"The run can continue from checkpoint step {step} with a lower learning rate: "
        f"ragen train <same preset and --set> --run-id {run.run_id} --resume-set optim.{lr}=<lower> "
        "(the change is recorded in the run)"
    )


def _read_batch(run: Run, iteration: int) -> Any:
    """The iteration's training batch; one that cannot be read back is quarantined together with the
    filter's summary, so a rerun filters the rollouts again and commits the batch anew."""
    try:
        return read_or_quarantine(run.store, run.run_id, iteration, "batch")[0]
    except BatchValidationError:
        if current_ranks().is_main and run.store.has_manifest(run.run_id, iteration, "batch", "summary"):
            run.store.quarantine(run.run_id, iteration, "batch", "summary", {"reason": "its batch was quarantined"})
        raise


def rollback(run: Run, iteration: int, *, to_step: int, new_step: int) -> dict[str, Any]:
    """Commit checkpoint ``new_step`` holding checkpoint ``to_step``'s exact weights, optimizer and
    RNG state (the guard's rollback; a file copy, so every rank's optimizer part is kept), so the
    next iteration continues from the healthy policy."""
    if not run.store.has_manifest(run.run_id, iteration, "update", "rollback"):
        if step_missing(run, new_step):
            copy_trainer(run, to_step, new_step)
        else:
            republish(run, new_step)
        run.store.write_json(
            run.run_id,
            iteration,
            "update",
            "rollback",
            {"to_step": to_step, "new_step": new_step, "fingerprint": marker_fingerprint(run, new_step)},
            producer=PRODUCER,
            policy_version=new_step,
            weights_fingerprint=marker_fingerprint(run, new_step),
        )
    result, _ = run.store.read_json(run.run_id, iteration, "update", "rollback")
    return dict(result)

"""The StarPO pipeline as library functions, by concept; the Prefect flows in ``flows/`` call them.

- ``run``: a run's identity and storage layout (``Run``, ``open_run``, ``open_existing_run``);
- ``lineage``: which checkpoint step each iteration samples with, fingerprints, the committed
  iteration rows, the run as an iteration must see it (``run_in_force``);
- ``trainer``: build, save and load the trainer; the warm-started initial policy and its cache;
- ``policy``: rollouts and held-out evaluation of the policy in a checkpoint folder;
- ``stages``: the stages of an iteration (generate tasks, rollout, filter + validate, evaluate,
  record), each idempotent through the store's manifests; ``update_stage``: the update (on one
  process or several data-parallel ranks, ``update_ranks`` being a rank's program) and the rollback;
- ``async_rollout``: rollout workers and the trainer's consumption of their batches (async mode).

The public names of the first five are importable from here (``pipeline.update(run, k)``).
"""

from ragen_tasks.pipeline.lineage import (
    fingerprint,
    history,
    marker_fingerprint,
    policy_step,
    recorded_fingerprint,
    run_for_iteration,
    run_in_force,
    trusted_fingerprints,
)
from ragen_tasks.pipeline.policy import evaluate_checkpoint, play_checkpoint
from ragen_tasks.pipeline.run import (
    PRODUCER,
    RESUMABLE_KEYS,
    Run,
    apply_changes,
    check_can_start,
    config_differences,
    describe_differences,
    open_existing_run,
    open_run,
    recorded_changes,
    run_of_checkpoint,
)
from ragen_tasks.pipeline.stages import (
    batch_limits,
    evaluate,
    evaluate_step,
    filter_and_validate,
    flatten_eval,
    generate_tasks,
    init_run,
    initial_eval,
    iteration_row,
    record_iteration,
    rollout,
    should_evaluate,
    stop_record,
)
from ragen_tasks.pipeline.trainer import (
    Trainer,
    TrainerHandoff,
    build_trainer,
    load_trainer,
    save_trainer,
    warm_start_key,
    warm_started_policy,
)
from ragen_tasks.pipeline.update_stage import rollback, update

__all__ = [
    "PRODUCER",
    "RESUMABLE_KEYS",
    "Run",
    "Trainer",
    "TrainerHandoff",
    "apply_changes",
    "batch_limits",
    "build_trainer",
    "check_can_start",
    "config_differences",
    "describe_differences",
    "evaluate",
    "evaluate_checkpoint",
    "evaluate_step",
    "filter_and_validate",
    "fingerprint",
    "flatten_eval",
    "generate_tasks",
    "history",
    "init_run",
    "initial_eval",
    "iteration_row",
    "load_trainer",
    "marker_fingerprint",
    "open_existing_run",
    "open_run",
    "play_checkpoint",
    "policy_step",
    "record_iteration",
    "recorded_changes",
    "recorded_fingerprint",
    "rollback",
    "rollout",
    "run_for_iteration",
    "run_in_force",
    "run_of_checkpoint",
    "save_trainer",
    "should_evaluate",
    "stop_record",
    "trusted_fingerprints",
    "update",
    "warm_start_key",
    "warm_started_policy",
]

"""A run: its identity (id, config in force) and where its data, reports and checkpoints live."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ragen_tasks.config import ConfigError, TrainConfig, UpdateConfig, with_overrides
from ragen_tasks.data.keys import check_run_id, checkpoint_key
from ragen_tasks.data.store import Store
from ragen_tasks.training import checkpoint as ckpt

PRODUCER = "ragen_tasks.pipeline"  # the producer named in the manifests the stages commit

#: What a resumed run may change, explicitly (``ragen train --resume-set KEY=VALUE``), recorded in the
#: run: optimizer settings that change how the next updates step, not what a checkpoint holds (the
#: way to continue a run that diverged with a lower learning rate), and where the update runs (its
#: ranks and pods: a checkpoint written by N ranks resumes on M, see ``checkpoint.load_optimizers``).
RESUMABLE_KEYS = (
    "optim.lr",
    "optim.critic_lr",
    "optim.lr_schedule",
    "optim.lr_end_fraction",
    "optim.max_grad_norm",
    "optim.weight_decay",
    "optim.max_consecutive_skips",
    "optim.max_weight_abs",
    *(f"update.{name}" for name in UpdateConfig.model_fields),
)
_CHANGE = "config-change-{:03d}"  # iter_000000/summary/<name>: the recorded --resume-set changes, in order


@dataclass(frozen=True)
class Run:
    """Where a run lives. Checkpoints are written to a local folder (the run folder itself on a
    local store; a scratch cache mirrored to the store on ``s3://``)."""

    config: TrainConfig  # the config in force (the run's config + the guard's mitigations, see lineage.run_in_force)
    run_id: str
    store: Store
    protect_steps: frozenset[int] = frozenset()  # checkpoints never pruned (the guard's last healthy one)

    @property
    def uri(self) -> str:
        """The run's store URI: what a stage task or deployment gets instead of the run object."""
        return self.store.uri(self.run_id)

    @property
    def is_local(self) -> bool:
        return self.store.protocol == "file"

    @property
    def run_dir(self) -> Path:
        """Local folder of the run (reports, summary.json, checkpoints on a local store)."""
        if self.is_local:
            return Path(self.uri.removeprefix("file://"))
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

    def prune_store_checkpoints(self) -> None:
        """On an s3:// store, delete the checkpoints in the bucket that ``checkpoint.keep_last`` no
        longer keeps (the same rule as the local scratch; no-op on a local store, whose run folder is
        the scratch)."""
        if self.is_local:
            return
        steps = self.store.list_checkpoints(self.run_id)
        doomed = ckpt.steps_to_prune(steps, keep_last=self.config.checkpoint.keep_last, protect=self.protect_steps)
        # and the uncommitted folders of older steps: what an upload or a prune killed half-way left
        newest = max(steps, default=-1)
        doomed += [
            s for s in self.store.list_checkpoints(self.run_id, committed=False) if s < newest and s not in steps
        ]
        for step in doomed:
            self.store.remove_dir(checkpoint_key(self.run_id, step))


def open_run(config: TrainConfig, run_id: str | None = None) -> Run:
    """The run for ``config``: ``run_id`` (or ``config.run_id``, or ``<preset>-<UTC time>``)."""
    rid = run_id or config.run_id or f"{Path(config.preset).stem}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    return Run(config=config, run_id=check_run_id(rid), store=Store(config.store.root))


def open_existing_run(run: str) -> Run:
    """An existing run from its folder (``runs/<id>``) or URI (``s3://bucket/prefix/<id>``), with the
    config it was started with and the ``--resume-set`` changes recorded since. Raises
    FileNotFoundError naming what is missing."""
    root, _, run_id = run.rstrip("/").rpartition("/")
    store = Store(root or ".")
    if not store.has_manifest(check_run_id(run_id), 0, "summary", "config"):
        raise FileNotFoundError(
            f"{run!r} is not a RAGEN run: no committed config at {store.uri(run_id, 0, 'summary', 'config')}"
        )
    stored, _ = store.read_json(run_id, 0, "summary", "config")
    config = apply_changes(TrainConfig.model_validate(stored), recorded_changes(store, run_id))
    return Run(config=config, run_id=run_id, store=store)


def check_resumable(changes: Mapping[str, Any]) -> None:
    """Only ``RESUMABLE_KEYS`` may change on resume: raise ConfigError naming the first other key."""
    for key in changes:
        if key not in RESUMABLE_KEYS:
            raise ConfigError(
                f"--resume-set {key}: only these settings may change when a run resumes: {', '.join(RESUMABLE_KEYS)}; "
                "start a new run (another --run-id) to change anything else"
            )


def recorded_changes(store: Store, run_id: str) -> list[dict[str, Any]]:
    """The run's recorded ``--resume-set`` changes, oldest first: ``{"set", "previous", "from_iteration"}``."""
    changes: list[dict[str, Any]] = []
    while store.has_manifest(run_id, 0, "summary", _CHANGE.format(len(changes) + 1)):
        changes.append(dict(store.read_json(run_id, 0, "summary", _CHANGE.format(len(changes) + 1))[0]))
    return changes


def record_change(store: Store, run_id: str, change: Mapping[str, Any]) -> None:
    """Append one ``--resume-set`` change to the run's record (create-only, like every commit)."""
    name = _CHANGE.format(len(recorded_changes(store, run_id)) + 1)
    store.write_json(run_id, 0, "summary", name, dict(change), producer=PRODUCER)


def apply_changes(config: TrainConfig, changes: list[dict[str, Any]]) -> TrainConfig:
    for change in changes:
        config = with_overrides(config, change["set"])
    return config


def check_can_start(config: TrainConfig, run_id: str | None, resume_set: Mapping[str, Any] | None = None) -> None:
    """What can be checked before any work (and before Prefect starts): the run id's syntax, the store's
    scheme and writability, that no live process holds the run, and that a resumed run keeps its
    config. Each failure raises an error whose message is one line (ValueError, UnsafeKeyError,
    StoreNotWritableError, ConfigError, RunLeaseError)."""
    from ragen_tasks.pipeline.lease import check_free

    check_resumable(resume_set or {})
    rid = run_id or config.run_id
    if rid is not None:
        check_run_id(rid)
    store = Store(config.store.root)
    store.check_writable()
    if rid is None:
        return
    check_free(store, rid, config.store.lease_stale_s)
    if store.has_manifest(rid, 0, "summary", "config"):
        changes = [*recorded_changes(store, rid), {"set": dict(resume_set or {})}]
        stored = apply_changes(TrainConfig.model_validate(store.read_json(rid, 0, "summary", "config")[0]), changes)
        current = apply_changes(config, changes)
        check_same_config(stored.model_dump(mode="json"), current.model_dump(mode="json"), store.uri(rid))
    elif resume_set:
        raise ConfigError(f"--resume-set: run {store.uri(rid)} does not exist yet; use --set to configure a new run")


#: Config keys a resume may differ in without being another experiment: the length of the run and
#: where the store is (a run folder may be moved or copied; its id and its contents are the run).
_RESUME_FREE = ("iterations", "preset", "run_id", "store.root", "store.storage_options", "store.lease_stale_s")


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value and key != "config":  # an env's options compare as one value
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(
    stored: Mapping[str, Any], current: Mapping[str, Any], *, free: tuple[str, ...] = ()
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, stored value, current value)`` for every leaf key whose values differ, sorted by
    key; a key in ``free``, or under one (``store`` frees ``store.root``), is not compared."""
    a, b = _flat(stored), _flat(current)

    def is_free(key: str) -> bool:
        return any(key == f or key.startswith(f + ".") for f in free)

    keys = sorted(k for k in a.keys() | b.keys() if not is_free(k) and a.get(k) != b.get(k))
    return [(k, a.get(k), b.get(k)) for k in keys]


def describe_differences(differences: list[tuple[str, Any, Any]], *, current: str) -> str:
    """``config_differences`` in words: the first five keys with both values (``current`` names the
    second, e.g. "now"), then how many more."""
    shown = ", ".join(f"{key} ({was!r} in the run, {now!r} {current})" for key, was, now in differences[:5])
    return shown + (f" and {len(differences) - 5} more" if len(differences) > 5 else "")


def check_same_config(stored: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Resuming with another config would silently mix two experiments: refuse, naming the keys and
    the values. ``iterations`` may grow (extend a finished run); the store may have moved;
    ``RESUMABLE_KEYS`` change only through ``--resume-set`` (recorded)."""
    differences = config_differences(stored, current, free=_RESUME_FREE)
    if differences:
        shown = describe_differences(differences, current="now")
        hint = ""
        if all(k in RESUMABLE_KEYS for k, _, _ in differences):
            hint = "; to change it for the rest of this run, resume with " + " ".join(
                f"--resume-set {k}={now}" for k, _, now in differences
            )
        raise ConfigError(
            f"run {where} already exists with a different config (differs in: {shown}){hint}; "
            "or use a new run id, or the same settings to resume"
        )


def run_of_checkpoint(path: Path) -> Run | None:
    """The run a local checkpoint folder belongs to (``<root>/<run>/checkpoints/step_k``), if any."""
    run_dir = Path(path).resolve().parent.parent
    try:
        return open_existing_run(str(run_dir))
    except (FileNotFoundError, ValueError):
        return None

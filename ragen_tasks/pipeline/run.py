"""A run: its identity (id, config in force) and where its data, reports and checkpoints live."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ragen_tasks.config import TrainConfig
from ragen_tasks.data.keys import check_run_id
from ragen_tasks.data.store import Store
from ragen_tasks.training import checkpoint as ckpt

PRODUCER = "ragen_tasks.pipeline"  # the producer named in the manifests the stages commit


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

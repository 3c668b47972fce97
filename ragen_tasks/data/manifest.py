"""Manifests: the commit record of one stored item (a trajectory batch or a JSON object).

A manifest is written LAST and create-only; its existence means "complete". Readers trust the
manifest only (never a folder listing): they read exactly the objects it names and check each
object's sha256 and size. Manifests are plain JSON; nothing in the store is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ragen_tasks.data.keys import check_data_file_name, check_index, check_part, check_run_id, check_stage
from ragen_tasks.data.trajectory import SCHEMA_VERSION

MANIFEST_VERSION = 1
Kind = Literal["trajectories", "json"]


class ManifestError(ValueError):
    """A manifest is missing, unreadable or inconsistent with what it describes."""


class CorruptObjectError(ManifestError):
    """A committed object cannot be read back: its bytes changed after commit or do not parse.
    The stage that reads it quarantines it, so a rerun produces it again."""


class ChecksumError(CorruptObjectError):
    """An object's bytes do not match the sha256 / size recorded in its manifest."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjectEntry:
    """One data object named by a manifest: a file name inside the manifest's stage folder."""

    name: str  # e.g. "trajectories-00000-1a2b3c4d5e6f7a8b.parquet"
    sha256: str  # hex digest of the object's bytes
    size: int  # bytes
    rows: int  # trajectories in a shard; 1 for a JSON object


@dataclass(frozen=True)
class Manifest:
    """What a committed item is, where its bytes are and who made it (for freshness)."""

    run_id: str
    iteration: int
    stage: str
    name: str  # item name within the stage, e.g. "trajectories" or "tasks"
    kind: Kind
    producer: str  # free text: flow/task name, host, engine
    policy_version: int  # policy that produced the data (-1 when not applicable, e.g. task lists)
    weights_fingerprint: str  # sha256 of that policy's weights ("" when not applicable)
    objects: tuple[ObjectEntry, ...]
    num_rows: int  # trajectories in the batch (sum of object rows)
    schema_version: int = SCHEMA_VERSION  # trajectory schema version (ragen_tasks.data.trajectory)
    manifest_version: int = MANIFEST_VERSION
    created_at: str = ""  # ISO-8601 UTC, informational only
    extra: dict[str, Any] = field(default_factory=dict)  # small JSON-able summary (counts, metrics)

    def to_json_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @staticmethod
    def from_json_bytes(data: bytes, *, where: str) -> Manifest:
        """Parse and validate a manifest; every object name is checked as a safe key part."""
        try:
            raw = json.loads(data.decode())
            objects = tuple(ObjectEntry(**o) for o in raw.pop("objects"))
            manifest = Manifest(objects=objects, **raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ManifestError(f"manifest at {where} is not a valid manifest v{MANIFEST_VERSION}: {e}") from e
        manifest.check(where=where)
        return manifest

    def check(self, *, where: str) -> None:
        """Raise ManifestError / UnsafeKeyError if a field is out of contract."""
        check_run_id(self.run_id)
        check_index(self.iteration, "iteration")
        check_stage(self.stage)
        check_part(self.name, "name")
        if self.manifest_version != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest at {where}: manifest_version={self.manifest_version}, reader knows {MANIFEST_VERSION}"
            )
        if self.kind not in ("trajectories", "json"):
            raise ManifestError(f"manifest at {where}: kind={self.kind!r} must be 'trajectories' or 'json'")
        if self.kind == "trajectories" and self.schema_version != SCHEMA_VERSION:
            raise ManifestError(
                f"manifest at {where}: trajectory schema_version={self.schema_version}, this code reads {SCHEMA_VERSION}"
            )
        for entry in self.objects:
            check_data_file_name(entry.name)
            if self.kind == "trajectories" and not entry.name.endswith(".parquet"):
                raise ManifestError(f"manifest at {where}: trajectory object {entry.name!r} must be .parquet")
            if self.kind == "json" and not entry.name.endswith(".json"):
                raise ManifestError(f"manifest at {where}: json object {entry.name!r} must be .json")
        if sum(e.rows for e in self.objects) != self.num_rows:
            raise ManifestError(f"manifest at {where}: num_rows={self.num_rows} != sum of object rows")

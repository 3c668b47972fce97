"""The run store: trajectories, small JSON objects and checkpoint folders over fsspec.

One class, :class:`Store`, for a local folder, ``file://...`` or ``s3://bucket/prefix`` (s3fs; the
endpoint comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, credentials from the standard
AWS variables or pod identity; neither keys nor secrets are ever logged). Layout: see ``keys.py``.

Commit protocol (design section 6):

1. data objects first: Parquet shards / JSON, named by content hash and written create-only, so a
   retry or a racing writer never changes bytes that a committed manifest points to;
2. the manifest LAST and create-only. Locally every file is written under no name (Linux
   ``O_TMPFILE``) and linked to its final name once synced: a link fails with EEXIST like
   ``O_EXCL``, never exposes a half-written file, and a writer killed part-way leaves nothing
   behind (``local_files.write_local_file``). On S3: ``PutObject`` with ``If-None-Match: *`` (a conditional
   write: S3 answers 412 to every writer but the first; supported by AWS S3 since 2024-08, by
   moto, and by MinIO; an endpoint that ignores the header degrades to last-writer-wins between
   racing writers of one item, which the run lease rules out in practice);
3. readers trust manifests only, never listings, and check each object's size and sha256. S3 is
   strongly read-after-write consistent (AWS, since 2020-12), so a reader that sees a manifest also
   sees the objects written before it; a 412 from a racing writer leaves the first manifest intact.

A writer that finds its manifest already there returns it at once without rewriting anything
(idempotent retries). The writer that commits an item, or loses the race to, then deletes the
item's data objects the stored manifest does not name: what an attempt killed before its commit
left (``_remove_orphans``; locally and on S3, whose creates are exclusive). Nothing is ever
unpickled: data is Parquet or JSON.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from ragen_tasks.data.keys import (
    MANIFEST_SUFFIX,
    UnsafeKeyError,
    check_data_file_name,
    check_index,
    check_relative_key,
    check_run_id,
    check_stage,
    checkpoint_key,
    manifest_key,
    parse_iteration_folder,
    quarantine_prefix,
    stage_prefix,
)
from ragen_tasks.data.local_files import write_local_file
from ragen_tasks.data.manifest import (
    ChecksumError,
    CorruptObjectError,
    Kind,
    Manifest,
    ManifestError,
    ObjectEntry,
    sha256_hex,
)
from ragen_tasks.data.trajectory import Trajectory, from_table, to_table

log = logging.getLogger(__name__)

DIR_MANIFEST = "_STORE_MANIFEST.json"  # commit marker of an uploaded folder, written LAST
_CHUNK = 8 * 2**20
# Manifests and small JSON objects are read whole; a store anyone else can write must not make a
# reader allocate whatever it finds, so both are refused above these sizes.
MAX_MANIFEST_BYTES = 1 * 2**20
MAX_SMALL_OBJECT = 64 * 2**20


class StoreNotWritableError(ValueError):
    """The store root cannot be written (no bucket, no permission, read-only folder)."""


class Store:
    """A run store rooted at a local folder, ``file://`` URL or ``s3://bucket/prefix``.

    ``storage_options`` are passed to the fsspec filesystem (e.g. ``{"anon": False}``); prefer the
    standard AWS environment variables for endpoint and credentials.
    """

    def __init__(self, root: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(root, str) or not root.strip():
            raise ValueError(f"store root={root!r} must be a folder, file://... or s3://bucket/prefix")
        protocol, path = _split_root(root)
        self.protocol = protocol
        options = dict(storage_options or {})
        if protocol == "file":
            self._root = os.path.abspath(path)
            self.fs: fsspec.AbstractFileSystem = fsspec.filesystem("file", auto_mkdir=True)
        else:
            self._root = path.strip("/")
            if protocol == "s3":
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                if endpoint and "endpoint_url" not in options.get("client_kwargs", {}):
                    options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": endpoint}
                options.setdefault("use_listings_cache", False)  # readers never rely on listings
                log.info("store on s3://%s (endpoint %s)", self._root, endpoint or "AWS default")
            self.fs = fsspec.filesystem(protocol, **options)
        self.root_uri = f"{protocol}://{self._root}"

    # ------------------------------------------------------------------ display
    def uri(self, run_id: str, iteration: int | None = None, stage: str | None = None, name: str | None = None) -> str:
        """A human-readable URI of a run, an iteration, a stage folder or an item's manifest."""
        if iteration is None:
            return f"{self.root_uri}/{check_run_id(run_id)}"
        if stage is None:
            return f"{self.root_uri}/{check_run_id(run_id)}/iter_{check_index(iteration, 'iteration'):06d}"
        if name is None:
            return f"{self.root_uri}/{stage_prefix(run_id, iteration, stage)}"
        return f"{self.root_uri}/{manifest_key(run_id, iteration, stage, name)}"

    # ------------------------------------------------------------------ trajectories
    def write_trajectories(
        self,
        run_id: str,
        iteration: int,
        stage: str,
        trajectories: Iterable[Trajectory],
        *,
        producer: str,
        policy_version: int,
        weights_fingerprint: str,
        extra: dict[str, Any] | None = None,
        name: str = "trajectories",
    ) -> Manifest:
        """Store a batch as Parquet and commit it; return its manifest (the existing one on retry)."""
        mkey = manifest_key(run_id, iteration, stage, name)  # validates every part before I/O
        existing = self._read_manifest_if_any(mkey)
        if existing is not None:
            log.info("%s already committed: returning its manifest", self._path(mkey))
            return existing
        table = to_table(list(trajectories))
        buf = io.BytesIO()
        pq.write_table(table, buf)
        data = buf.getvalue()
        entry = self._put_object(run_id, iteration, stage, f"{name}-00000", ".parquet", data, rows=table.num_rows)
        manifest = self._manifest(
            run_id,
            iteration,
            stage,
            name,
            "trajectories",
            (entry,),
            producer=producer,
            policy_version=policy_version,
            weights_fingerprint=weights_fingerprint,
            extra=extra,
        )
        return self._commit(mkey, manifest)

    def read_table(
        self, run_id: str, iteration: int, stage: str, name: str = "trajectories"
    ) -> tuple[pa.Table, Manifest]:
        """The committed batch as one Arrow table (objects named by the manifest, checksums checked)."""
        manifest = self.read_manifest(run_id, iteration, stage, name)
        if manifest.kind != "trajectories":
            raise ManifestError(
                f"{self.uri(run_id, iteration, stage, name)} holds kind={manifest.kind!r}, not trajectories"
            )
        tables = []
        for entry in manifest.objects:
            data = self._get_checked(stage_prefix(run_id, iteration, stage), entry)
            try:
                table = pq.read_table(pa.BufferReader(data))
            except (pa.ArrowException, OSError) as e:  # the checksum matched: the writer committed bad bytes
                raise CorruptObjectError(
                    f"{self.uri(run_id, iteration, stage, name)}: {entry.name} is not readable Parquet ({e})"
                ) from e
            if table.num_rows != entry.rows:
                raise CorruptObjectError(f"{entry.name}: {table.num_rows} rows, manifest says {entry.rows}")
            tables.append(table)
        if not tables:
            raise ManifestError(f"{self.uri(run_id, iteration, stage, name)} names no objects")
        return pa.concat_tables(tables), manifest

    def read_trajectories(
        self, run_id: str, iteration: int, stage: str, name: str = "trajectories"
    ) -> tuple[list[Trajectory], Manifest]:
        """The committed batch. Raises ManifestError if uncommitted, ChecksumError if tampered."""
        table, manifest = self.read_table(run_id, iteration, stage, name)
        return from_table(table), manifest

    # ------------------------------------------------------------------ small JSON objects
    def write_json(
        self,
        run_id: str,
        iteration: int,
        stage: str,
        name: str,
        obj: Any,
        *,
        producer: str,
        policy_version: int = -1,
        weights_fingerprint: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Commit a JSON-serialisable object (task list, eval result, summary) like a batch."""
        mkey = manifest_key(run_id, iteration, stage, name)
        existing = self._read_manifest_if_any(mkey)
        if existing is not None:
            log.info("%s already committed: returning its manifest", self._path(mkey))
            return existing
        data = json.dumps(obj, sort_keys=True).encode()
        entry = self._put_object(run_id, iteration, stage, name, ".json", data, rows=1)
        manifest = self._manifest(
            run_id,
            iteration,
            stage,
            name,
            "json",
            (entry,),
            producer=producer,
            policy_version=policy_version,
            weights_fingerprint=weights_fingerprint,
            extra=extra,
        )
        return self._commit(mkey, manifest)

    def read_json(self, run_id: str, iteration: int, stage: str, name: str) -> tuple[Any, Manifest]:
        manifest = self.read_manifest(run_id, iteration, stage, name)
        if manifest.kind != "json" or len(manifest.objects) != 1:
            raise ManifestError(
                f"{self.uri(run_id, iteration, stage, name)} holds kind={manifest.kind!r}, not one JSON object"
            )
        if manifest.objects[0].size > MAX_SMALL_OBJECT:
            raise ManifestError(
                f"{self.uri(run_id, iteration, stage, name)} names a {manifest.objects[0].size}-byte JSON object "
                f"(limit {MAX_SMALL_OBJECT}): refusing to read it"
            )
        data = self._get_checked(stage_prefix(run_id, iteration, stage), manifest.objects[0])
        try:
            return json.loads(data.decode()), manifest
        except (UnicodeDecodeError, ValueError) as e:  # the checksum matched, so the writer wrote garbage
            raise CorruptObjectError(f"{self.uri(run_id, iteration, stage, name)}: not valid JSON ({e})") from e

    # ------------------------------------------------------------------ manifests
    def has_manifest(self, run_id: str, iteration: int, stage: str, name: str = "trajectories") -> bool:
        return bool(self.fs.exists(self._path(manifest_key(run_id, iteration, stage, name))))

    def read_manifest(self, run_id: str, iteration: int, stage: str, name: str = "trajectories") -> Manifest:
        mkey = manifest_key(run_id, iteration, stage, name)
        manifest = self._read_manifest_if_any(mkey)
        if manifest is None:
            raise ManifestError(
                f"no committed {stage}/{name} at {self.root_uri}/{mkey}: the manifest is missing (the stage did "
                "not finish, or its batch was quarantined). Run the stage (again) for this iteration."
            )
        if (manifest.run_id, manifest.iteration, manifest.stage, manifest.name) != (run_id, iteration, stage, name):
            raise ManifestError(
                f"manifest at {self.root_uri}/{mkey} describes another item: {manifest.run_id}/"
                f"{manifest.iteration}/{manifest.stage}/{manifest.name}"
            )
        return manifest

    def iterations(self, run_id: str) -> list[int]:
        """Iterations that have a folder in the run, ascending (a listing: for discovery only; read
        what it finds through manifests)."""
        base = self._path(check_run_id(run_id))
        if not self.fs.exists(base):
            return []
        found = (parse_iteration_folder(_base_name(p)) for p in self.fs.ls(base, detail=False))
        return sorted(k for k in found if k is not None)

    def committed_names(self, run_id: str, iteration: int, stage: str) -> list[str]:
        """Names of the items with a manifest in a stage folder, sorted (a listing, as ``iterations``)."""
        folder = self._path(stage_prefix(run_id, iteration, stage))
        if not self.fs.exists(folder):
            return []
        names = (_base_name(p) for p in self.fs.ls(folder, detail=False))
        return sorted(n.removesuffix(MANIFEST_SUFFIX) for n in names if n.endswith(MANIFEST_SUFFIX))

    def last_committed_iteration(self, run_id: str, stage: str, name: str = "trajectories") -> int | None:
        """Highest k such that iterations 0..k all have a committed ``stage/name`` (probes manifests)."""
        check_stage(stage)
        k = -1
        while k + 1 <= 999_999 and self.has_manifest(run_id, k + 1, stage, name):
            k += 1
        return None if k < 0 else k

    # ------------------------------------------------------------------ quarantine
    def quarantine(self, run_id: str, iteration: int, stage: str, name: str, result: dict[str, Any]) -> str:
        """Move a committed item to the quarantine prefix with ``result`` (JSON) beside it.

        Each quarantine gets its own numbered folder (``.../q-000001/``), so quarantining the same
        item again (a re-produced batch that fails again) keeps the first record. Copy first
        (objects, result, manifest), then remove the original manifest (the item is no longer
        committed) and then its objects. Returns the quarantine folder URI.
        """
        mkey = manifest_key(run_id, iteration, stage, name)
        try:
            manifest: Manifest | None = self.read_manifest(run_id, iteration, stage, name)
            raw = manifest.to_json_bytes() if manifest is not None else b""
        except ManifestError:  # the manifest itself is unreadable: keep its bytes, its objects stay unreferenced
            manifest, raw = None, self.get_object(mkey, max_bytes=MAX_MANIFEST_BYTES) or b""
        src, base = stage_prefix(run_id, iteration, stage), quarantine_prefix(run_id, iteration, stage)
        seq = 1
        while self.fs.exists(self._path(f"{base}/q-{seq:06d}")):
            seq += 1
        dst = f"{base}/q-{seq:06d}"
        objects = manifest.objects if manifest is not None else ()
        for entry in objects:
            if self.fs.exists(self._path(f"{src}/{entry.name}")):
                self.fs.copy(self._path(f"{src}/{entry.name}"), self._path(f"{dst}/{entry.name}"))
        self._put_bytes(
            f"{dst}/{name}.validation.json", json.dumps(result, indent=1, sort_keys=True, default=str).encode()
        )
        self._put_bytes(f"{dst}/{name}.manifest.json", raw)
        self.fs.rm(self._path(mkey))
        for entry in objects:
            if self.fs.exists(self._path(f"{src}/{entry.name}")):
                self.fs.rm(self._path(f"{src}/{entry.name}"))
        where = f"{self.root_uri}/{dst}"
        log.warning("quarantined %s/%s of %s iteration %d to %s", stage, name, run_id, iteration, where)
        return where

    # ------------------------------------------------------------------ folders (checkpoints)
    def upload_dir(self, local_dir: str | os.PathLike[str], key: str, *, marker: str | None = "COMMITTED.json") -> str:
        """Upload a local folder to ``key``; the folder's own ``marker`` file goes after every other
        file and the store's ``_STORE_MANIFEST.json`` (sha256 of each file) LAST, create-only.
        Idempotent: a folder already committed at ``key`` is left as it is. Returns its URI."""
        check_relative_key(key)
        local = Path(local_dir)
        if not local.is_dir():
            raise FileNotFoundError(f"upload_dir: local folder {local} does not exist")
        mkey = f"{key}/{DIR_MANIFEST}"
        if self.fs.exists(self._path(mkey)):
            log.info("%s already committed: not re-uploading", self._path(key))
            return f"{self.root_uri}/{key}"
        rels = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        for rel in rels:
            check_relative_key(rel, "file in upload_dir")  # no hidden / temp files, no odd names
        rels.sort(key=lambda r: r == marker)  # stable: the folder's own marker goes last
        files = []
        for rel in rels:
            files.append({"path": rel, "sha256": _file_sha256(local / rel), "size": (local / rel).stat().st_size})
            self.fs.put_file(str(local / rel), self._path(f"{key}/{rel}"))
        body = json.dumps({"files": files, "created_at": _now()}, indent=1, sort_keys=True).encode()
        if not self._create_bytes(mkey, body):
            log.warning("%s was committed by another writer meanwhile", self._path(key))
        return f"{self.root_uri}/{key}"

    def download_dir(self, key: str, local_dir: str | os.PathLike[str]) -> Path:
        """Download a committed folder (refused without its store manifest; sha256 checked) to
        ``local_dir``, atomically (temp folder, then rename). If ``local_dir`` already holds the
        same files, it is returned as is."""
        check_relative_key(key)
        local = Path(local_dir)
        files = self._dir_manifest(key)
        if local.exists():
            same = all((local / f["path"]).is_file() and _file_sha256(local / f["path"]) == f["sha256"] for f in files)
            if same:
                return local
            raise FileExistsError(
                f"download_dir: {local} exists and differs from {self.root_uri}/{key}; remove it first"
            )
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.partial-", dir=local.parent))
        try:
            for f in files:
                target = tmp / f["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._path(f"{key}/{f['path']}"), str(target))
                if _file_sha256(target) != f["sha256"]:
                    raise ChecksumError(f"{self.root_uri}/{key}/{f['path']}: sha256 differs from {DIR_MANIFEST}")
            os.replace(tmp, local)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return local

    def upload_checkpoint(self, local_dir: str | os.PathLike[str], run_id: str, step: int) -> str:
        return self.upload_dir(local_dir, checkpoint_key(run_id, step))

    def download_checkpoint(self, run_id: str, step: int, local_dir: str | os.PathLike[str]) -> Path:
        return self.download_dir(checkpoint_key(run_id, step), local_dir)

    def list_checkpoints(self, run_id: str, *, committed: bool = True) -> list[int]:
        """Steps of committed checkpoint folders (a listing filtered by the commit marker), ascending;
        ``committed=False``: of every checkpoint folder, committed or not (to clean up after a crash)."""
        prefix = self._path(f"{check_run_id(run_id)}/checkpoints")
        if not self.fs.exists(prefix):
            return []
        steps = []
        for p in self.fs.ls(prefix, detail=False):
            base = _base_name(p)
            if (
                base.startswith("step_")
                and base[5:].isdigit()
                and (not committed or self.fs.exists(f"{str(p).rstrip('/')}/{DIR_MANIFEST}"))
            ):
                steps.append(int(base[5:]))
        return sorted(steps)

    def remove_dir(self, key: str) -> None:
        """Delete a committed folder: its commit marker first, so it is never half-committed."""
        check_relative_key(key)
        mkey = self._path(f"{key}/{DIR_MANIFEST}")
        if self.fs.exists(mkey):
            self.fs.rm(mkey)
        if self.fs.exists(self._path(key)):
            self.fs.rm(self._path(key), recursive=True)

    # ------------------------------------------------------------------ single objects (leases, reports)
    def create_object(self, key: str, data: bytes) -> bool:
        """Create-only write of ``key`` (a relative key of safe parts): True if this call created it."""
        return self._create_bytes(check_relative_key(key), data)

    def put_object(self, key: str, data: bytes) -> None:
        """Write (overwrite) ``key``; atomic on a local store."""
        self._put_bytes(check_relative_key(key), data)

    def get_object(self, key: str, *, max_bytes: int = MAX_SMALL_OBJECT) -> bytes | None:
        """The bytes of ``key`` (None if absent); refuses an object larger than ``max_bytes``."""
        path = self._path(check_relative_key(key))
        try:
            data: bytes = self.fs.cat_file(path, start=0, end=max_bytes + 1)
        except FileNotFoundError:
            return None
        if len(data) > max_bytes:
            raise ManifestError(f"{self.root_uri}/{key} is larger than {max_bytes} bytes: refusing to read it")
        return data

    def object_exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(check_relative_key(key))))

    def delete_object(self, key: str) -> None:
        path = self._path(check_relative_key(key))
        if self.fs.exists(path):
            self.fs.rm(path)

    def check_writable(self) -> None:
        """Write and delete a probe object at the root, so an unwritable or missing store fails in one
        line before any work. Raises StoreNotWritableError naming the root and the cause."""
        key = f"ragen-write-probe-{uuid.uuid4().hex[:12]}.json"
        try:
            self._put_bytes(key, b"{}")
            self.fs.rm(self._path(key))
        except Exception as exc:  # any backend error (permissions, no bucket, no endpoint) means "not writable"
            raise StoreNotWritableError(
                f"store root={self.root_uri!r} is not writable ({type(exc).__name__}: {exc}); "
                "pick another --store, create the bucket, or fix its permissions"
            ) from None

    # ------------------------------------------------------------------ internals
    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def _manifest(
        self,
        run_id: str,
        iteration: int,
        stage: str,
        name: str,
        kind: Kind,
        objects: tuple[ObjectEntry, ...],
        *,
        producer: str,
        policy_version: int,
        weights_fingerprint: str,
        extra: dict[str, Any] | None,
    ) -> Manifest:
        manifest = Manifest(
            run_id=run_id,
            iteration=iteration,
            stage=stage,
            name=name,
            kind=kind,
            producer=str(producer),
            policy_version=int(policy_version),
            weights_fingerprint=str(weights_fingerprint),
            objects=objects,
            num_rows=sum(o.rows for o in objects),
            created_at=_now(),
            extra=dict(extra or {}),
        )
        json.dumps(manifest.extra)  # fail before committing if extra is not JSON-able
        return manifest

    def _put_object(
        self, run_id: str, iteration: int, stage: str, stem: str, suffix: str, data: bytes, *, rows: int
    ) -> ObjectEntry:
        """Write one data object of an item, named ``{stem}-{sha256[:16]}{suffix}`` (``_object_pattern``)."""
        digest = sha256_hex(data)
        name = check_data_file_name(f"{stem}-{digest[:16]}{suffix}")
        key = f"{stage_prefix(run_id, iteration, stage)}/{name}"
        # Same name <=> same bytes: an object already there is this one from an earlier attempt, unless damaged.
        if not self._create_bytes(key, data) and self.fs.cat_file(self._path(key)) != data:
            log.warning("%s/%s does not hold the bytes its name says: replacing it", self.root_uri, key)
            self._put_bytes(key, data)
        return ObjectEntry(name=name, sha256=digest, size=len(data), rows=rows)

    def _commit(self, mkey: str, manifest: Manifest) -> Manifest:
        """Create the manifest (create-only) and return the one stored: this one, or a racing writer's."""
        stored = manifest
        if self._create_bytes(mkey, manifest.to_json_bytes()):
            log.debug("committed %s (%d rows)", self._path(mkey), manifest.num_rows)
        else:
            found = self._read_manifest_if_any(mkey)
            if found is None:
                raise ManifestError(f"create-only write of {self._path(mkey)} failed but no manifest is there")
            log.warning("%s was committed by another writer first: returning that manifest", self._path(mkey))
            stored = found
        if self.protocol in ("file", "s3"):  # exclusive creates: exactly one manifest won
            self._remove_orphans(manifest, named={o.name for o in stored.objects})
        return stored

    def _remove_orphans(self, item: Manifest, *, named: set[str]) -> None:
        """Delete the data objects of ``item``'s item (this writer's own run, iteration, stage, name and
        kind) that are not in ``named``, the committed manifest's objects: what an attempt killed before
        its commit, or a writer that lost the race to commit, left behind (other bytes, so another
        name). Only this item's object names are looked at (``_object_pattern``)."""
        prefix = stage_prefix(item.run_id, item.iteration, item.stage)
        pattern = _object_pattern(item.name, item.kind)
        for path in self.fs.ls(self._path(prefix), detail=False):
            name = _base_name(path)
            if pattern.fullmatch(name) and name not in named:
                log.info("removing %s/%s/%s: no committed manifest names it", self.root_uri, prefix, name)
                with contextlib.suppress(FileNotFoundError):  # another writer of the item removed it first
                    self.fs.rm(self._path(f"{prefix}/{name}"))

    def _read_manifest_if_any(self, mkey: str) -> Manifest | None:
        try:
            data = self.fs.cat_file(self._path(mkey), start=0, end=MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"manifest at {self.root_uri}/{mkey} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest "
                "this code wrote; refusing to read it"
            )
        return Manifest.from_json_bytes(data, where=f"{self.root_uri}/{mkey}")

    def _get_checked(self, prefix: str, entry: ObjectEntry) -> bytes:
        key = f"{prefix}/{check_data_file_name(entry.name)}"
        try:
            data: bytes = self.fs.cat_file(self._path(key))
        except FileNotFoundError as e:
            raise ManifestError(f"{self.root_uri}/{key} is named by its manifest but missing") from e
        if len(data) != entry.size or sha256_hex(data) != entry.sha256:
            raise ChecksumError(
                f"{self.root_uri}/{key}: checksum mismatch (size {len(data)} vs {entry.size}, sha256 "
                f"{sha256_hex(data)[:16]}.. vs {entry.sha256[:16]}..): the object changed after commit"
            )
        return data

    def _dir_manifest(self, key: str) -> list[dict[str, Any]]:
        try:
            raw = json.loads(self.fs.cat_file(self._path(f"{key}/{DIR_MANIFEST}")).decode())
        except FileNotFoundError as e:
            raise ManifestError(f"{self.root_uri}/{key} is not committed: {DIR_MANIFEST} is missing") from e
        files: list[dict[str, Any]] = raw["files"]
        for f in files:
            check_relative_key(f["path"], f"file in {DIR_MANIFEST}")
        return files

    def _put_bytes(self, key: str, data: bytes) -> None:
        """Write (overwrite) an object; locally atomic (``local_files.write_local_file``)."""
        path = self._path(key)
        if self.protocol == "file":
            write_local_file(path, data, exclusive=False)
        else:
            self.fs.pipe_file(path, data)

    def _create_bytes(self, key: str, data: bytes) -> bool:
        """Create-only write: True if this call created the object, False if it already existed."""
        path = self._path(key)
        if self.protocol == "file":
            return write_local_file(path, data, exclusive=True)
        if self.protocol == "s3":
            try:
                self.fs.pipe_file(path, data, mode="create")  # PutObject with If-None-Match: *
            except FileExistsError:
                return False
            return True
        if self.fs.exists(path):  # other fsspec backends: best effort, not atomic
            return False
        self.fs.pipe_file(path, data)
        return True


def _object_pattern(name: str, kind: Kind) -> re.Pattern[str]:
    """The names ``_put_object`` gives the data objects of item ``name``: ``{name}-{shard:05d}-{hash}.parquet``
    for trajectories, ``{name}-{hash}.json`` for JSON (``hash``: 16 hex digits of the sha256). Exact per
    kind, so no other item's objects match (item ``x`` never matches ``x-00001``'s)."""
    shard = r"-\d{5}" if kind == "trajectories" else ""
    suffix = ".parquet" if kind == "trajectories" else ".json"
    return re.compile(f"{re.escape(name)}{shard}-[0-9a-f]{{16}}{re.escape(suffix)}")


def _split_root(root: str) -> tuple[str, str]:
    if "://" in root:
        protocol, path = root.split("://", 1)
    else:
        protocol, path = "file", root
    if protocol not in ("file", "s3", "memory"):
        raise ValueError(f"store root={root!r}: protocol {protocol!r} not supported; use a folder, file:// or s3://")
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        raise UnsafeKeyError(f"store root={root!r} must not contain '..'")
    if protocol == "s3" and not parts:
        raise ValueError(f"store root={root!r} must name a bucket: s3://bucket[/prefix]")
    return protocol, path


def _base_name(path: object) -> str:
    """Last part of a listed path (fsspec lists folders with or without a trailing slash)."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

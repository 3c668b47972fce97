"""Object keys of the store, built only from validated parts.

Layout (design section 6), relative to the store root::

    {run_id}/iter_{k:06d}/{stage}/{name}.manifest.json         the commit point of one item
    {run_id}/iter_{k:06d}/{stage}/{name}-{sha16}.json           a committed JSON object
    {run_id}/iter_{k:06d}/{stage}/{name}-{i:05d}-{sha16}.parquet  a trajectory shard
    {run_id}/checkpoints/step_{k:06d}/...                       a checkpoint folder
    {run_id}/quarantine/iter_{k:06d}/{stage}/...                batches that failed validation
    {run_id}/iter_{v:06d}/rollouts/w-{worker}-{seq:06d}.manifest.json  an async worker's batch (policy v)

Every part is checked against a strict pattern BEFORE any I/O: no ``..``, no ``/``, no ``\\``,
no absolute paths, no empty parts, no control characters, no leading dot (hidden files) and nothing
longer than 128 characters. A bad part raises :class:`UnsafeKeyError` naming the part, the value and
the rule. Data file names are content-addressed (``sha16`` = the first 16 hex digits of the
sha256) so a retried or racing writer never overwrites bytes another manifest points to.
"""

from __future__ import annotations

import re
from typing import Final

STAGES: Final[tuple[str, ...]] = ("tasks", "rollouts", "batch", "update", "eval", "summary")
"""Stage folders inside one iteration. ``update`` and ``summary`` hold small JSON results."""

PART_PATTERN: Final[str] = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_PART_RE: Final = re.compile(PART_PATTERN)
MAX_INDEX: Final[int] = 999_999  # iteration / step numbers are written with 6 digits
DATA_SUFFIXES: Final[tuple[str, ...]] = (".parquet", ".json")
MANIFEST_SUFFIX: Final[str] = ".manifest.json"
_ITERATION_RE: Final = re.compile(r"iter_(\d{6})")
_WORKER_ITEM_RE: Final = re.compile(r"w-(?P<worker>[A-Za-z0-9._-]+)-(?P<seq>\d{6})")


class UnsafeKeyError(ValueError):
    """A key part is not allowed (raised before any I/O)."""


def check_part(value: object, what: str) -> str:
    """Return ``value`` if it is a safe single key part, else raise :class:`UnsafeKeyError`.

    Allowed: 1-128 characters from ``[A-Za-z0-9._-]``, starting with a letter or digit, and no
    ``..`` anywhere (so ``a..b`` is refused too, to keep the rule simple to audit).
    """
    if not isinstance(value, str):
        raise UnsafeKeyError(f"{what}={value!r} must be a string matching {PART_PATTERN} (got {type(value).__name__})")
    if not _PART_RE.fullmatch(value) or ".." in value:
        raise UnsafeKeyError(
            f"{what}={value!r} is not a safe key part: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..', '/', '\\' or spaces"
        )
    return value


def check_run_id(run_id: object) -> str:
    return check_part(run_id, "run_id")


def check_index(value: object, what: str) -> int:
    """An iteration or step number: an int in [0, 999999] (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INDEX:
        raise UnsafeKeyError(f"{what}={value!r} must be an int in [0, {MAX_INDEX}]")
    return value


def check_stage(stage: object) -> str:
    if stage not in STAGES:
        raise UnsafeKeyError(f"stage={stage!r} must be one of {list(STAGES)}")
    return str(stage)


def check_relative_key(key: object, what: str = "key") -> str:
    """A relative key of one or more safe parts joined by ``/`` (e.g. ``run/checkpoints/step_000003``)."""
    if not isinstance(key, str) or not key:
        raise UnsafeKeyError(f"{what}={key!r} must be a non-empty relative key like 'run/checkpoints/step_000001'")
    for part in key.split("/"):
        check_part(part, f"{what} part")
    return key


def check_data_file_name(name: object) -> str:
    """A data object named in a manifest: a safe part ending in .parquet or .json (never a pickle)."""
    check_part(name, "manifest object name")
    assert isinstance(name, str)
    if not name.endswith(DATA_SUFFIXES):
        raise UnsafeKeyError(f"manifest object name={name!r} must end with one of {list(DATA_SUFFIXES)}")
    return name


def iteration_folder(iteration: int) -> str:
    """``iter_{k:06d}``: the folder of one iteration inside its run."""
    return f"iter_{check_index(iteration, 'iteration'):06d}"


def parse_iteration_folder(name: str) -> int | None:
    """The iteration of a folder named ``iter_{k:06d}``, else None."""
    match = _ITERATION_RE.fullmatch(name)
    return None if match is None else int(match.group(1))


def iteration_prefix(run_id: str, iteration: int) -> str:
    return f"{check_run_id(run_id)}/{iteration_folder(iteration)}"


def stage_prefix(run_id: str, iteration: int, stage: str) -> str:
    return f"{iteration_prefix(run_id, iteration)}/{check_stage(stage)}"


def manifest_key(run_id: str, iteration: int, stage: str, name: str) -> str:
    return f"{stage_prefix(run_id, iteration, stage)}/{check_part(name, 'name')}{MANIFEST_SUFFIX}"


def worker_item(worker: str, seq: int) -> str:
    """Item name of batch ``seq`` of async rollout worker ``worker``: ``w-{worker}-{seq:06d}``."""
    check_part(worker, "worker")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_INDEX:
        raise ValueError(f"seq={seq!r} must be an int in [0, {MAX_INDEX}]")
    return check_part(f"w-{worker}-{seq:06d}", "worker item")


def parse_worker_item(name: str) -> tuple[str, int] | None:
    """``(worker, seq)`` of an item named by :func:`worker_item`, else None."""
    match = _WORKER_ITEM_RE.fullmatch(name)
    return None if match is None else (match.group("worker"), int(match.group("seq")))


def quarantine_prefix(run_id: str, iteration: int, stage: str) -> str:
    return f"{check_run_id(run_id)}/quarantine/iter_{check_index(iteration, 'iteration'):06d}/{check_stage(stage)}"


def checkpoint_key(run_id: str, step: int) -> str:
    return f"{check_run_id(run_id)}/checkpoints/step_{check_index(step, 'step'):06d}"

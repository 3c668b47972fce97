"""Exact, crash-safe checkpoints of the update stage.

A checkpoint is one folder ``{root}/step_{k:06d}/``::

    model.safetensors        actor weights (save_pretrained: loadable by transformers / vLLM)
    config.json, generation_config.json, tokenizer files (when a tokenizer is given)
    {name}.safetensors       extra models, e.g. critic.safetensors
    optim_{name}.pt          optimizer / scheduler state dicts (torch.save; loaded weights_only=True)
    optim_{name}.rank{r:03d}-of-{N:03d}.pt   instead, one part per rank where the state is sharded (ZeRO, N ranks)
    rng.pt                   torch CPU (+ CUDA) RNG, python ``random`` and numpy RNG states
    extra_state.pt           caller's state (shuffle generator, counters ...; weights_only types only)
    metadata.json            caller's JSON record committed with the weights (the update's metrics)
    COMMITTED.json           the marker, written LAST: step, policy version, fingerprint, sha256 of every
                             file, the world size and each optimizer's number of parts

Protocol: every file is written into a fresh hidden temp folder, which is renamed into place; the
marker is then written atomically (temp file + ``os.replace``). A folder without the marker, or whose
files do not match the hashes in the marker, is refused by :func:`load_checkpoint`. ``keep_last``
prunes old checkpoints only after the new one has committed, so a crash at any point leaves the
previous committed checkpoint loadable.

The fingerprint is the sha256 of ``model.safetensors``: rollouts carry it as ``weights_fingerprint``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_file

from ragen_tasks.training.distributed import SINGLE, Ranks, all_gather, broadcast

log = logging.getLogger(__name__)

MARKER = "COMMITTED.json"
WEIGHTS = "model.safetensors"
METADATA = "metadata.json"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint."""

    path: Path
    step: int
    policy_version: int
    fingerprint: str  # sha256 of model.safetensors
    extra_state: dict[str, Any] = field(default_factory=dict)  # filled by load_checkpoint only


class CheckpointError(RuntimeError):
    """The folder is not a complete, untampered checkpoint."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Global RNG states as weights_only-loadable objects (tensors, ints, floats, tuples)."""
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_global_rngs(seed: int, step: int) -> None:
    """Seed python's, numpy's and torch's global RNGs from (run seed, step). Nothing in the update
    draws from them (shuffling has its own generator), but ``rng.pt`` records them: seeded, identical
    runs write identical checkpoints, straight or resumed."""
    material = np.random.SeedSequence([abs(int(seed)), int(step)]).generate_state(2, dtype=np.uint32)
    value = int(material[0]) << 32 | int(material[1])
    random.seed(value)
    np.random.seed(int(material[0]))
    torch.manual_seed(value)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    step: int,
    *,
    actor: torch.nn.Module,
    optimizers: dict[str, Any],
    tokenizer: Any = None,
    models: dict[str, torch.nn.Module] | None = None,
    extra_state: dict[str, Any] | None = None,
    policy_version: int | None = None,
    keep_last: int | None = None,
    metadata: dict[str, Any] | None = None,
    ranks: Ranks = SINGLE,
) -> CheckpointInfo:
    """Write and commit ``{root}/step_{step:06d}``; return its info.

    ``actor`` is a transformers ``PreTrainedModel`` (saved with ``save_pretrained``). ``optimizers``
    maps a name to anything with ``state_dict()`` (optimizers, LR schedulers, backend TrainModels).
    ``models`` are extra modules (e.g. ``{"critic": critic}``) saved as ``{name}.safetensors``.
    ``extra_state`` must hold only types ``torch.load(weights_only=True)`` accepts.
    ``policy_version`` defaults to ``step``. ``keep_last``: after this one commits, delete older
    committed checkpoints beyond the newest N. ``metadata``: a JSON-able record saved as
    ``metadata.json``, covered by the marker like the weights, so whatever the caller derives from
    this step (its metrics) commits with it.

    Several data-parallel ranks (``ranks.world_size`` > 1): every rank calls this with its own
    objects. Rank 0 writes everything except sharded optimizer state; every rank writes its part of
    each optimizer whose ``sharded_state`` is True, as ``optim_{name}.rank{r:03d}-of-{N:03d}.pt``;
    after all ranks finished (a barrier), rank 0 renames the folder and writes the marker, which
    lists every part. So a checkpoint is committed whole or not at all. The ranks must share
    ``root`` (one node, or a shared volume): a rank that cannot see rank 0's folder fails all ranks.
    """
    if step < 0:
        raise ValueError(f"save_checkpoint: step={step} must be >= 0")
    root = Path(root)
    final = step_dir(root, step)
    tmp: Path | None = None
    problem = None
    if ranks.is_main:
        try:
            tmp = _fresh_folder(root, final)
        except CheckpointError as exc:
            problem = str(exc)
    _agree(problem)
    tmp = Path(broadcast(str(tmp)))
    _agree(
        None
        if tmp.is_dir()
        else f"rank {ranks.rank} cannot see rank 0's checkpoint folder {tmp}: the ranks must share the checkpoint "
        "root (one node, or RAGEN_SCRATCH on a shared volume)"
    )
    parts = {name: ranks.world_size if getattr(obj, "sharded_state", False) else 1 for name, obj in optimizers.items()}
    written: list[Path] = []
    try:
        for name, obj in optimizers.items():
            if parts[name] > 1:
                written.append(tmp / _part_name(name, ranks.rank, parts[name]))
                torch.save(obj.state_dict(), written[-1])
            elif ranks.is_main:
                written.append(tmp / f"optim_{name}.pt")
                torch.save(obj.state_dict(), written[-1])
        if ranks.is_main:
            written += _write_main_files(tmp, actor, tokenizer, models, extra_state, metadata)
        for p in written:
            # One mode for every file: safetensors writes through a temp file created 0600.
            os.chmod(p, 0o644)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    except OSError as exc:
        problem = f"rank {ranks.rank} could not write checkpoint {final}: {exc}"
    _agree(problem)  # every rank's part is on disk
    info = None
    if ranks.is_main:
        info = _commit(
            root, final, tmp, step, policy_version, list(optimizers), list(models or {}), parts, ranks.world_size
        )
        if keep_last is not None:
            prune(root, keep_last=keep_last)
    info = broadcast(info)
    assert info is not None
    return CheckpointInfo(
        path=info.path, step=info.step, policy_version=info.policy_version, fingerprint=info.fingerprint
    )


def copy_checkpoint(root: Path, source: Path, step: int) -> CheckpointInfo:
    """Commit ``{root}/step_{step:06d}`` as an exact copy of committed checkpoint ``source``'s files
    (weights, every optimizer part, RNG and shuffling state; not its ``metadata.json``, which
    describes the update that made ``source``). Works for a checkpoint of any number of ranks."""
    marker = verify_checkpoint(source)
    root = Path(root)
    final = step_dir(root, step)
    tmp = _fresh_folder(root, final)
    for name in marker["files"]:
        if name != METADATA:
            shutil.copy2(Path(source) / name, tmp / name)
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
    names, models = list(marker.get("optimizers", [])), list(marker.get("models", []))
    parts = {name: int(marker.get("optimizer_parts", {}).get(name, 1)) for name in names}
    return _commit(root, final, tmp, step, None, names, models, parts, int(marker.get("world_size", 1)))


def _part_name(name: str, rank: int, parts: int) -> str:
    """File of rank ``rank``'s part of optimizer ``name``, sharded over ``parts`` ranks."""
    return f"optim_{name}.rank{rank:03d}-of-{parts:03d}.pt"


def _agree(problem: str | None) -> None:
    """Raise CheckpointError on EVERY rank if any rank has a ``problem`` (a rank that raised alone
    would leave the others waiting in the next collective)."""
    problems = [p for p in all_gather(problem) if p]
    if problems:
        raise CheckpointError(problems[0])


def _fresh_folder(root: Path, final: Path) -> Path:
    """An empty hidden temp folder for ``final``'s files, after removing what an interrupted save of
    the same step left (only this step's: another step's temp folder may belong to a save in progress)."""
    root.mkdir(parents=True, exist_ok=True)
    if (final / MARKER).exists():
        raise CheckpointError(f"{final} is already committed; refusing to overwrite a committed checkpoint")
    for stale in root.glob(f"{_TMP_PREFIX}{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():  # renamed but never committed: a save killed before the marker
        log.warning("removing uncommitted checkpoint folder %s", final)
        shutil.rmtree(final)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _write_main_files(
    tmp: Path,
    actor: torch.nn.Module,
    tokenizer: Any,
    models: dict[str, torch.nn.Module] | None,
    extra_state: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
) -> list[Path]:
    """Rank 0's files: weights (HF format), tokenizer, extra models, RNG, extra state, metadata."""
    actor.save_pretrained(tmp, max_shard_size="1000GB")  # type: ignore[operator]
    if not (tmp / WEIGHTS).exists():
        raise CheckpointError(f"{type(actor).__name__}.save_pretrained did not write {WEIGHTS}")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for name, module in (models or {}).items():
        _save_module(module, tmp / f"{name}.safetensors")
    torch.save(rng_state(), tmp / "rng.pt")
    torch.save(dict(extra_state or {}), tmp / "extra_state.pt")
    if metadata is not None:
        (tmp / METADATA).write_text(json.dumps(metadata, sort_keys=True))
    return [p for p in tmp.iterdir() if p.is_file() and not p.name.startswith("optim_")]


def _save_module(module: torch.nn.Module, path: Path) -> None:
    """``module``'s weights as safetensors, loadable by ``safetensors.torch.load_model``. Each tensor
    is copied out: ZeRO-1/2 turn a module's parameters into views of one flat buffer, which
    ``save_model`` refuses as shared storage; tied parameters (one tensor, two names) keep one name."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    state = {}
    for key, tensor in module.state_dict().items():
        identity = (tensor.data_ptr(), tuple(tensor.shape))
        if identity in seen:
            continue
        seen.add(identity)
        state[key] = tensor.detach().to("cpu", copy=True).contiguous()
    save_file(state, str(path), metadata={"format": "pt"})


def _commit(
    root: Path,
    final: Path,
    tmp: Path,
    step: int,
    policy_version: int | None,
    optimizers: Collection[str],
    models: Collection[str],
    parts: dict[str, int],
    world_size: int,
) -> CheckpointInfo:
    """Rename ``tmp`` into place and write the marker (the commit), hashing every file."""
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    files = {p.name: sha256_file(p) for p in sorted(final.iterdir()) if p.is_file()}
    version = step if policy_version is None else policy_version
    marker = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "policy_version": version,
        "fingerprint": files[WEIGHTS],
        "files": files,
        "optimizers": sorted(optimizers),
        "optimizer_parts": parts,
        "world_size": world_size,
        "models": sorted(models),
    }
    tmp_marker = final / f"{_TMP_PREFIX}{MARKER}"
    tmp_marker.write_text(json.dumps(marker, indent=1, sort_keys=True))
    with open(tmp_marker, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_marker, final / MARKER)  # the commit
    _fsync_dir(final)
    return CheckpointInfo(path=final, step=step, policy_version=version, fingerprint=files[WEIGHTS])


def committed_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root``, oldest first (marker present; hashes not re-checked)."""
    out = []
    for d in sorted(Path(root).glob("step_*")):
        marker = d / MARKER
        if not marker.exists():
            continue
        try:
            m = json.loads(marker.read_text())
            out.append(
                CheckpointInfo(
                    path=d,
                    step=int(m["step"]),
                    policy_version=int(m["policy_version"]),
                    fingerprint=str(m["fingerprint"]),
                )
            )
        except (ValueError, KeyError) as e:
            log.warning("ignoring %s: unreadable marker (%s)", d, e)
    return sorted(out, key=lambda i: i.step)


def latest_checkpoint(root: Path) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``root``, or None."""
    found = committed_checkpoints(root)
    return found[-1] if found else None


def steps_to_prune(steps: Collection[int], *, keep_last: int, protect: Collection[int] = ()) -> list[int]:
    """Which of the committed ``steps`` to delete so that ``keep_last`` remain: the newest always, the
    ``protect``-ed ones (e.g. the Echo-Trap guard's rollback targets) next, then the newest others.
    More than ``keep_last`` remain only when the protected ones alone need more room."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    ordered = sorted(set(steps), reverse=True)
    keep = set(ordered[:1]) | (set(protect) & set(ordered))
    for step in ordered:
        if len(keep) >= keep_last:
            break
        keep.add(step)
    return sorted(set(ordered) - keep)


def prune(root: Path, *, keep_last: int, protect: Collection[int] = ()) -> None:
    """Delete committed checkpoints so that ``keep_last`` remain (see ``steps_to_prune``), and the
    uncommitted folders of older steps: what a prune or a save killed half-way left behind (steps only
    grow, so no save of an older step is in progress)."""
    found = {info.step: info for info in committed_checkpoints(root)}
    for step in steps_to_prune(found, keep_last=keep_last, protect=protect):
        info = found[step]
        (info.path / MARKER).unlink()  # uncommit first: a half-deleted folder is never "committed"
        shutil.rmtree(info.path)
    newest = max(found, default=-1)
    for folder in Path(root).glob("step_*"):
        number = folder.name.removeprefix("step_")
        if number.isdigit() and int(number) < newest and not (folder / MARKER).exists():
            log.warning("removing %s: an uncommitted folder left by an interrupted save or prune", folder)
            shutil.rmtree(folder)


def is_checkpoint_folder(path: Path) -> bool:
    """``path`` is (or was meant to be) a checkpoint written here: a commit marker, a ``step_*`` name,
    or training state beside the weights. Such a folder is only used once committed and verified."""
    path = Path(path)
    return (
        (path / MARKER).exists()
        or path.name.startswith(("step_", _TMP_PREFIX))
        or (path / "rng.pt").exists()
        or (path / "extra_state.pt").exists()
    )


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Return the marker of a committed checkpoint; raise CheckpointError if uncommitted or tampered."""
    path = Path(path)
    marker_path = path / MARKER
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not marker_path.exists():
        raise CheckpointError(
            f"checkpoint {path} is not committed (no {MARKER}): its save was interrupted; "
            "load latest_checkpoint(root) instead"
        )
    try:
        marker: dict[str, Any] = json.loads(marker_path.read_text())
        files = marker["files"]
        if not isinstance(files, dict) or WEIGHTS not in files or "fingerprint" not in marker:
            raise ValueError(f"it must hold 'fingerprint' and 'files' naming {WEIGHTS}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is not a valid commit marker ({e})") from e
    for name, digest in files.items():
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(digest, str):
            raise CheckpointError(f"checkpoint {path}: {MARKER} names an invalid file entry {name!r}")
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} listed in {MARKER} is missing")
        actual = sha256_file(p)
        if actual != digest:
            raise CheckpointError(
                f"checkpoint {path}: {name} has sha256 {actual[:12]}.. but {MARKER} "
                f"records {digest[:12]}..: the folder was modified after commit"
            )
    if marker["fingerprint"] != files[WEIGHTS]:
        raise CheckpointError(f"checkpoint {path}: fingerprint does not match the hash of {WEIGHTS}")
    return marker


def read_metadata(path: Path) -> dict[str, Any] | None:
    """The ``metadata.json`` record of a verified checkpoint folder, or None if it was saved without one."""
    f = Path(path) / METADATA
    return dict(json.loads(f.read_text())) if f.is_file() else None


def load_weights(actor: torch.nn.Module, path: Path) -> None:
    """Load ``model.safetensors`` from a checkpoint folder into ``actor`` (tied weights allowed)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / WEIGHTS))
    result = actor.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"{path}/{WEIGHTS}: keys not in the model: {result.unexpected_keys[:5]}")
    loaded = {p.data_ptr() for k, p in actor.state_dict().items() if k in state}
    missing = [k for k in result.missing_keys if actor.state_dict()[k].data_ptr() not in loaded]
    if missing:
        raise CheckpointError(f"{path}/{WEIGHTS}: model keys missing from the file: {missing[:5]}")


def load_optimizers(
    path: Path, optimizers: dict[str, Any], *, marker: dict[str, Any] | None = None, ranks: Ranks = SINGLE
) -> list[str]:
    """Load the optimizer state of committed checkpoint ``path`` into each object (anything with
    ``load_state_dict``: an optimizer, or a backend ``TrainModel``, whose state must be loaded after
    the backend wrapped the model). ``marker``: the already verified marker (else verified here).

    Whole state (``optim_{name}.pt``) loads anywhere it fits. Sharded state (one part per rank, ZeRO)
    loads only into the same number of ranks, each its own part: a partition's layout depends on the
    world size. Otherwise the policy is a **fresh optimizer state** (the weights are exact; AdamW's
    moments and step count restart), logged as a warning. Returns the names so reset."""
    path = Path(path)
    marker = verify_checkpoint(path) if marker is None else marker
    reset = []
    for name, obj in optimizers.items():
        if name not in marker.get("optimizers", []):
            raise CheckpointError(f"checkpoint {path} has no optimizer {name!r} (has {marker['optimizers']})")
        parts = int(marker.get("optimizer_parts", {}).get(name, 1))
        files = [f"optim_{name}.pt"] if parts == 1 else [_part_name(name, r, parts) for r in range(parts)]
        missing = [f for f in files if f not in marker["files"]]
        if missing:
            raise CheckpointError(
                f"checkpoint {path}: optimizer {name!r} is incomplete: its marker lacks {', '.join(missing)}"
            )
        sharded_here = bool(getattr(obj, "sharded_state", False))
        if parts == 1 and not sharded_here:
            obj.load_state_dict(torch.load(path / files[0], weights_only=True))
        elif parts > 1 and sharded_here and parts == ranks.world_size:
            obj.load_state_dict(torch.load(path / files[ranks.rank], weights_only=True))
        else:
            reset.append(name)
            log.warning(
                "checkpoint %s: optimizer %r was saved %s; this update runs %s: its state cannot be split "
                "that way, so the optimizer starts fresh (weights exact; moments and step count reset)",
                path,
                name,
                f"in {parts} parts" if parts > 1 else "whole",
                f"{ranks.world_size} ranks with sharded state" if sharded_here else "whole state",
            )
    return reset


def load_checkpoint(
    path: Path,
    *,
    actor: torch.nn.Module,
    optimizers: dict[str, Any] | None = None,
    models: dict[str, torch.nn.Module] | None = None,
    restore_rng: bool = True,
) -> CheckpointInfo:
    """Verify and load a committed checkpoint into existing objects (in place).

    Raises CheckpointError (naming the folder and the problem) if it is uncommitted, tampered, or
    lacks a requested optimizer / model. Returns the info with ``extra_state`` filled.
    """
    path = Path(path)
    marker = verify_checkpoint(path)
    load_weights(actor, path)
    for name, module in (models or {}).items():
        f = path / f"{name}.safetensors"
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} has no model {name!r} (has {marker['models']})")
        load_model(module, str(f))
    load_optimizers(path, optimizers or {}, marker=marker)
    if restore_rng:
        set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    extra = torch.load(path / "extra_state.pt", weights_only=True)
    return CheckpointInfo(
        path=path,
        step=int(marker["step"]),
        policy_version=int(marker["policy_version"]),
        fingerprint=str(marker["fingerprint"]),
        extra_state=extra,
    )

"""Evaluation records and the regression gate over local paths and ``s3://`` URIs.

A checkpoint is a local folder or an ``s3://`` URI: ``s3://bucket/prefix/<run>/checkpoints/step_k``
is fetched through its run (the run's config comes with it), any other ``s3://`` folder that the
store committed (``_STORE_MANIFEST.json``) is fetched as a plain model folder. A baseline is an
evaluation record (``ragen evaluate --json``, the evaluate flow's ``output``) in a local file or at
an ``s3://`` URI ending in ``.json``, or a checkpoint, evaluated on the same seeds as the candidate.
Every ``s3://`` read and write goes through the store's filesystem (endpoint and credentials from
the standard AWS environment variables).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_tasks.config import TrainConfig
from ragen_tasks.data.local_files import write_local_file
from ragen_tasks.data.store import Store
from ragen_tasks.evaluation import GateResult, check_record, eval_record, regression_gate
from ragen_tasks.pipeline.policy import evaluate_checkpoint
from ragen_tasks.pipeline.run import Run, open_existing_run, run_of_checkpoint
from ragen_tasks.presets import DEFAULT_PRESET, load_config


def _split(uri: str) -> tuple[Store, str]:
    """The store of the folder holding ``uri`` and the object's path in its filesystem."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/") or parent.endswith(":"):
        raise ValueError(f"{uri!r} must name an object inside a bucket: s3://bucket/[prefix/]name")
    store = Store(parent)
    return store, f"{store.root_uri.split('://', 1)[1]}/{name}"


def read_json(uri: str) -> Any:
    """A JSON document from a local path or an ``s3://`` URI (FileNotFoundError names it)."""
    if "://" not in uri or uri.startswith("file://"):
        path = Path(uri.removeprefix("file://"))
        if not path.is_file():
            raise FileNotFoundError(f"{uri!r} does not exist" if not path.exists() else f"{uri!r} is not a file")
        text = path.read_text()
    else:
        store, path_in_fs = _split(uri)
        if not store.fs.exists(path_in_fs):
            raise FileNotFoundError(f"{uri!r} does not exist")
        text = store.fs.cat_file(path_in_fs).decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{uri!r} is not JSON: {exc}") from None


def write_json(uri: str, data: Any) -> str:
    """Write ``data`` as JSON to a local path or an ``s3://`` URI; returns the URI."""
    body = json.dumps(data, indent=1, sort_keys=True)
    if "://" not in uri or uri.startswith("file://"):
        # whole or not at all, and no temporary file left by a killed writer
        write_local_file(uri.removeprefix("file://"), body.encode(), exclusive=False)
    else:
        store, path_in_fs = _split(uri)
        store.fs.pipe_file(path_in_fs, body.encode())
    return uri


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint made local: its folder, and the run it belongs to (None for a plain folder)."""

    path: Path
    run: Run | None


def fetch_checkpoint(uri: str) -> Checkpoint:
    """A local checkpoint folder for ``uri`` (a folder, or an ``s3://`` URI fetched to the scratch
    folder, ``$RAGEN_SCRATCH``). FileNotFoundError names what is missing."""
    if "://" not in uri or uri.startswith("file://"):
        path = Path(uri.removeprefix("file://"))
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {uri!r} is not a folder")
        return Checkpoint(path, run_of_checkpoint(path))
    parts = uri.rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == "checkpoints" and parts[-1].startswith("step_") and parts[-1][5:].isdigit():
        run = open_existing_run("/".join(parts[:-2]))
        step = int(parts[-1][5:])
        if step not in run.store.list_checkpoints(run.run_id):
            raise FileNotFoundError(f"checkpoint {uri!r} is not committed in run {run.uri}")
        return Checkpoint(run.checkpoint_path(step), run)
    store, _ = _split(uri)
    scratch = Path(os.environ.get("RAGEN_SCRATCH", Path(tempfile.gettempdir()) / "ragen"))
    local = scratch / "checkpoints" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    try:
        return Checkpoint(store.download_dir(uri.rstrip("/").rpartition("/")[2], local), None)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {uri!r}: no committed folder there (no store manifest)") from None


def config_for(checkpoint: Checkpoint, preset: str | None) -> TrainConfig:
    """The config a checkpoint was trained with (from its run), else the named preset."""
    if checkpoint.run is not None and preset is None:
        return checkpoint.run.config
    return load_config(preset or DEFAULT_PRESET)


def evaluate(
    uri: str,
    *,
    preset: str | None = None,
    envs: list[str] | None = None,
    seeds: int | None = None,
    seed_offset: int | None = None,
    temperature: float | None = None,
) -> dict[str, Any]:
    """The evaluation record of checkpoint ``uri`` (local or ``s3://``) on held-out seeds
    ``seed_offset .. seed_offset + seeds - 1`` per env, sampled at ``temperature`` (0 = greedy;
    defaults: the config's ``eval`` block). The record says the seeds and the temperature it played."""
    checkpoint = fetch_checkpoint(uri)
    config = config_for(checkpoint, preset)
    seeds = config.eval.seeds if seeds is None else seeds
    seed_offset = config.eval.seed_offset if seed_offset is None else seed_offset
    temperature = config.eval.temperature if temperature is None else temperature
    per_env, trajectories = evaluate_checkpoint(
        config, checkpoint.path, seeds=seeds, seed_offset=seed_offset, env_names=envs, temperature=temperature
    )
    return eval_record(
        per_env, trajectories, checkpoint=uri, seeds=seeds, seed_offset=seed_offset, temperature=temperature
    )


def is_record_uri(uri: str) -> bool:
    """A baseline given as a JSON record (a local file, or any path or ``s3://`` URI ending in .json),
    not a checkpoint folder."""
    if uri.endswith(".json"):
        return True
    return ("://" not in uri or uri.startswith("file://")) and Path(uri.removeprefix("file://")).is_file()


@dataclass(frozen=True)
class GateRun:
    result: GateResult
    candidate: dict[str, Any]  # the candidate's evaluation record
    baseline: dict[str, Any]  # the baseline's evaluation record

    def summary(self) -> str:
        """The verdict table and what both sides played (the same seeds and temperature)."""
        c = self.candidate
        played = f"  played: {c['seeds']} seeds per env from {c['seed_offset']}, temperature {c['temperature']:g}"
        return f"{self.result.summary()}\n{played}"


def gate(
    candidate: str,
    baseline: str,
    *,
    alpha: float = 0.01,
    min_drop: float = 0.05,
    seeds: int | None = None,
    seed_offset: int | None = None,
    temperature: float | None = None,
    preset: str | None = None,
) -> GateRun:
    """Gate checkpoint ``candidate`` against ``baseline`` (a record or a checkpoint, see the module
    docstring). With a record, the candidate plays the record's envs, seed block and sampling
    temperature (``seeds`` / ``seed_offset`` / ``temperature`` must then be unset); with a checkpoint,
    both play ``seeds`` from ``seed_offset`` at ``temperature`` (default: the candidate's config's), so
    two runs whose presets evaluate at different temperatures are still compared like for like.
    Raises ValueError / FileNotFoundError on bad input, which is never a verdict."""
    if is_record_uri(baseline):
        if seeds is not None or seed_offset is not None or temperature is not None:
            raise ValueError(
                "seeds / seed_offset / temperature: a baseline record fixes them (the candidate plays the same "
                "seeds at the same temperature); leave them unset, or pass a baseline checkpoint"
            )
        base = check_record(read_json(baseline), f"baseline {baseline!r}")
        missing = [key for key in ("seeds", "seed_offset", "temperature") if key not in base]
        if missing:
            raise ValueError(
                f"baseline {baseline!r} does not say {' / '.join(missing)}: write it anew with "
                "`ragen evaluate CHECKPOINT --json` (add `--temperature T` to choose the sampling)"
            )
        for key, kinds, least in (("seeds", int, 1), ("seed_offset", int, 0), ("temperature", (int, float), 0)):
            value = base[key]
            if isinstance(value, bool) or not isinstance(value, kinds) or value < least:
                raise ValueError(f"baseline {baseline!r}: {key}={value!r} is not a number >= {least}; write it anew")
        cand = evaluate(
            candidate,
            preset=preset,
            envs=sorted(base["per_seed"]),
            seeds=base["seeds"],
            seed_offset=base["seed_offset"],
            temperature=base["temperature"],
        )
    else:
        cand = evaluate(candidate, preset=preset, seeds=seeds, seed_offset=seed_offset, temperature=temperature)
        base = evaluate(
            baseline,
            preset=preset,
            envs=sorted(cand["per_seed"]),
            seeds=cand["seeds"],
            seed_offset=cand["seed_offset"],
            temperature=cand["temperature"],
        )
    result = regression_gate(cand["per_seed"], base["per_seed"], alpha=alpha, min_drop=min_drop)
    return GateRun(result, cand, base)

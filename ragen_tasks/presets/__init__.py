"""Named training presets (YAML files beside this module) and ``--set key=value`` overrides.

A preset is a partial ``TrainConfig`` in YAML. Two composition keys are read before validation:

* ``extends: NAME`` — start from another preset (deep-merged, this file wins);
* ``algo_preset: NAME`` — merge ``presets/algos/NAME.yaml`` (the paper's algorithm settings:
  ``starpo-ppo``, ``starpo-grpo``, ``starpo-s``) under this file's own values.

Every error names what to change: an unknown preset lists the known ones, a bad key lists the
valid keys at that level, a bad value names the dotted field and pydantic's reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ragen_tasks.config import TrainConfig

PRESET_DIR = Path(__file__).parent
ALGO_PRESET_DIR = PRESET_DIR / "algos"
DEFAULT_PRESET = "default"


class ConfigError(ValueError):
    """A preset, file or override that cannot become a valid TrainConfig. The message is one line."""


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    return data


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``top`` wins. Lists and scalars are replaced, not merged."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _resolve(name_or_file: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = Path(name_or_file)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ConfigError(f"preset file {name_or_file!r} does not exist")
    else:
        path = PRESET_DIR / f"{name_or_file}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"unknown preset {name_or_file!r}; known presets: {', '.join(available_presets())} (or give a .yaml file)"
            )
    if str(path) in seen:
        raise ConfigError(f"preset {name_or_file!r} extends itself: {' -> '.join((*seen, str(path)))}")
    data = _read_yaml(path)
    base: dict[str, Any] = {}
    if "extends" in data:
        base = _resolve(str(data.pop("extends")), (*seen, str(path)))
    if "algo_preset" in data:
        algo_name = str(data.pop("algo_preset"))
        algo_path = ALGO_PRESET_DIR / f"{algo_name}.yaml"
        if not algo_path.is_file():
            known = sorted(p.stem for p in ALGO_PRESET_DIR.glob("*.yaml"))
            raise ConfigError(f"{path.name}: unknown algo_preset {algo_name!r}; known: {', '.join(known)}")
        base = deep_merge(base, _read_yaml(algo_path))
    return deep_merge(base, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"algo.clip_high=0.28"`` -> (["algo", "clip_high"], 0.28). Values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set optim.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc})") from exc
    return key.strip().split("."), value


def _check_path(path: list[str], model: type[BaseModel], text: str) -> None:
    """Reject a dotted key that does not name a config field, listing the valid keys at that level."""
    current: type[BaseModel] | None = model
    for depth, part in enumerate(path):
        if current is None:
            return  # inside a free-form dict (e.g. env config): the consumer validates it
        fields = current.model_fields
        if part not in fields:
            where = ".".join(path[:depth]) or "top level"
            raise ConfigError(
                f"--set {text!r}: unknown key {part!r} at {where}; valid keys: {', '.join(sorted(fields))}"
            )
        annotation = fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


Overrides = Iterable[str] | Mapping[str, Any]


def apply_overrides(data: dict[str, Any], overrides: Overrides) -> dict[str, Any]:
    """Apply ``["a.b=1", ...]`` (CLI form) or ``{"a.b": 1, ...}`` (flow-parameter form)."""
    pairs: list[tuple[list[str], Any, str]] = []
    if isinstance(overrides, Mapping):
        pairs = [(str(key).split("."), value, f"{key}={value}") for key, value in overrides.items()]
    else:
        pairs = [(*parse_override(text), text) for text in overrides]
    result = dict(data)
    for path, value, text in pairs:
        _check_path(path, TrainConfig, text)
        patch: Any = value
        for part in reversed(path):
            patch = {part: patch}
        result = deep_merge(result, patch)
    return result


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        parts.append(f"{loc}{shown}: {err['msg']}" if loc else str(err["msg"]).removeprefix("Value error, "))
    return f"{source}: " + "; ".join(parts)


def load_config(name_or_file: str = DEFAULT_PRESET, overrides: Overrides = ()) -> TrainConfig:
    """Resolve a preset name or YAML file, apply ``--set`` overrides, validate."""
    data = apply_overrides(_resolve(name_or_file), overrides)
    data.setdefault("preset", name_or_file)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, f"preset {name_or_file!r}")) from exc

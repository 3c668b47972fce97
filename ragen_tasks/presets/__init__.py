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
from pydantic import ValidationError

from ragen_tasks.config import ConfigError, TrainConfig, deep_merge, set_dotted
from ragen_tasks.presets.algos import load_algo_preset

PRESET_DIR = Path(__file__).parent
DEFAULT_PRESET = "default"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_summary(name: str) -> str:
    """The first sentence of the preset file's leading comment (what ``ragen train --list`` shows
    beside its name): every preset opens with a comment saying what it is for."""
    lines = []
    for line in (PRESET_DIR / f"{name}.yaml").read_text().splitlines():
        text = line.strip()
        if not text.startswith("#") or text == "#":  # the leading comment ends at code or an empty "#"
            break
        lines.append(text.lstrip("#").strip())
    block = " ".join(lines)
    end = block.find(". ")
    return block if end < 0 else block[: end + 1]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    return data


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
        try:
            algo = load_algo_preset(str(data.pop("algo_preset")))
        except ConfigError as exc:
            raise ConfigError(f"{path.name}: {exc}") from None
        base = deep_merge(base, algo)
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


Overrides = Iterable[str] | Mapping[str, Any]


def apply_overrides(data: dict[str, Any], overrides: Overrides) -> dict[str, Any]:
    """Apply ``["a.b=1", ...]`` (CLI form) or ``{"a.b": 1, ...}`` (flow-parameter form)."""
    pairs: list[tuple[str, Any, str]] = []  # (dotted key, value, how the user wrote the override)
    if isinstance(overrides, Mapping):  # the flow's parameter: errors name it as the run form shows it
        pairs = [(str(key), value, f"overrides[{str(key)!r}]") for key, value in overrides.items()]
    else:
        for text in overrides:
            path, value = parse_override(text)
            pairs.append((".".join(path), value, f"--set {text!r}"))
    result = dict(data)
    for key, value, text in pairs:
        try:
            result = set_dotted(result, key, value)
        except ConfigError as exc:
            raise ConfigError(f"{text}: {exc}") from None
    return result


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        message = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}{shown}: {message}" if loc else message)
    return f"{source}: " + "; ".join(parts)


def load_config(name_or_file: str = DEFAULT_PRESET, overrides: Overrides = ()) -> TrainConfig:
    """Resolve a preset name or YAML file, apply ``--set`` overrides, validate."""
    data = apply_overrides(_resolve(name_or_file), overrides)
    data.setdefault("preset", name_or_file)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, f"preset {name_or_file!r}")) from exc

"""The paper's algorithm settings as YAML fragments (``algo:`` / ``optim:`` sections of TrainConfig).

``starpo-ppo`` (GAE + critic, KL 0.001 k1 in the reward, clip 0.2/0.2, no filter), ``starpo-grpo``
(group advantages, KL 0.001 k3 in the loss, clip 0.2/0.2, no filter) and ``starpo-s`` (GAE + critic,
no KL, clip 0.2/0.28, uncertainty filter 0.25). A training preset selects one with
``algo_preset: NAME``; every value stays overridable (``--set algo.clip_high=0.3``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ragen_tasks.config import AlgoConfig, ConfigError, OptimConfig

ALGO_PRESET_DIR = Path(__file__).parent
_SECTIONS: dict[str, type[BaseModel]] = {"algo": AlgoConfig, "optim": OptimConfig}


def available_algo_presets() -> list[str]:
    return sorted(p.stem for p in ALGO_PRESET_DIR.glob("*.yaml"))


def load_algo_preset(name: str) -> dict[str, Any]:
    """``name`` -> ``{"algo": {...}, "optim": {...}}`` overrides, validated against AlgoConfig / OptimConfig.

    The one reader of these files: training presets (``algo_preset: NAME``) and the guard's
    ``starpo_s`` mitigation take their settings from here. Raises ConfigError listing the known
    presets for an unknown name, and naming the section for a bad key or value.
    """
    path = ALGO_PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown algo preset {name!r}; known: {', '.join(available_algo_presets())}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict) or set(data) - set(_SECTIONS):
        raise ConfigError(f"{path}: top-level keys must be among {sorted(_SECTIONS)}, got {sorted(data)}")
    for section, model in _SECTIONS.items():
        try:
            model.model_validate(data.get(section, {}))
        except ValidationError as exc:
            raise ConfigError(f"{path}: section {section!r} is invalid: {exc}") from exc
    return {section: dict(data.get(section, {})) for section in _SECTIONS}

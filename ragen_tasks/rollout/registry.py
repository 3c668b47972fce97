"""Engine names -> dotted paths, resolved (``pkgutil.resolve_name``) only when chosen.

Heavy engines (vLLM) are imported only by the run that asks for them, so CPU CI never imports
vllm. Any ``"package.module:Class"`` works too, for engines outside this package.
"""

from __future__ import annotations

import pkgutil
from typing import Any

ENGINES: dict[str, str] = {
    "hf": "ragen_tasks.rollout.hf_engine:HFEngine",
    "vllm": "ragen_tasks.rollout.vllm_engine:VLLMEngine",
    "openai": "ragen_tasks.rollout.openai_engine:OpenAIEngine",
    "scripted": "ragen_tasks.rollout.scripted:ScriptedEngine",
}


def resolve_engine(name: str) -> type[Any]:
    """The engine class for a registered name (``hf``, ``vllm``, ``openai``, ``scripted``) or ``"module:Class"``."""
    if name in ENGINES:
        path = ENGINES[name]
    elif ":" in name:
        path = name
    else:
        raise ValueError(
            f"rollout.engine={name!r} is not a known engine; use one of {sorted(ENGINES)} or a dotted path 'module:Class'"
        )
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rollout.engine={name!r}: a dotted path must look like 'package.module:Class'")
    try:
        cls = pkgutil.resolve_name(path)
    except AttributeError as err:
        raise ImportError(f"rollout.engine={name!r}: module {module_name!r} has no attribute {attr!r}") from err
    except ImportError as err:
        raise ImportError(
            f"rollout.engine={name!r}: cannot import module {module_name!r} ({err}); is its package installed "
            "in this image (vllm lives in docker/Dockerfile.vllm)?"
        ) from err
    if not isinstance(cls, type):
        raise TypeError(f"rollout.engine={name!r}: {path} is a {type(cls).__name__}, not a class")
    return cls


def make_engine(name: str, /, **kwargs: Any) -> Any:
    """Resolve ``name`` and construct the engine with ``kwargs`` (each engine documents its own)."""
    return resolve_engine(name)(**kwargs)

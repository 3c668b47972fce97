"""Load a policy (model + tokenizer) by preset name, local folder or HF hub id.

Every path ends in ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
on a folder or hub id, so a preset and a real Qwen2.5 checkpoint load the same way. With
``HF_HUB_OFFLINE=1`` only the local hub cache is consulted.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from ragen_tasks.models.presets import PRESETS, ensure_preset

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``name``: no leading ``/ . ~``, at most one ``/``, no backslash."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1 and "\\" not in name


def _resolve(name_or_path: str, cache_dir: str | os.PathLike[str] | None) -> str:
    """Preset name -> its cache folder; existing folder -> itself; else a hub id (checked here)."""
    if name_or_path in PRESETS:
        return str(ensure_preset(name_or_path, cache_dir))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise NotADirectoryError(f"model path {str(path.resolve())!r} is a file; give the folder holding config.json")
    if not _looks_like_hub_id(name_or_path):
        raise FileNotFoundError(
            f"model path {str(path.resolve())!r} does not exist; give an existing folder, a preset "
            f"name ({', '.join(sorted(PRESETS))}) or a HF hub id like 'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    return name_or_path


def _keep_saved_pre_tokenizer(tokenizer: Any, source: str) -> Any:
    """Reload ``tokenizer.json`` verbatim if ``AutoTokenizer`` swapped in a different pre-tokenizer.

    ``AutoTokenizer`` maps a ``qwen2`` config to ``Qwen2Tokenizer``, which rebuilds its own
    pre-tokenizer: a custom tokenizer would then encode differently than it was trained.
    """
    saved = Path(source) / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not saved.is_file() or backend is None:
        return tokenizer
    wanted = json.loads(saved.read_text(encoding="utf-8")).get("pre_tokenizer")
    if json.loads(backend.to_str()).get("pre_tokenizer") == wanted:
        return tokenizer
    # Expected for every load of a tokenizer with its own split (``tiny-cells``, ``tiny-rows-words``): a run
    # loads each checkpoint, so at INFO this line would repeat every iteration.
    logger.debug(
        "%s swapped the saved pre-tokenizer of %s; reloading tokenizer.json as is", type(tokenizer).__name__, source
    )
    return PreTrainedTokenizerFast.from_pretrained(source)


def load_policy(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: model in eval mode on ``device`` in ``dtype``; tokenizer left-padded.

    ``name_or_path``: a preset (``tiny``, ``small``), a local folder, or a hub id.
    ``cache_dir``: where presets are built (default ``~/.cache/ragen/presets``).
    Raises ``FileNotFoundError`` for a missing path / unreachable hub id and ``ValueError`` for a
    tokenizer without chat template or an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    source = _resolve(name_or_path, cache_dir)
    tokenizer = _tokenizer(source, name_or_path)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], attn_implementation="sdpa")
    except OSError as err:
        raise _not_found(name_or_path, err) from err
    model.to(device)
    model.eval()
    return model, tokenizer


def load_tokenizer(name_or_path: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """The policy's tokenizer alone (left-padded, with a chat template), for engines that do not hold
    the weights in this process (an OpenAI-compatible server, vLLM). Errors as ``load_policy``."""
    return _tokenizer(_resolve(name_or_path, cache_dir), name_or_path)


def _tokenizer(source: str, name_or_path: str) -> Any:
    """The tokenizer in ``source`` (a folder or hub id that ``name_or_path`` resolved to)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise _not_found(name_or_path, err) from err
    tokenizer = _keep_saved_pre_tokenizer(tokenizer, source)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer of {name_or_path!r} has no chat template; set tokenizer.chat_template (a Jinja string, "
            "e.g. ragen_tasks.models.tokenizer.CHAT_TEMPLATE) and save it, or use an instruct model"
        )
    if tokenizer.pad_token_id is None:
        logger.info("tokenizer of %r has no pad token; using eos %r", name_or_path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _not_found(name_or_path: str, err: OSError) -> FileNotFoundError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    hint = (
        "HF_HUB_OFFLINE is set, so the model hub is not reachable: download the model elsewhere and give "
        "its local folder"
        if offline
        else "check the hub id, your network, or give a local folder"
    )
    return FileNotFoundError(
        f"model {name_or_path!r} is neither a local folder nor a loadable hub id ({hint}); "
        f"presets: {', '.join(sorted(PRESETS))}. Cause: {err}"
    )

"""Named model presets: Qwen2-architecture models built from a config with a seeded random init.

``tiny`` (~130k parameters) trains on CPU in minutes; ``base`` (~0.9M) costs ~4x as much per
step; ``small`` (~3M) is the benchmark's larger point. All use a tokenizer trained locally on
the same corpus (``tokenizer.py``). Variants of ``tiny`` for asking what limits it: ``tiny-cells``
has a tokenizer that splits boards into one token per cell (its own vocabulary); ``tiny-wide``
doubles the width (hidden 128), ``tiny-deep`` the layers (4), each ~2x the cost per step
(bench/RESULTS.md, "One token per board cell" and "Width or depth"); ``tiny-rows`` (and
``tiny-deep-rows``) make each row of the 4-wide lake one added token, which is what lets the tiny
model read the lake (bench/RESULTS.md, "One token per lake row"); ``tiny-rows-composed`` starts each
row token's embedding as the sum of one vector per (column, symbol), so that what a row holds at a
given column is one direction of its embedding from the first step (bench/RESULTS.md, "Row tokens
built from their cells"); ``tiny-rows-words`` is ``tiny-rows-composed`` with a tokenizer of whole words
trained also on the games' own text, the same model on about 1.6 times fewer tokens a lake episode
(bench/RESULTS.md, "Whole-word tokens"). A preset is built once into a cache folder
``<cache_dir>/<name>-<PRESET_VERSION>-<corpus sha>`` and loaded from there with ``from_pretrained``
like any other model, so the preset path and the hub path are the same code.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ragen_tasks.models.tokenizer import build_tokenizer, corpus_fingerprint, lake_row_tokens, training_corpus

logger = logging.getLogger(__name__)

#: Bump when a preset's architecture, init or tokenizer recipe changes (a new cache folder follows).
PRESET_VERSION = "v1"


@dataclass(frozen=True)
class PresetSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 1024  # tokenizer training target; the model's vocab is the tokenizer's length
    max_position_embeddings: int = 4096
    seed: int = 0  # random init seed
    board_cells: bool = False  # tokenizer: one token per board cell (tokenizer.build_tokenizer)
    lake_rows: bool = False  # tokenizer: one token per row of the 4-wide lake (tokenizer.build_tokenizer)
    composed_lake_rows: bool = False  # init: a row token's embedding is its cells' sum (compose_lake_row_embeddings)
    whole_words: bool = False  # tokenizer: whole words, trained also on the games' text (tokenizer.build_tokenizer)

    def __post_init__(self) -> None:
        if self.composed_lake_rows and not self.lake_rows:
            raise ValueError("composed_lake_rows=True needs lake_rows=True: there are no row tokens to compose")


_TINY = PresetSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)

PRESETS: dict[str, PresetSpec] = {
    "tiny": _TINY,
    "base": PresetSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "tiny-cells": replace(_TINY, board_cells=True),
    "tiny-wide": replace(_TINY, hidden_size=128, intermediate_size=256),
    "tiny-deep": replace(_TINY, num_layers=4),
    "tiny-rows": replace(_TINY, lake_rows=True),
    "tiny-deep-rows": replace(_TINY, num_layers=4, lake_rows=True),
    "tiny-rows-composed": replace(_TINY, lake_rows=True, composed_lake_rows=True),
    "tiny-rows-words": replace(_TINY, lake_rows=True, composed_lake_rows=True, whole_words=True),
    "small": PresetSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704),
}


def default_cache_dir() -> Path:
    """``$RAGEN_CACHE/presets`` if set, else ``~/.cache/ragen/presets``."""
    root = os.environ.get("RAGEN_CACHE")
    return Path(root) / "presets" if root else Path.home() / ".cache" / "ragen" / "presets"


def build_preset(name: str) -> tuple[Qwen2ForCausalLM, object]:
    """Build preset ``name`` in memory: (model in float32, tokenizer). Deterministic per preset seed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    spec = PRESETS[name]
    tokenizer = build_tokenizer(  # its corpus is ``training_corpus(game_text=whole_words)``, as ensure_preset's key
        vocab_size=spec.vocab_size,
        board_cells=spec.board_cells,
        lake_rows=spec.lake_rows,
        whole_words=spec.whole_words,
    )
    model = qwen2_model(
        spec, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if spec.composed_lake_rows:
        compose_lake_row_embeddings(model, tokenizer, seed=spec.seed)
    return model, tokenizer


def compose_lake_row_embeddings(model: Qwen2ForCausalLM, tokenizer: Any, *, seed: int) -> None:
    """Overwrite the embedding of every lake row token (``lake_row_tokens``) with the sum of one
    random vector per (column, symbol) of the row, in place.

    A randomly initialised row token is an arbitrary vector: whether the row holds a hole at column 2
    is no direction of it, so reading the cell above the player (the player's column, taken from
    another token) must first be learnt row token by row token. Composed, ``hole at column c`` is
    the direction ``cell[c, "O"]`` in every row's embedding, which one attention read and one
    ReLU gated by the player's column can use. Each vector has std ``initializer_range / sqrt(width)``,
    so a row's embedding has the scale of every other token's. Deterministic per ``seed``; the
    embeddings are tied, so the output side of the row tokens changes with them.
    """
    rows = lake_row_tokens()
    ids = tokenizer.convert_tokens_to_ids(rows)
    width = len(rows[0])
    symbols = sorted({symbol for row in rows for symbol in row})
    embedding: torch.nn.Embedding = model.get_input_embeddings()  # type: ignore[assignment]
    weight = embedding.weight  # (vocab, hidden)
    generator = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range / width**0.5
    # cells: (column, symbol, hidden), one random vector per symbol a column can hold
    cells = torch.randn(width, len(symbols), embedding.embedding_dim, generator=generator) * std
    index = torch.tensor([[symbols.index(symbol) for symbol in row] for row in rows])  # (rows, column)
    composed = cells[torch.arange(width), index].sum(dim=1)  # (rows, hidden)
    with torch.no_grad():
        weight[torch.tensor(ids)] = composed.to(weight.dtype)


def qwen2_model(
    spec: PresetSpec, *, vocab_size: int, eos_token_id: int | None = None, pad_token_id: int | None = None
) -> Qwen2ForCausalLM:
    """A Qwen2 model shaped by ``spec`` (tied embeddings, float32), randomly initialised with
    ``spec.seed``: the one place our models are built from a ``Qwen2Config`` (presets, tests, benchmarks)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init that leaves the caller's global RNG alone
        torch.manual_seed(spec.seed)
        return Qwen2ForCausalLM(config)


def ensure_preset(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder holding preset ``name``, building it there first if missing.

    The folder is written to a temporary sibling and renamed into place, so a reader never sees a
    half-written preset and two processes building at once both end with the same complete folder.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = training_corpus(game_text=PRESETS[name].whole_words)
    folder = root / f"{name}-{PRESET_VERSION}-{corpus_fingerprint(corpus)}"
    if (folder / "config.json").exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building preset %r into %s", name, folder)
    model, tokenizer = build_preset(name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        save_policy(model, tokenizer, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process won the race: its folder is complete
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def save_policy(model: torch.nn.Module, tokenizer: object, folder: str | os.PathLike[str]) -> Path:
    """Save model (safetensors) and tokenizer (with its chat template) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)  # type: ignore[operator]
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder

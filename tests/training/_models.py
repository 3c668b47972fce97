"""A tiny Qwen2 actor for update / checkpoint tests: nothing downloaded, seeded init, float32."""

from __future__ import annotations

from transformers import Qwen2ForCausalLM

from ragen_tasks.models.presets import PresetSpec, qwen2_model

VOCAB = 64


def tiny_actor(seed: int = 0, *, hidden: int = 64, layers: int = 2, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    """Shaped like the ``tiny`` preset, with a small vocabulary (ids 0 = pad, 1 = eos)."""
    spec = PresetSpec(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        seed=seed,
    )
    return qwen2_model(spec, vocab_size=vocab, eos_token_id=1, pad_token_id=0)

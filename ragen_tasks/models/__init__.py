"""Models: the tiny/small presets, the locally trained tokenizer, and loading any HF causal LM."""

from ragen_tasks.models.loading import load_policy, load_tokenizer
from ragen_tasks.models.presets import PRESETS, build_preset, ensure_preset, save_policy
from ragen_tasks.models.tokenizer import CHAT_TEMPLATE, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "build_preset",
    "build_tokenizer",
    "ensure_preset",
    "load_policy",
    "load_tokenizer",
    "save_policy",
]

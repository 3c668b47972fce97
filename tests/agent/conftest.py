"""A small ChatML tokenizer (byte-level BPE trained in-process, well under a second) for agent tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "<think>I should move Left then Up</think><answer>Left || Up || Right || Down</answer>",
    "Board:\n#####\n#_P_#\n#_X_#\n#_O_#\n##### Reward: 0. Actions left: 3. Symbols: P = player",
]


def build_chatml_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


@pytest.fixture(scope="session")
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return build_chatml_tokenizer()

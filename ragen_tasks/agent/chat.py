"""Chat-template rendering, token-in/token-out: prompt ids and the ids of each fed observation.

The training sequence of an episode is ``prompt ids + sampled ids + observation ids + ...``.
Sampled ids come from the engine and are never re-tokenised. Observation ids are computed by
templating ONLY the new message: we render a fixed probe conversation that ends with an assistant
message holding a sentinel, once without and once with the new user message (plus the generation
prompt), and tokenise the template text that follows the sentinel. That text is the glue that
closes the assistant turn (ChatML: ``<|im_end|>\\n``), the new user turn and the opening of the
next assistant turn. If the response already ended with the first token(s) of that closing glue
(the policy sampled ``<|im_end|>`` itself), those ids are not fed twice.

Differences from templating the whole conversation (checked in tests/agent/test_chat.py):

* For ChatML-style templates (Qwen2/2.5 and the tiny preset) the ids are identical whenever the
  response text re-tokenises to the sampled ids; when it does not (BPE drift), ours are the ids
  that were actually sampled, which is the point.
* Templates that rewrite history (e.g. Qwen3 drops earlier ``<think>`` blocks) would give a
  different whole-conversation text; we keep what the policy actually saw and sampled.
* Special tokens in the glue are split out by the tokenizer before BPE, so tokenising the glue
  alone gives the same ids as inside the full text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ragen_tasks.agent.prompts import Message

_SENTINEL = "\u2063RAGEN-SENTINEL\u2063"  # never produced by a game or a prompt
_PROBE: list[Message] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text, in one batched tokenizer call (a fast tokenizer encodes the batch in Rust,
    so one call beats one per text). The template text already holds BOS/special tokens where
    the model wants them, so none are added."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


class ChatRenderer:
    """Renders messages with ``tokenizer.apply_chat_template`` and returns token ids."""

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "chat_template", None) in (None, ""):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template: use an instruct/chat model, "
                "the 'tiny' preset, or set tokenizer.chat_template before rolling out"
            )
        self.tokenizer = tokenizer
        probe = [*_PROBE, {"role": "assistant", "content": _SENTINEL}]
        closed = self._template(probe, generation_prompt=False)
        if closed.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render assistant message content verbatim")
        # Ids that close an assistant turn (ChatML: "<|im_end|>", "\n").
        self.close_ids = _encode(tokenizer, [closed.split(_SENTINEL, 1)[1]])[0]

    def _template(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) gave {type(text).__name__}, expected str")
        return text

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Ids of the first prompt: the messages plus the generation prompt (assistant turn opened)."""
        return self.prompt_ids_batch([messages])[0]

    def prompt_ids_batch(self, conversations: Sequence[Sequence[Message]]) -> list[list[int]]:
        """``prompt_ids`` of each conversation, tokenised in one call."""
        return _encode(self.tokenizer, [self._template(m, generation_prompt=True) for m in conversations])

    def glue_text(self, message: Message) -> str:
        """Template text after an assistant response: close it, add ``message``, open the next turn."""
        probe = [*_PROBE, {"role": "assistant", "content": _SENTINEL}]
        text = self._template([*probe, message], generation_prompt=True)
        if text.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render assistant message content verbatim")
        return text.split(_SENTINEL, 1)[1]

    def observation_ids(self, message: Message, sampled_ids: Sequence[int]) -> list[int]:
        """Ids to feed after ``sampled_ids``: the glue, minus closing ids the policy already sampled."""
        return self.observation_ids_batch([message], [sampled_ids])[0]

    def observation_ids_batch(
        self, messages: Sequence[Message], sampled_ids: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """``observation_ids`` of each (message, sampled ids) pair, tokenised in one call."""
        if len(messages) != len(sampled_ids):
            raise ValueError(f"{len(messages)} messages but {len(sampled_ids)} sampled-id lists; give one per message")
        glues = _encode(self.tokenizer, [self.glue_text(m) for m in messages])
        return [self._after_response(glue, sampled) for glue, sampled in zip(glues, sampled_ids, strict=True)]

    def _after_response(self, glue: list[int], sampled_ids: Sequence[int]) -> list[int]:
        """The glue's ids minus the closing ids the response already ends with."""
        if glue[: len(self.close_ids)] != self.close_ids:
            raise ValueError("chat template glue does not start with the assistant-turn closing text")
        overlap = 0
        for k in range(len(self.close_ids), 0, -1):  # longest suffix of the response = prefix of close
            if len(sampled_ids) >= k and list(sampled_ids[-k:]) == self.close_ids[:k]:
                overlap = k
                break
        return glue[overlap:]

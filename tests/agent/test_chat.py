"""Token-in/token-out rendering: observation ids vs templating the whole conversation."""

from __future__ import annotations

import pytest

from ragen_tasks.agent.chat import ChatRenderer

SYSTEM = {"role": "system", "content": "You play."}
USER0 = {"role": "user", "content": "Board:\n#_P#\nActions left: 3."}
USER1 = {"role": "user", "content": "Reward: 0.\nBoard:\n#P_#"}
RESPONSE = "<think>go left</think><answer>Left</answer>"


def _whole(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_incremental_ids_equal_whole_conversation(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    r = ChatRenderer(tok)
    prompt = r.prompt_ids([SYSTEM, USER0])
    assert prompt == _whole(tok, [SYSTEM, USER0])
    sampled = tok.encode(RESPONSE, add_special_tokens=False)  # stands in for the engine's sampled ids
    obs = r.observation_ids(USER1, sampled)
    assert tok.convert_ids_to_tokens(obs[:1]) == ["<|im_end|>"]  # the glue closes the assistant turn
    whole = _whole(tok, [SYSTEM, USER0, {"role": "assistant", "content": RESPONSE}, USER1])
    assert prompt + sampled + obs == whole


def test_batched_ids_equal_one_at_a_time(chatml_tokenizer) -> None:
    """The batched forms (one tokenizer call for many texts) give each item's ids exactly."""
    tok = chatml_tokenizer
    r = ChatRenderer(tok)
    conversations = [[SYSTEM, USER0], [USER0], [SYSTEM, {"role": "user", "content": "x" * 40}]]
    assert r.prompt_ids_batch(conversations) == [_whole(tok, c) for c in conversations]
    sampled = tok.encode(RESPONSE, add_special_tokens=False)
    messages = [USER1, USER0, {"role": "user", "content": ""}]
    endings = [sampled, [*sampled, tok.eos_token_id], []]
    one_by_one = []
    for m, e in zip(messages, endings, strict=True):
        glue = tok.encode(r.glue_text(m), add_special_tokens=False)
        one_by_one.append(glue[1:] if e and e[-1] == tok.eos_token_id else glue)
    assert r.observation_ids_batch(messages, endings) == one_by_one
    assert r.observation_ids_batch([], []) == [] and r.prompt_ids_batch([]) == []
    with pytest.raises(ValueError, match="2 messages but 1 sampled-id lists"):
        r.observation_ids_batch(messages[:2], endings[:1])


def test_sampled_end_of_turn_is_not_fed_twice(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    r = ChatRenderer(tok)
    sampled = [*tok.encode(RESPONSE, add_special_tokens=False), tok.eos_token_id]
    with_eos = r.observation_ids(USER1, sampled)
    without = r.observation_ids(USER1, sampled[:-1])
    assert without[0] == tok.eos_token_id and with_eos == without[1:]


def test_tokenizer_without_chat_template_is_a_clear_error(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = None
        with pytest.raises(ValueError, match="chat_template"):
            ChatRenderer(tok)
    finally:
        tok.chat_template = saved


QWEN_STYLE = (  # the shape of Qwen2.5's template: a default system message when none is given
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("with_system", [True, False])
def test_qwen_style_template(chatml_tokenizer, with_system: bool) -> None:
    tok = chatml_tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = QWEN_STYLE
        r = ChatRenderer(tok)
        first = [SYSTEM, USER0] if with_system else [USER0]
        sampled = tok.encode(RESPONSE, add_special_tokens=False)
        ids = r.prompt_ids(first) + sampled + r.observation_ids(USER1, sampled)
        assert ids == _whole(tok, [*first, {"role": "assistant", "content": RESPONSE}, USER1])
    finally:
        tok.chat_template = saved

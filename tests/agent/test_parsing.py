"""Parsing of <think>/<answer> responses and action mapping (hypothesis + hand cases)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_tasks.agent.parsing import map_actions, parse_response

NAMES = ("Up", "Down", "Left", "Right")


@settings(max_examples=300, deadline=None)
@given(st.text(), st.booleans())
def test_arbitrary_text_never_raises(text: str, think: bool) -> None:
    parsed = parse_response(text, think=think)
    assert parsed.ok == (parsed.error == "")
    if not parsed.ok:
        assert parsed.actions == ()
    actions, _ = map_actions(parsed.actions, NAMES, max_actions=3)
    assert len(actions) <= 3


_tagless = st.text(alphabet=st.characters(blacklist_characters="<>|"), max_size=40)
_action = st.tuples(
    st.sampled_from(NAMES), st.sampled_from(["lower", "upper", "same"]), st.sampled_from(["", " ", "\n"])
)


def _spell(item: tuple[str, str, str]) -> str:
    name, case, pad = item
    word = name.lower() if case == "lower" else name.upper() if case == "upper" else name
    return f"{pad}{word}{pad}"


@settings(max_examples=300, deadline=None)
@given(st.lists(_action, min_size=1, max_size=8), _tagless, st.booleans(), st.integers(1, 8))
def test_valid_answers_always_parse(items: list[tuple[str, str, str]], thought: str, think: bool, cap: int) -> None:
    answer = "<answer>" + " || ".join(_spell(i) for i in items) + "</answer>"
    text = f"<think>{thought}</think>{answer}" if think else answer
    parsed = parse_response(text, think=think)
    assert parsed.ok, parsed.error
    assert parsed.think == (thought.strip() if think else "")
    actions, all_valid = map_actions(parsed.actions, NAMES, max_actions=cap)
    assert all_valid
    assert actions == [name for name, _, _ in items][:cap]


@pytest.mark.parametrize(
    "text, think, ok",
    [
        ("<think>go</think><answer>Up</answer>", True, True),
        ("  <think>go</think>\n<answer>Up || left</answer>\n", True, True),
        ("<answer>Up</answer>", True, False),  # think mode needs the think block
        ("<think>go</think><answer>Up</answer>", False, False),  # no-think mode forbids it
        ("<answer>Up</answer>", False, True),
        ("<think>go</think><answer></answer>", True, False),  # no action
        ("<think>go</think><answer>Up || || Down</answer>", True, False),  # empty action
        ("<think>go</think><answer>Up</answer> and more", True, False),  # trailing text
        ("<think>a</think>b</think><answer>Up</answer>", True, False),  # repeated tag
        ("<think>go</think><answer>Up", True, False),  # cut at the token cap
        ("", True, False),
    ],
)
def test_hand_cases(text: str, think: bool, ok: bool) -> None:
    assert parse_response(text, think=think).ok is ok


def test_invalid_action_keeps_the_valid_prefix() -> None:
    assert map_actions(["up", "Jump", "Down"], NAMES, max_actions=5) == (["Up"], False)
    assert map_actions(["Jump"], NAMES, max_actions=5) == ([], False)
    # an invalid action beyond the cap is never looked at
    assert map_actions(["up", "down", "Jump"], NAMES, max_actions=2) == (["Up", "Down"], True)

"""The locally trained tokenizer: any text round-trips, tags are single tokens, ChatML template."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen2Config

from ragen_tasks.models.tokenizer import SPECIAL_TOKENS, TAG_TOKENS, build_tokenizer, training_corpus

TEXTS = [
    "Reward: 0.15, 100 steps; it's  done\n\n  √√ ##__",
    "<think>The box is left of me.</think><answer>Left || Up</answer>",
    "#####\n#_P_#\n#_X√#\n#_OS#\n#####",
    "Phoenix Dragon Trader Librarian 12345 ünïcödé 漢字 🙂\t\r\n",
]


_TOK = build_tokenizer()  # shared by the hypothesis test (function fixtures don't mix with @given)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_vocab_size_in_range(tok) -> None:
    assert 500 <= len(tok) <= 2048


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_any_text_round_trips(text: str) -> None:
    tok = _TOK
    assert tok.decode(tok.encode(text)) == text


def test_tags_and_specials_are_single_tokens(tok) -> None:
    for piece in (*TAG_TOKENS, *SPECIAL_TOKENS):
        assert len(tok.encode(piece)) == 1, piece
    # a tag stays one token inside running text too
    ids = tok.encode("x</answer>y")
    assert tok.convert_tokens_to_ids("</answer>") in ids


def test_tags_survive_skip_special_tokens(tok) -> None:
    ids = tok.encode("<answer>Up</answer><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<answer>Up</answer>"


def test_chat_template_chatml(tok) -> None:
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(chat, tokenize=False).endswith("assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"


def test_reload_next_to_a_qwen2_config_keeps_ids(tok, tmp_path) -> None:
    """AutoTokenizer picks Qwen2Tokenizer for a qwen2 config: ids must still be identical."""
    from ragen_tasks.models.loading import _keep_saved_pre_tokenizer

    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    auto = _keep_saved_pre_tokenizer(AutoTokenizer.from_pretrained(tmp_path), str(tmp_path))
    saved = json.loads((tmp_path / "tokenizer.json").read_text())["pre_tokenizer"]
    assert json.loads(auto.backend_tokenizer.to_str())["pre_tokenizer"] == saved
    for text in TEXTS + training_corpus()[:50]:
        assert auto.encode(text) == tok.encode(text), text


def test_swapped_pre_tokenizer_is_detected_and_reloaded(tok, tmp_path) -> None:
    """A tokenizer.json with plain ByteLevel splitting must come back as saved, not as Qwen's split."""
    from tokenizers import pre_tokenizers

    from ragen_tasks.models.loading import _keep_saved_pre_tokenizer

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    try:
        Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
        reloaded = _keep_saved_pre_tokenizer(AutoTokenizer.from_pretrained(tmp_path), str(tmp_path))
        for text in TEXTS:
            assert reloaded.encode(text) == tok.encode(text), text
    finally:
        tok.backend_tokenizer.pre_tokenizer = build_tokenizer().backend_tokenizer.pre_tokenizer


@pytest.fixture(scope="module")
def cell_tok():
    return build_tokenizer(board_cells=True)


@pytest.mark.parametrize("game", ["sokoban", "frozen_lake"])
def test_board_cells_are_one_token_each(cell_tok, tok, game) -> None:
    """With ``board_cells`` every cell of a rendered board is its own token; the default merges runs."""
    from ragen_tasks import envs

    env = envs.make(game)
    for seed in range(5):
        board, _ = env.reset(seed=seed)
        rows = str(board).split("\n")
        pieces = [cell_tok.decode([i]) for i in cell_tok.encode(str(board))]
        assert pieces == [piece for row in rows for piece in (*row, "\n")][:-1], (game, seed)
        assert len(tok.encode(str(board))) < len(pieces)  # the default tokenizer merges cells


def _first_prompt(game: str, *, seed: int) -> tuple[Any, str, list[dict[str, str]]]:
    """(env, board, system + first user message) of ``game``'s episode ``seed``, as the rollout loop writes it."""
    from ragen_tasks import envs
    from ragen_tasks.agent.prompts import initial_messages
    from ragen_tasks.rollout.loop import game_rules

    env = envs.make(game)
    board, _ = env.reset(seed=seed)
    prompt = initial_messages(
        env_name=game,
        action_names=env.action_names,
        legend=env.legend,
        board=str(board),
        turns_left=5,
        actions_left=10,
        max_actions_per_turn=3,
        think=True,
        rules=game_rules(env),
    )
    return env, str(board), prompt


@pytest.mark.parametrize("game", ["sokoban", "frozen_lake", "bandit"])
def test_board_cells_leave_the_prompt_text_and_answers_alone(cell_tok, tok, game) -> None:
    """Only the board is split: the prompt's other lines (legend, actions, format) and an answer
    pre-tokenize exactly as with the default tokenizer, and a board before ``<|im_end|>`` still splits."""
    env, board, prompt = _first_prompt(game, seed=0)
    text = prompt[0]["content"] + "\n" + prompt[1]["content"].split("Board:\n")[0]
    answer = (
        f"<think>{env.action_names[0]} first.</think><answer>{env.action_names[0]} || {env.action_names[-1]}</answer>"
    )

    def pieces(tokenizer, text: str) -> list[str]:
        return [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]

    for plain in (text, answer):
        assert pieces(cell_tok, plain) == pieces(tok, plain), plain
    if game != "bandit":
        ids = cell_tok.encode(str(board) + "<|im_end|>")
        assert len(ids) == len(str(board)) + 1  # every cell and newline one token, then the end marker
    for sample in TEXTS:
        assert cell_tok.decode(cell_tok.encode(sample)) == sample


def test_board_cell_preset_reloads_with_its_split(tmp_path) -> None:
    """``tiny-cells`` comes back from its cache folder with the cell split, not Qwen's (ids unchanged)."""
    from ragen_tasks.models.loading import load_tokenizer
    from ragen_tasks.models.presets import ensure_preset

    folder = ensure_preset("tiny-cells", cache_dir=tmp_path)
    reloaded = load_tokenizer(str(folder))
    fresh = build_tokenizer(board_cells=True)
    for text in TEXTS:
        assert reloaded.encode(text) == fresh.encode(text), text


@pytest.fixture(scope="module")
def row_tok():
    return build_tokenizer(lake_rows=True)


def test_lake_row_tokens_cover_every_row_a_lake_shows() -> None:
    """Each row a 4-wide lake can render is listed once: frozen tiles and holes with at most one
    player symbol and at most one goal (the count by hand: 16 + 96 + 32 + 144 = 288)."""
    from ragen_tasks.models.tokenizer import lake_row_tokens

    rows = lake_row_tokens()
    assert len(rows) == len(set(rows)) == 16 + 4 * 3 * 8 + 4 * 8 + 4 * 3 * 3 * 4
    assert {"____", "P___", "OG_O", "__√_", "X_OO"} <= set(rows)
    assert not {"PP__", "GG__", "P__X", "#___"} & set(rows)


def test_lake_rows_are_one_token_each(row_tok, tok) -> None:
    """With ``lake_rows`` a rendered lake (any state: on ice, in a hole, on the goal) is its four rows,
    one token each, between newlines, and the prompt's words and the answers encode as before."""
    from ragen_tasks import envs

    env = envs.make("frozen_lake")
    boards = []  # every board shown, the terminal ones (player in a hole ``X``, on the goal ``√``) included
    for seed in range(100):
        board, _ = env.reset(seed=seed)
        boards.append(str(board))
        for action in ("Left", "Down", "Right", "Up", "Down", "Right", "Down", "Right"):
            board, _, terminated, _, _ = env.step(action)
            boards.append(str(board))
            if terminated:
                break
    assert {"P", "X", "√"} <= set("".join(boards)), "the boards must show every player state"
    for board in boards:
        rows_between_newlines = [piece for row in board.split("\n") for piece in (row, "\n")][:-1]
        pieces = [row_tok.decode([i]) for i in row_tok.encode(board + "<|im_end|>")]
        assert pieces == [*rows_between_newlines, "<|im_end|>"], board
    for sample in TEXTS:
        assert row_tok.decode(row_tok.encode(sample)) == sample
    prose = (
        "Symbols: P = player, _ = frozen tile, O = hole. <think>The goal is Down 2.</think><answer>Up || Left</answer>"
    )
    assert row_tok.encode(prose) == tok.encode(prose)


def test_lake_row_preset_reloads_with_its_rows(tmp_path) -> None:
    """``tiny-rows`` comes back from its cache folder encoding boards into the same row ids."""
    from ragen_tasks.models.loading import load_tokenizer
    from ragen_tasks.models.presets import ensure_preset

    folder = ensure_preset("tiny-rows", cache_dir=tmp_path)
    reloaded = load_tokenizer(str(folder))
    fresh = build_tokenizer(lake_rows=True)
    for text in (*TEXTS, "Board:\n____\nP___\nOG_O\n__√_<|im_end|>"):
        assert reloaded.encode(text) == fresh.encode(text), text


@pytest.fixture(scope="module")
def word_tok():
    return build_tokenizer(lake_rows=True, whole_words=True)


def test_whole_words_make_each_word_of_a_lake_demonstration_one_token(word_tok, row_tok) -> None:
    """With ``whole_words`` the warm start's richest lake reasoning is one token per word (its
    punctuation kept on it), each lake row one token, the tags one each; Qwen's split takes far more."""
    from ragen_tasks import envs
    from ragen_tasks.training.warm_start import demo_reasoning

    env = envs.make("frozen_lake")
    for seed in range(20):
        env.reset(seed=seed)
        reasoning = demo_reasoning(env, "rows-neighbours-diagonals-turns", turns_left=1 + seed % 5)
        text = f"<think>{reasoning}</think><answer>Up || Left</answer>"
        pieces = [word_tok.decode([i]) for i in word_tok.encode(text)]
        words = reasoning.split(" ")
        expected = ["<think>", words[0], *(f" {w}" for w in words[1:]), "</think>", "<answer>", "Up", " ", "||"]
        expected += [" Left", "</answer>"]
        # a copied row (``Above: ____.``) is the row token then its full stop
        assert pieces == [q for e in expected for q in _split_row(e)], (seed, pieces)
        assert word_tok.decode(word_tok.encode(text)) == text
        assert len(row_tok.encode(text)) > 1.3 * len(pieces)


def _split_row(piece: str) -> list[str]:
    """`` ____.`` -> ``[" ", "____", "."]``: a lake row is an added token, cut out of its word."""
    from ragen_tasks.models.tokenizer import lake_row_tokens

    word = piece.strip(" .")
    if word not in lake_row_tokens():
        return [piece]
    before, _, after = piece.partition(word)
    return [p for p in (before, word, after) if p]


@pytest.mark.parametrize("game", ["sokoban", "frozen_lake", "bandit"])
def test_whole_words_make_the_first_prompt_shorter_and_round_trip(word_tok, row_tok, game) -> None:
    """Every game's first prompt, as the rollout loop renders it, encodes to fewer whole-word tokens
    than Qwen-split ones and decodes back to itself; any other text still round-trips."""
    _, _, prompt = _first_prompt(game, seed=3)
    text = word_tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    ids = word_tok.encode(text)
    assert word_tok.decode(ids) == text
    assert len(ids) < 0.75 * len(row_tok.encode(text)), game
    for sample in TEXTS:
        assert word_tok.decode(word_tok.encode(sample)) == sample


def test_whole_word_preset_reloads_with_its_split(tmp_path) -> None:
    """``tiny-rows-words`` comes back from its cache folder with the word split, not Qwen's (ids
    unchanged), in a folder of its own corpus's fingerprint."""
    from ragen_tasks.models.loading import load_tokenizer
    from ragen_tasks.models.presets import ensure_preset
    from ragen_tasks.models.tokenizer import corpus_fingerprint

    folder = ensure_preset("tiny-rows-words", cache_dir=tmp_path)
    assert folder.name.endswith(corpus_fingerprint(training_corpus(game_text=True)))
    assert ensure_preset("tiny-rows-composed", cache_dir=tmp_path).name.endswith(corpus_fingerprint(training_corpus()))
    reloaded = load_tokenizer(str(folder))
    fresh = build_tokenizer(lake_rows=True, whole_words=True)
    for text in (*TEXTS, "Board:\n____\nP___\nOG_O\n__√_<|im_end|>", "<think>Left wall. Turns left: 3.</think>"):
        assert reloaded.encode(text) == fresh.encode(text), text

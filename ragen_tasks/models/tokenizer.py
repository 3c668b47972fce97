"""A small byte-level BPE tokenizer trained locally, with ChatML special tokens and a chat template.

Byte-level BPE means ANY text encodes (unknown characters fall back to bytes), so the tokenizer
never fails on a board symbol it has not seen. It is trained on a fixed built-in corpus: sample
boards in the games' symbol sets, the answer tags, action names, digits and the prompt words,
plus the renders of the registered games when ``ragen_tasks.envs`` provides them. BPE merges runs
of board symbols (``###``, ``#P``) into single tokens; ``board_cells=True`` keeps one token per cell,
``lake_rows=True`` makes each row of the 4-wide lake one token. ``whole_words=True`` splits text
into whole words with their punctuation (`` hole.``, `` Above:``) instead of Qwen's split, and adds
the games' own prompts and the warm start's reasoning to the corpus, so that each word the agent
reads or writes in a game is one token.

The answer tags (``<think>``, ``</think>``, ``<answer>``, ``</answer>``, ``||``) are added tokens:
each is exactly one id, which makes stopping at ``</answer>`` a one-token check. They are not
*special* tokens, so ``decode(..., skip_special_tokens=True)`` keeps them.

The wrapper is a ``PreTrainedTokenizerFast``. ``AutoTokenizer`` on a folder with a ``qwen2``
config picks ``Qwen2Tokenizer``, which replaces the saved pre-tokenizer with Qwen's regex split;
we train with that same split (except with ``board_cells``, whose extra split only the reload
below preserves), and ``loading.load_policy`` also checks the loaded pre-tokenizer
against ``tokenizer.json`` and reloads the file verbatim on any mismatch.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "||")

#: Qwen2's pre-tokenizer split (digits one by one, words with their leading space). Using the same
#: split as ``Qwen2Tokenizer`` keeps ids identical even where a loader swaps the pre-tokenizer in.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``whole_words``: a pre-token is a run of non-space characters with at most one leading space, or a
#: run of whitespace, so a word keeps its punctuation and BPE can make `` hole.`` one token (Qwen's split
#: cuts punctuation and each digit off, which leaves the games' short sentences at two tokens a word).
WORD_SPLIT_REGEX = r" ?\S+|\s+"

#: Qwen-style ChatML template; ``add_generation_prompt`` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ACTIONS = ("Up", "Down", "Left", "Right", "Phoenix", "Dragon", "Trader", "Librarian", "Lion", "Eagle")
_PROMPT_WORDS = """
You are an agent playing a game. You are solving the Sokoban puzzle. You are walking on a frozen
lake. You are choosing an arm of a bandit. Push every box onto a target. Reach the goal and do not
fall into a hole. The symbols mean: wall, floor, target, box, box on target, player, player on
target, frozen tile, hole, goal, player in hole, player on goal. Valid actions are listed below.
Actions left. Turn. Reward. Your answer must be in the format. First think step by step, then give
the answer. Answer with one or more actions separated by the separator. The current state is shown
below. After your move the state is: Which arm do you pull? The arm pays a reward with some
probability. Low risk, high risk, always, sometimes, never. Invalid action. Format error. Success.
the a an of to in on is are and or not you your it this that with for at by from as be was has
Think about where the box can move. If I push the box left it will be stuck against the wall, so I
should go around it first. The goal is below me, the hole is to the right, so I move down twice.
The dragon pays more on average but it is risky; the phoenix pays a small amount every time.
Expected value, probability, average, payoff, choose, pull, pick, option, better, worse, safe.
Room, grid, row, column, position, corner, next, then, first, second, third, again, stop, done.
System, user, assistant, observation, instruction, example, response, maximum, minimum, steps.
"""
_BOARD_SYMBOLS = ("#", "_", "O", "X", "√", "P", "S", "G")

#: One pre-token per board cell: a board symbol followed by another board symbol or the end of a
#: line. Inside words (``Observation``, ``Phoenix``) and before punctuation or spaces (the legend's
#: ``P = player``) the letters stay part of the word, so none of the games' prompt text or answers
#: is split (tested). Other text can be: runs of these capitals (``GPS``) or one ending a line (``UP``).
BOARD_CELL_REGEX = f"[{''.join(_BOARD_SYMBOLS)}](?=[{''.join(_BOARD_SYMBOLS)}]|$)"

#: The paper's lake is 4 cells wide; its board symbols (``frozen_lake.LEGEND``'s keys).
LAKE_ROW_WIDTH = 4
_LAKE_FLOOR, _LAKE_PLAYER, _LAKE_GOAL = ("_", "O"), ("P", "X", "√"), "G"


def lake_row_tokens(width: int = LAKE_ROW_WIDTH) -> list[str]:
    """Every row a ``width``-wide FrozenLake board can show: frozen tiles and holes, at most one
    player symbol (on ice, in a hole, on the goal) and at most one goal (288 rows at width 4)."""
    rows = []
    for cells in itertools.product((*_LAKE_FLOOR, *_LAKE_PLAYER, _LAKE_GOAL), repeat=width):
        if sum(c in _LAKE_PLAYER for c in cells) <= 1 and cells.count(_LAKE_GOAL) <= 1:
            rows.append("".join(cells))
    return rows


def _builtin_corpus() -> list[str]:
    """Deterministic sample text covering the boards, tags, actions, digits and prompt words."""
    lines: list[str] = [_PROMPT_WORDS]
    # Boards: fixed pseudo-random grids in the games' symbol sets (a simple LCG, no global RNG).
    state = 12345
    for size in (4, 6, 8):
        for _ in range(40):
            rows = []
            for _r in range(size):
                row = ""
                for _c in range(size):
                    state = (1103515245 * state + 12345) % (2**31)
                    row += _BOARD_SYMBOLS[state % len(_BOARD_SYMBOLS)]
                rows.append(row)
            lines.append("\n".join(rows))
    # Answers in the required format, with every action pair.
    for a, b in itertools.product(_ACTIONS, repeat=2):
        lines.append(f"<think>I should move {a} then {b}.</think><answer>{a} || {b}</answer>")
        lines.append(f"<answer>{a}</answer>")
    lines.append(" ".join(str(i) for i in range(200)))
    lines.append("Reward: -0.1 0.1 0.15 0.25 1.0 10 -1 Actions left: 1 2 3 4 5 6 7 8 9 10")
    return lines


def _env_corpus() -> list[str]:
    """Renders of the registered games, if the envs package provides ``make`` (else nothing)."""
    try:
        from ragen_tasks import envs  # optional: the games may not be installed yet

        make = envs.make
    except (ImportError, AttributeError):
        return []
    lines: list[str] = []
    for name in ("bandit", "sokoban", "frozen_lake"):
        try:
            env = make(name)
            for seed in range(20):
                obs, _ = env.reset(seed=seed)
                lines.append(str(obs))
                lines.append(" ".join(env.action_names))
                lines.extend(f"{k}: {v}" for k, v in env.legend.items())
        except Exception as err:  # a game still under construction must not break the tokenizer
            logger.warning("tokenizer corpus: skipping env %r (%s)", name, err)
    return lines


def _game_text_corpus(seeds: int = 100) -> list[str]:
    """What the agent reads and writes in each game, as the rollout loop and the warm start word it:
    the first prompt, the follow-up messages and demonstration-style replies (every reasoning style of
    the warm start), over ``seeds`` episodes a game of random actions. Deterministic."""
    from typing import get_args

    from ragen_tasks.agent.prompts import followup_message, initial_messages
    from ragen_tasks.config import WarmStartConfig
    from ragen_tasks.envs import make
    from ragen_tasks.rollout.loop import game_rules
    from ragen_tasks.training.warm_start import demo_reasoning

    styles = get_args(WarmStartConfig.model_fields["reasoning"].annotation)
    max_turns, max_actions = 5, 10
    rng = random.Random(0)
    lines: list[str] = []
    for name in ("bandit", "sokoban", "frozen_lake"):
        for seed in range(seeds):
            env = make(name)
            board, _ = env.reset(seed=seed)
            system, user = initial_messages(
                env_name=name,
                action_names=env.action_names,
                legend=env.legend,
                board=str(board),
                turns_left=max_turns,
                actions_left=max_actions,
                max_actions_per_turn=3,
                think=True,
                rules=game_rules(env),
            )
            lines += [f"system\n{system['content']}", f"user\n{user['content']}"]
            actions_left = max_actions
            for turn in range(max_turns):
                actions = [rng.choice(env.action_names) for _ in range(rng.randint(1, 3))]
                reasoning = demo_reasoning(env, styles[(seed + turn) % len(styles)], turns_left=max_turns - turn)
                lines.append(f"assistant\n<think>{reasoning}</think><answer>{' || '.join(actions)}</answer>")
                reward, over = 0.0, False
                for action in actions:
                    board, step_reward, terminated, truncated, _ = env.step(action)
                    reward, actions_left, over = reward + float(step_reward), actions_left - 1, terminated or truncated
                    if over:
                        break
                if over:
                    break
                followup = followup_message(
                    board=str(board),
                    reward=reward,
                    turns_left=max_turns - turn - 1,
                    actions_left=actions_left,
                    format_ok=True,
                )
                lines.append(f"user\n{followup['content']}")
    return lines


def training_corpus(*, game_text: bool = False) -> list[str]:
    """The exact text the tokenizer is trained on (built-in sample + game renders if available; with
    ``game_text``, also the games' prompts and the warm start's reasoning, ``_game_text_corpus``)."""
    return _builtin_corpus() + _env_corpus() + (_game_text_corpus() if game_text else [])


def corpus_fingerprint(corpus: list[str]) -> str:
    """Short sha256 of the corpus; part of the preset cache key, so a new corpus means a new folder."""
    return hashlib.sha256("\x00".join(corpus).encode()).hexdigest()[:10]


def build_tokenizer(
    vocab_size: int = 1024,
    corpus: list[str] | None = None,
    *,
    board_cells: bool = False,
    lake_rows: bool = False,
    whole_words: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` (default: ``training_corpus(game_text=whole_words)``)
    and wrap it.

    ``board_cells``: split a game board into one token per cell (``BOARD_CELL_REGEX``) before BPE,
    so that a cell's token does not depend on its neighbours (by default BPE merges runs such as
    ``###`` or ``#P`` into one token, and the model must learn every merged piece's layout).

    ``lake_rows``: every row of the paper's 4-wide lake is one token (``lake_row_tokens``, added
    tokens), so a board is four row tokens between newlines: which column holds the player, the goal
    or a hole is a property of one token, and a row's place on the board a fixed offset, instead of
    something a small model must count out of merged pieces of varying length. The same four
    symbols in a row of other text (a Sokoban row such as ``#_X__#``) also become one such token.

    ``whole_words``: pre-tokens are whole words with their punctuation (``WORD_SPLIT_REGEX``) and the
    default corpus adds the games' text, so a lake episode of the warm start is about 1.6 times fewer
    tokens than with Qwen's split (a supervised step's attention, quadratic in them, about 2.5 times
    less). ``loading.load_policy`` keeps the saved split, as for ``board_cells``.
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs >= 300 (256 bytes + specials)")
    corpus = training_corpus(game_text=whole_words) if corpus is None else corpus
    tok = Tokenizer(models.BPE())
    cell_split = [pre_tokenizers.Split(Regex(BOARD_CELL_REGEX), behavior="isolated")] if board_cells else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *cell_split,
            pre_tokenizers.Split(
                Regex(WORD_SPLIT_REGEX if whole_words else QWEN_SPLIT_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    wrapped.add_tokens(list(TAG_TOKENS))  # one id each; not special, so decoding keeps them
    if lake_rows:
        wrapped.add_tokens(lake_row_tokens())
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped

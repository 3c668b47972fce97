"""Prompt text of the agent turn: our own wording, one short task description per game.

The first turn is a system message (the role) and a user message with the task, the legend of
the board's symbols (``env.legend``), the valid actions (``env.action_names``), the limits, the
required answer format and the board. Each later turn is ONE user message with the reward of the
last turn, the turns and actions left and the new board: the agent sees its whole budget, since
the best move depends on it (on slippery ice, fewer turns left call for bolder turns). The games own no prompt text; this file owns all.
Chat-template rendering and tokenisation live in ``ragen_tasks.agent.chat``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}

SYSTEM_PROMPT = "You are an agent that plays a text game. Read the board, reason briefly, then act."


def _bandit(action_names: Sequence[str], rules: Mapping[str, Any]) -> str:
    arms = " and ".join(action_names)
    return (
        f"You face a slot machine with two arms named {arms}. Each arm pays a reward drawn from its own "
        "unknown distribution. Pull exactly one arm to get the highest expected reward."
    )


def _sokoban(action_names: Sequence[str], rules: Mapping[str, Any]) -> str:
    return (
        "You are in a Sokoban warehouse. Push every box onto a target. You can push a box but never pull "
        "it, and a box pushed into a corner is stuck for good, so plan before you push."
    )


def _frozen_lake(action_names: Sequence[str], rules: Mapping[str, Any]) -> str:
    text = "You walk on a frozen lake. Reach the goal without falling into a hole."
    if rules.get("is_slippery", True):
        return text + " The ice is slippery: you may slide sideways instead of moving the way you chose."
    return text + " The ice is not slippery: every move goes the way you chose."


#: env name -> function(action_names, rules) -> task description. ``rules`` is the game's config as
#: a mapping (e.g. FrozenLake's ``is_slippery``), so the text never claims a rule the game does not
#: play by. Add a line here for a new game.
TASK_DESCRIPTIONS: dict[str, Callable[[Sequence[str], Mapping[str, Any]], str]] = {
    "bandit": _bandit,
    "sokoban": _sokoban,
    "frozen_lake": _frozen_lake,
}

_GENERIC = "Play the game below and reach its goal."


def task_description(env_name: str, action_names: Sequence[str], rules: Mapping[str, Any] | None = None) -> str:
    """The short task text for ``env_name`` under the game's ``rules``; unknown games get a generic line."""
    describe = TASK_DESCRIPTIONS.get(env_name)
    return describe(action_names, rules or {}) if describe is not None else _GENERIC


def answer_format(*, think: bool, max_actions_per_turn: int) -> str:
    """How the answer must look (think or no-think mode)."""
    example = "<answer>Action1 || Action2</answer>" if max_actions_per_turn > 1 else "<answer>Action</answer>"
    limit = (
        f"Give 1 to {max_actions_per_turn} actions separated by ||; they run in order."
        if (max_actions_per_turn > 1)
        else "Give exactly one action."
    )
    if think:
        return f"Answer as <think>your reasoning</think>{example}. {limit}"
    return f"Answer as {example} with no other text. {limit}"


def initial_messages(
    *,
    env_name: str,
    action_names: Sequence[str],
    legend: Mapping[str, str],
    board: str,
    turns_left: int,
    actions_left: int,
    max_actions_per_turn: int,
    think: bool,
    rules: Mapping[str, Any] | None = None,
) -> list[Message]:
    """System + first user message of an episode (``rules``: the game's config, see TASK_DESCRIPTIONS)."""
    lines = [task_description(env_name, action_names, rules)]
    if legend:
        symbols = ", ".join(f"{symbol} = {meaning}" for symbol, meaning in legend.items())
        lines.append(f"Symbols: {symbols}.")
    lines.append(f"Valid actions: {', '.join(action_names)}.")
    lines.append(f"Turns left: {turns_left}. Actions left: {actions_left}.")
    lines.append(answer_format(think=think, max_actions_per_turn=max_actions_per_turn))
    lines.append(f"Board:\n{board}")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


def followup_message(*, board: str, reward: float, turns_left: int, actions_left: int, format_ok: bool) -> Message:
    """The user message after a turn: last reward, turns and actions left, the new board."""
    lines = []
    if not format_ok:
        lines.append("Your last answer was invalid (wrong format or an invalid action).")
    lines.append(f"Reward: {reward:g}.")
    lines.append(f"Turns left: {turns_left}. Actions left: {actions_left}.")
    lines.append(f"Board:\n{board}")
    return {"role": "user", "content": "\n".join(lines)}

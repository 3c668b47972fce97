"""Prompt text: every required part is present, the bandit prompt does not reveal the better arm."""

from __future__ import annotations

from ragen_tasks.agent.prompts import followup_message, initial_messages, task_description


def test_initial_messages_hold_every_part() -> None:
    msgs = initial_messages(
        env_name="sokoban",
        action_names=("Up", "Down", "Left", "Right"),
        legend={"#": "wall", "P": "player"},
        board="#P#",
        turns_left=4,
        actions_left=7,
        max_actions_per_turn=3,
        think=True,
    )
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    for part in (
        "Sokoban",
        "# = wall",
        "P = player",
        "Up, Down, Left, Right",
        "Turns left: 4. Actions left: 7",
        "<think>",
        "1 to 3",
        "#P#",
    ):
        assert part in user, part


def test_no_think_format_and_single_action() -> None:
    user = initial_messages(
        env_name="frozen_lake",
        action_names=("Left",),
        legend={},
        board="P",
        turns_left=1,
        actions_left=1,
        max_actions_per_turn=1,
        think=False,
    )[1]["content"]
    assert "<think>" not in user and "<answer>" in user and "exactly one action" in user


def test_bandit_names_both_arms_and_hides_payoffs() -> None:
    for names in (("Phoenix", "Dragon"), ("Dragon", "Phoenix"), ("Trader", "Librarian")):
        text = task_description("bandit", names)
        assert names[0] in text and names[1] in text
        for leak in ("0.1", "0.25", "1.0", "risk", "safe"):
            assert leak not in text


def test_followup_message() -> None:
    msg = followup_message(board="_P_", reward=-0.1, turns_left=3, actions_left=2, format_ok=False)
    assert msg["role"] == "user"
    assert (
        "invalid" in msg["content"]
        and "-0.1" in msg["content"]
        and "Turns left: 3. Actions left: 2." in msg["content"]
        and "_P_" in msg["content"]
    )


def test_frozen_lake_text_states_the_slip_rule_the_game_plays_by() -> None:
    slippery = task_description("frozen_lake", ("Left",), {"is_slippery": True})
    firm = task_description("frozen_lake", ("Left",), {"is_slippery": False})
    assert "slippery" in slippery and "sideways" in slippery
    assert "not slippery" in firm and "sideways" not in firm
    assert task_description("frozen_lake", ("Left",)) == slippery  # the game's default is slippery


def test_the_rollout_prompt_follows_the_game_config(chatml_tokenizer) -> None:
    from ragen_tasks.config import AgentConfig
    from ragen_tasks.rollout.engine import SamplingParams
    from ragen_tasks.rollout.loop import RolloutTask, run_rollouts
    from ragen_tasks.rollout.scripted import ScriptedEngine

    prompts = {}
    for slippery in (True, False):
        task = RolloutTask("t", "frozen_lake", {"is_slippery": slippery}, seed=0, group_id=0)
        engine = ScriptedEngine(chatml_tokenizer, "<think>a</think><answer>Left</answer>")
        [traj] = run_rollouts(
            engine,
            chatml_tokenizer,
            [task],
            agent=AgentConfig(max_turns=1),
            sampling=SamplingParams(max_new_tokens=64),
            policy_version=0,
            weights_fingerprint="f",
        )
        prompts[slippery] = chatml_tokenizer.decode(traj.input_ids[: traj.prompt_length])
    assert "The ice is slippery" in prompts[True] and "not slippery" in prompts[False]

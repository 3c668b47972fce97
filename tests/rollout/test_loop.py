"""The multi-turn loop's edges, with the ScriptedEngine double and the LineWalk toy game."""

from __future__ import annotations

import pytest

from ragen_tasks.config import AgentConfig
from ragen_tasks.data.trajectory import TrajectoryStatus, from_table, to_table
from ragen_tasks.models.tokenizer import build_tokenizer
from ragen_tasks.rollout.engine import Generation, SamplingParams
from ragen_tasks.rollout.loop import EngineReplyError, RolloutTask, reasoning_token_count, run_rollouts
from ragen_tasks.rollout.scripted import ScriptedEngine

SAMPLING = SamplingParams(max_new_tokens=64, temperature=1.0, seed=3)


def _tasks(n: int, seed: int = 7, **config) -> list[RolloutTask]:
    return [RolloutTask(f"t{i}", "line_walk", dict(config), seed + i // 2, i // 2) for i in range(n)]


def _run(engine, tok, tasks, line_walk, **agent_kw):
    agent = AgentConfig(**{"max_turns": 3, "max_actions_per_turn": 2, **agent_kw})
    return run_rollouts(
        engine,
        tok,
        tasks,
        agent=agent,
        sampling=SAMPLING,
        policy_version=4,
        weights_fingerprint="abc",
        env_factory=line_walk,
    )


def _check_token_layout(traj, engine: ScriptedEngine) -> None:
    """input_ids = prompt + (sampled ids + fed observation ids) per turn, sampled ids exactly the engine's."""
    traj.check()
    prompts = [req.prompt_ids for call in engine.calls for req in call if req.session_id == traj.traj_id]
    assert list(prompts[0]) == traj.input_ids[: traj.prompt_length]
    for k, (s, e) in enumerate(zip(traj.turn_starts, traj.turn_ends, strict=True)):
        assert traj.response_mask[s:e] == [1] * (e - s)
        assert all(lp == -0.5 for lp in traj.rollout_logprobs[s:e])
        if k + 1 < traj.num_turns:  # the next request is exactly the sequence so far
            assert list(prompts[k + 1]) == traj.input_ids[: traj.turn_starts[k + 1]]
            assert traj.response_mask[e : traj.turn_starts[k + 1]] == [0] * (traj.turn_starts[k + 1] - e)
    assert sum(traj.response_mask) == sum(e - s for s, e in zip(traj.turn_starts, traj.turn_ends, strict=True))


def test_walking_to_the_goal_terminates_with_success(chatml_tokenizer, line_walk) -> None:
    # Pick each episode's right direction from its board: the double reads the request it answers.
    boards: dict[str, str] = {}

    def reply(sid: str, i: int) -> str:
        board = boards[sid]
        direction = "Right" if board.index("G") > board.index("P") else "Left"
        return f"<think>go {direction}</think><answer>{direction} || {direction.lower()}</answer>"

    tasks = _tasks(4, size=5)
    for t in tasks:
        boards[t.traj_id] = line_walk("line_walk", {"size": 5}).reset(seed=t.seed)[0]
    engine = ScriptedEngine(chatml_tokenizer, lambda sid, i: reply(sid, i))

    trajs = _run(engine, chatml_tokenizer, tasks, line_walk, max_turns=1, max_actions_per_turn=5)
    for traj in trajs:
        distance = abs(traj.turn_observations[0].index("G") - traj.turn_observations[0].index("P"))
        if distance <= 2:
            assert traj.status == TrajectoryStatus.TERMINATED and traj.success and traj.reward == 1.0
        else:
            assert traj.status == TrajectoryStatus.MAX_TURNS and not traj.success
        _check_token_layout(traj, engine)
        assert traj.policy_version == 4 and traj.weights_fingerprint == "abc"
    assert sorted(engine.released) == sorted(t.traj_id for t in tasks)


def test_multi_turn_layout_and_release_order(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>hm</think><answer>Left</answer>")
    trajs = _run(engine, chatml_tokenizer, _tasks(6, size=8), line_walk, max_turns=4)
    assert len(engine.calls) <= 4
    for traj in trajs:
        _check_token_layout(traj, engine)
        assert traj.turn_actions[0] == ["Left"]
        assert traj.status in (TrajectoryStatus.TERMINATED, TrajectoryStatus.MAX_TURNS)
        if traj.status == TrajectoryStatus.MAX_TURNS:
            assert traj.num_turns == 4
    # finished episodes leave the batch: later calls are never larger than earlier ones
    sizes = [len(c) for c in engine.calls]
    assert sizes == sorted(sizes, reverse=True)
    assert sorted(engine.released) == sorted(t.traj_id for t in _tasks(6))
    assert from_table(to_table(trajs)) == trajs


def test_garbage_costs_the_format_penalty_and_consumes_turns(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "\x00 lol </think> <answer>")
    trajs = _run(engine, chatml_tokenizer, _tasks(2), line_walk, max_turns=3, format_penalty=-0.25)
    for traj in trajs:
        assert traj.status == TrajectoryStatus.MAX_TURNS and traj.num_turns == 3
        assert traj.turn_format_ok == [False] * 3 and traj.turn_actions == [[], [], []]
        assert traj.turn_rewards == [-0.25] * 3 and traj.reward == pytest.approx(-0.75)
        assert "invalid" in chatml_tokenizer.decode(traj.input_ids[traj.turn_ends[0] : traj.turn_starts[1]])
        _check_token_layout(traj, engine)


def test_invalid_action_runs_the_valid_prefix_then_penalises(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>x</think><answer>Left || Jump || Left</answer>")
    (traj,) = _run(engine, chatml_tokenizer, _tasks(1, size=30, max_actions_per_episode=50), line_walk, max_turns=1)
    assert traj.turn_actions == [["Left"]] and traj.turn_format_ok == [False]
    assert traj.turn_rewards[0] == pytest.approx(-0.1 + (1.0 if traj.success else 0.0))


def test_engine_dropping_a_reply_fails_loudly(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>x</think><answer>Left</answer>", drop_replies=1)
    with pytest.raises(EngineReplyError, match="returned 2 generations for 3 requests"):
        _run(engine, chatml_tokenizer, _tasks(3), line_walk)
    assert sorted(engine.released) == ["t0", "t1", "t2"]  # caches are freed even on failure


def test_malformed_generation_fails_loudly(chatml_tokenizer, line_walk) -> None:
    class Bad(ScriptedEngine):
        def generate(self, requests, params):
            return [Generation(token_ids=[1, 2], logprobs=[0.0], finish_reason="stop", text="") for _ in requests]

    with pytest.raises(EngineReplyError, match="2 token ids but 1 log-probs"):
        _run(Bad(chatml_tokenizer, ""), chatml_tokenizer, _tasks(1), line_walk)


def test_token_cap_cuts_the_response(chatml_tokenizer, line_walk) -> None:
    long = "<think>" + "very long thought " * 50 + "</think><answer>Left</answer>"
    engine = ScriptedEngine(chatml_tokenizer, long)
    trajs = _run(engine, chatml_tokenizer, _tasks(2), line_walk, max_turns=2, max_tokens_per_turn=16)
    for traj in trajs:
        assert [e - s for s, e in zip(traj.turn_starts, traj.turn_ends, strict=True)] == [16, 16]
        assert traj.turn_format_ok == [False, False]
        _check_token_layout(traj, engine)


def test_all_episodes_end_on_turn_one(chatml_tokenizer, line_walk) -> None:
    # max_actions_per_episode=1: one valid action truncates every episode on turn 1
    engine = ScriptedEngine(chatml_tokenizer, "<think>x</think><answer>Right || Right</answer>")
    trajs = _run(engine, chatml_tokenizer, _tasks(4, size=30), line_walk, max_actions_per_episode=1)
    assert len(engine.calls) == 1
    for traj in trajs:
        assert traj.num_turns == 1 and traj.turn_actions == [["Right"]]
        assert traj.status == TrajectoryStatus.MAX_ACTIONS
        assert traj.input_ids[traj.turn_ends[0] :] == []  # nothing fed after the last turn


def test_game_truncation_is_max_actions(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>x</think><answer>Left || Right</answer>")
    trajs = _run(engine, chatml_tokenizer, _tasks(2, size=30, max_actions_per_episode=3), line_walk, max_turns=5)
    for traj in trajs:
        assert traj.status in (TrajectoryStatus.MAX_ACTIONS, TrajectoryStatus.TERMINATED)
        assert sum(len(a) for a in traj.turn_actions) <= 3


def test_context_guard_stops_cleanly(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>" + "t " * 20 + "</think><answer>Left</answer>")
    probe = _run(engine, chatml_tokenizer, _tasks(1, size=30), line_walk, max_turns=1)[0]
    limit = probe.num_tokens + 40  # room for the first turn, not for a second one
    engine = ScriptedEngine(chatml_tokenizer, "<think>" + "t " * 20 + "</think><answer>Left</answer>")
    (traj,) = _run(
        engine,
        chatml_tokenizer,
        _tasks(1, size=30),
        line_walk,
        max_turns=5,
        max_context_tokens=limit,
        max_tokens_per_turn=probe.response_length,
    )
    assert traj.status == TrajectoryStatus.CONTEXT and traj.num_turns == 1 and traj.num_tokens <= limit
    assert engine.released == ["t0"]


def test_prompt_longer_than_context_is_a_clear_error(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<answer>Left</answer>")
    with pytest.raises(ValueError, match="max_context_tokens"):
        _run(engine, chatml_tokenizer, _tasks(1, size=30), line_walk, max_context_tokens=32)


def test_loss_on_observations_and_eos(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>x</think><answer>Left</answer> and on", append_eos=True)
    (traj,) = _run(engine, chatml_tokenizer, _tasks(1, size=30), line_walk, max_turns=2, loss_on_observations=True)
    # the engine stopped at the stop string before the eos; the fed glue closes the turn
    assert traj.loss_mask[: traj.prompt_length] == [0] * traj.prompt_length
    assert traj.loss_mask[traj.prompt_length :] == [1] * (traj.num_tokens - traj.prompt_length)
    no_think = ScriptedEngine(chatml_tokenizer, "<answer>Left", append_eos=True)
    (traj2,) = _run(no_think, chatml_tokenizer, _tasks(1, size=30), line_walk, max_turns=2, think=False)
    end = traj2.turn_ends[0]
    assert traj2.input_ids[end - 1] == chatml_tokenizer.eos_token_id  # sampled eos ...
    assert traj2.input_ids[end] != chatml_tokenizer.eos_token_id  # ... is not fed again
    assert traj2.loss_mask == traj2.response_mask


def _closes_reasoning_at_its_end(ids: list[int], tokenizer) -> bool:
    """The last of ``ids`` completes "</think>" (a BPE token may also hold the answer's first bytes)."""
    return "</think>" in tokenizer.decode(ids) and "</think>" not in tokenizer.decode(ids[:-1])


def test_without_loss_on_reasoning_each_turn_is_trained_from_the_end_of_its_reasoning(
    chatml_tokenizer, line_walk
) -> None:
    replies = ["<think>go left</think><answer>Left</answer>", "<think>no end to this", "<answer>Left</answer>"]
    engine = ScriptedEngine(chatml_tokenizer, lambda _sid, i: replies[i])
    (traj,) = _run(engine, chatml_tokenizer, _tasks(1, size=30), line_walk, loss_on_reasoning=False)
    assert traj.num_turns == 3

    def split(turn: int) -> tuple[list[int], list[int]]:  # (the turn's untrained ids, its trained ids)
        s, e = traj.turn_starts[turn], traj.turn_ends[turn]
        ids, mask = traj.input_ids[s:e], traj.loss_mask[s:e]
        return [t for t, m in zip(ids, mask, strict=True) if not m], [t for t, m in zip(ids, mask, strict=True) if m]

    untrained, trained = split(0)
    assert chatml_tokenizer.decode(untrained + trained) == replies[0]  # the reasoning first, then the answer
    assert _closes_reasoning_at_its_end(untrained, chatml_tokenizer)
    assert split(1) == ([], traj.input_ids[traj.turn_starts[1] : traj.turn_ends[1]])  # never closed: trained whole
    assert split(2) == ([], traj.input_ids[traj.turn_starts[2] : traj.turn_ends[2]])
    assert all(m == 0 for m, r in zip(traj.loss_mask, traj.response_mask, strict=True) if not r)
    (trained_whole,) = _run(
        ScriptedEngine(chatml_tokenizer, lambda _sid, i: replies[i]), chatml_tokenizer, _tasks(1, size=30), line_walk
    )
    assert trained_whole.loss_mask == trained_whole.response_mask


@pytest.mark.parametrize("tag_tokens", [True, False], ids=["tag-is-one-token", "tag-split-by-bpe"])
def test_reasoning_token_count_ends_with_the_token_that_closes_the_reasoning(chatml_tokenizer, tag_tokens) -> None:
    tokenizer = build_tokenizer() if tag_tokens else chatml_tokenizer
    ids = tokenizer.encode("<think>Up is a hole</think><answer>Down</answer>", add_special_tokens=False)
    k = reasoning_token_count(ids, tokenizer)
    assert _closes_reasoning_at_its_end(ids[:k], tokenizer)
    if tag_tokens:
        assert tokenizer.decode(ids[k:]) == "<answer>Down</answer>"
    only_reasoning = tokenizer.encode("<think>Up</think>", add_special_tokens=False)
    assert reasoning_token_count(only_reasoning, tokenizer) == 0  # nothing after it: trained whole
    assert reasoning_token_count([], tokenizer) == 0


def test_loss_on_reasoning_false_needs_think() -> None:
    with pytest.raises(ValueError, match=r"agent\.loss_on_reasoning=false needs agent\.think=true"):
        AgentConfig(think=False, loss_on_reasoning=False)


def test_duplicate_traj_ids_are_rejected(chatml_tokenizer, line_walk) -> None:
    tasks = [RolloutTask("same", "line_walk", {}, 1, 0)] * 2
    with pytest.raises(ValueError, match="traj_id"):
        _run(ScriptedEngine(chatml_tokenizer, ""), chatml_tokenizer, tasks, line_walk)


def test_every_message_states_the_turns_and_actions_left(chatml_tokenizer, line_walk) -> None:
    engine = ScriptedEngine(chatml_tokenizer, "<think>hm</think><answer>Left || Left</answer>")
    (traj,) = _run(engine, chatml_tokenizer, _tasks(1, size=30, max_actions_per_episode=50), line_walk, max_turns=4)
    assert traj.num_turns == 4
    prompt = chatml_tokenizer.decode(traj.input_ids[: traj.prompt_length])
    assert "Turns left: 4. Actions left: 10." in prompt
    for k in range(3):  # the observation fed after turn k
        fed = chatml_tokenizer.decode(traj.input_ids[traj.turn_ends[k] : traj.turn_starts[k + 1]])
        assert f"Turns left: {3 - k}. Actions left: {10 - 2 * (k + 1)}." in fed, fed

"""OpenAIEngine request/response handling against a small vLLM-like server on 127.0.0.1 (``FakeVLLM``
and the ``server`` fixture live in conftest.py)."""

from __future__ import annotations

import pytest

from ragen_tasks.config import AgentConfig
from ragen_tasks.data.trajectory import TrajectoryStatus
from ragen_tasks.rollout.engine import GenerationRequest, SamplingParams
from ragen_tasks.rollout.loop import RolloutTask, run_rollouts
from ragen_tasks.rollout.openai_engine import EngineServerError, OpenAIEngine
from ragen_tasks.rollout.seeding import session_seed


def _requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(session_id=f"s{i}", prompt_ids=[1, 2, 10 + i]) for i in range(n)]


def test_request_body_and_reply_parsing(server) -> None:
    url, fake = server
    engine = OpenAIEngine(url + "/v1", "tiny")
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=0, seed=5)
    gens = engine.generate(_requests(3), params)
    assert [g.token_ids for g in gens] == [[11, 12, 13], [12, 13, 14], [13, 14, 15]]  # in request order
    assert all(g.logprobs == pytest.approx([-0.1, -0.2, -0.3]) and g.finish_reason == "stop" for g in gens)
    bodies = sorted(fake.bodies, key=lambda b: b["prompt"][-1])
    assert [b["prompt"] for b in bodies] == [[1, 2, 10], [1, 2, 11], [1, 2, 12]]
    # a seed per session, not per position: identical group prompts still differ, and a session keeps its
    # seed whichever requests share its call (a batch split over servers sends the same seeds)
    assert [b["seed"] for b in bodies] == [session_seed(5, f"s{i}") for i in range(3)]
    assert len({b["seed"] for b in bodies}) == 3 and all(0 <= b["seed"] < 2**63 for b in bodies)
    engine.generate(list(reversed(_requests(3)))[:2], params)
    assert sorted(b["seed"] for b in fake.bodies[3:]) == sorted(session_seed(5, s) for s in ("s1", "s2"))
    b = bodies[0]
    assert b["model"] == "tiny" and b["max_tokens"] == 8 and b["top_k"] == -1 and b["logprobs"] == 0
    assert b["return_tokens_as_token_ids"] and b["include_stop_str_in_output"] and b["stop"] == ["</answer>"]
    engine.close()


@pytest.mark.parametrize("mode, finish", [("token_ids_field", "stop"), ("eos", "eos")])
def test_token_ids_field_and_eos(server, mode: str, finish: str) -> None:
    url, fake = server
    fake.mode = mode
    (gen,) = OpenAIEngine(url, "m").generate(_requests(1), SamplingParams(max_new_tokens=8))
    assert gen.token_ids == [11, 12, 13] and gen.finish_reason == finish
    assert "seed" not in fake.bodies[0]


def test_length_finish(server) -> None:
    url, _ = server
    (gen,) = OpenAIEngine(url, "m").generate(_requests(1), SamplingParams(max_new_tokens=2))
    assert gen.token_ids == [11, 12] and gen.finish_reason == "length"


def test_http_error_names_status(server) -> None:
    url, fake = server
    fake.mode = "error"
    with pytest.raises(EngineServerError, match=r"HTTP 500.*boom"):
        OpenAIEngine(url, "m").generate(_requests(2), SamplingParams(max_new_tokens=4))


def test_malformed_reply(server) -> None:
    url, fake = server
    fake.mode = "bad"
    with pytest.raises(EngineServerError, match="logprobs"):
        OpenAIEngine(url, "m").generate(_requests(1), SamplingParams(max_new_tokens=4))


def test_timeout_is_clear(server) -> None:
    url, fake = server
    fake.mode = "slow"
    with pytest.raises(EngineServerError, match=r"did not answer within 0\.2s"):
        OpenAIEngine(url, "m", timeout_s=0.2).generate(_requests(1), SamplingParams(max_new_tokens=4))


def test_unreachable_server_is_clear() -> None:
    with pytest.raises(EngineServerError, match="cannot reach"):
        OpenAIEngine("http://127.0.0.1:9", "m", timeout_s=2).generate(_requests(1), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="base_url"):
        OpenAIEngine("127.0.0.1:8000", "m")


def test_rollout_loop_over_the_wire(server, chatml_tokenizer, line_walk) -> None:
    url, fake = server
    fake.reply_text = "<think>hm</think><answer>Left</answer>"
    fake.reply_ids = chatml_tokenizer.encode(fake.reply_text, add_special_tokens=False)
    tasks = [RolloutTask(f"t{i}", "line_walk", {"size": 8}, 3, 0) for i in range(4)]
    trajs = run_rollouts(
        OpenAIEngine(url, "m"),
        chatml_tokenizer,
        tasks,
        agent=AgentConfig(max_turns=3),
        sampling=SamplingParams(max_new_tokens=64, seed=1),
        policy_version=0,
        weights_fingerprint="f",
        env_factory=line_walk,
    )
    for traj in trajs:
        assert traj.status in (TrajectoryStatus.TERMINATED, TrajectoryStatus.MAX_TURNS)
        s, e = traj.turn_starts[0], traj.turn_ends[0]
        assert traj.input_ids[s:e] == fake.reply_ids and traj.turn_actions[0] == ["Left"]
    assert trajs[0].input_ids == trajs[1].input_ids  # same seed, same scripted server: same sequence

"""HFEngine: log-probs equal a plain forward pass, KV reuse changes nothing, stops, errors."""

from __future__ import annotations

import pytest
import torch

from ragen_tasks.models import load_policy
from ragen_tasks.rollout.engine import Engine, GenerationRequest, SamplingParams
from ragen_tasks.rollout.hf_engine import HFEngine, filter_logits
from ragen_tasks.rollout.seeding import session_keys, uniforms


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core box two OpenMP threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_policy("tiny", cache_dir=tmp_path_factory.mktemp("presets"))


def _chat(tok, text: str) -> list[int]:
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    )


def _prompts(tok, n: int) -> list[list[int]]:
    return [_chat(tok, "You are playing Sokoban. " * (1 + i % 3) + "#_P_#" * i) for i in range(n)]


def _full_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response_t | prefix) from ONE plain forward pass on the concatenated sequence."""
    seq = torch.tensor([prompt + response])  # (1, T)
    with torch.no_grad():
        logp = model(input_ids=seq).logits[0].float().log_softmax(-1)  # (T, V)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)]


def _multi_turn(engine, tok, prompts, params, turns=3):
    """Run `turns` turns; each next request = history + response + an observation. Returns all generations."""
    hist = [list(p) for p in prompts]
    out = []
    for turn in range(turns):
        gens = engine.generate([GenerationRequest(f"s{i}", h) for i, h in enumerate(hist)], params)
        out.append(gens)
        obs = [
            tok.encode(f"<|im_end|>\n<|im_start|>user\nturn {turn} obs {'#' * i}<|im_end|>\n<|im_start|>assistant\n")
            for i in range(len(hist))
        ]
        hist = [h + g.token_ids + o for h, g, o in zip(hist, gens, obs, strict=True)]
    return out, hist


def test_is_an_engine(policy) -> None:
    assert isinstance(HFEngine(*policy), Engine)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, seed=1, stop_strings=()),
        SamplingParams(max_new_tokens=12, seed=2, temperature=0.7, top_p=0.9, top_k=20, stop_strings=()),
        SamplingParams(max_new_tokens=12, temperature=0.0, stop_strings=()),
    ],
)
@pytest.mark.parametrize("fast", [True, False], ids=["fast_qwen2", "transformers_forward"])
def test_logprobs_equal_a_full_forward_pass(policy, params, fast) -> None:
    model, tok = policy
    gens_by_turn, _ = _multi_turn(HFEngine(model, tok, fast=fast), tok, _prompts(tok, 5), params, turns=1)
    hist = [list(p) for p in _prompts(tok, 5)]
    for i, g in enumerate(gens_by_turn[0]):
        assert len(g.logprobs) == len(g.token_ids) >= 1
        ref = _full_logprobs(model, hist[i], g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4), (g.logprobs, ref)


@pytest.mark.parametrize("fast", [True, False], ids=["fast_qwen2", "transformers_forward"])
def test_logprobs_of_later_turns_with_cache_reuse_equal_full_forward(policy, fast) -> None:
    model, tok = policy
    prompts = _prompts(tok, 4)
    params = SamplingParams(max_new_tokens=10, seed=5, stop_strings=())
    engine = HFEngine(model, tok, fast=fast)
    hist = [list(p) for p in prompts]
    for turn in range(3):
        gens = engine.generate([GenerationRequest(f"s{i}", h) for i, h in enumerate(hist)], params)
        for h, g in zip(hist, gens, strict=True):
            ref = _full_logprobs(model, h, g.token_ids)
            assert torch.allclose(torch.tensor(g.logprobs), ref, atol=1e-4), turn
        hist = [h + g.token_ids + _chat(tok, f"obs {turn}") for h, g in zip(hist, gens, strict=True)]
    assert engine.cached_sessions == 4


def test_cache_reuse_gives_the_same_outputs_as_no_reuse(policy) -> None:
    model, tok = policy
    params = SamplingParams(max_new_tokens=10, seed=11, stop_strings=())
    with_cache, hist_a = _multi_turn(HFEngine(model, tok, reuse_cache=True), tok, _prompts(tok, 6), params)
    without, hist_b = _multi_turn(HFEngine(model, tok, reuse_cache=False), tok, _prompts(tok, 6), params)
    assert hist_a == hist_b
    for ga, gb in zip(with_cache, without, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_fast_forward_and_transformers_forward_agree(policy) -> None:
    model, tok = policy
    params = SamplingParams(max_new_tokens=10, seed=4, stop_strings=())
    a, _ = _multi_turn(HFEngine(model, tok, fast=True), tok, _prompts(tok, 5), params, turns=2)
    b, _ = _multi_turn(HFEngine(model, tok, fast=False), tok, _prompts(tok, 5), params, turns=2)
    for ga, gb in zip(a, b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert x.token_ids == y.token_ids
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


def test_edited_history_falls_back_and_release_frees(policy) -> None:
    model, tok = policy
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_strings=())
    engine = HFEngine(model, tok)
    prompt = _prompts(tok, 1)[0]
    first = engine.generate([GenerationRequest("a", prompt)], params)[0]
    # the next request does NOT extend the cached ids (history rewritten): must equal a fresh engine
    edited = _chat(tok, "something else entirely") + first.token_ids
    got = engine.generate([GenerationRequest("a", edited)], params)[0]
    fresh = HFEngine(model, tok, reuse_cache=False).generate([GenerationRequest("a", edited)], params)[0]
    assert got.token_ids == fresh.token_ids
    # a request equal to the cached ids (nothing new) still works
    again = engine.generate([GenerationRequest("a", edited)], params)[0]
    assert again.token_ids == fresh.token_ids
    engine.release(["a", "unknown"])
    assert engine.cached_sessions == 0


def test_batching_does_not_change_a_row(policy) -> None:
    model, tok = policy
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_strings=())
    prompts = _prompts(tok, 5)
    engine = HFEngine(model, tok, reuse_cache=False)
    batched = engine.generate([GenerationRequest(f"s{i}", p) for i, p in enumerate(prompts)], params)
    for i, p in enumerate(prompts):
        alone = engine.generate([GenerationRequest("x", p)], params)[0]
        assert alone.token_ids == batched[i].token_ids


def test_seed_makes_a_call_reproducible(policy) -> None:
    model, tok = policy
    reqs = [GenerationRequest(f"s{i}", p) for i, p in enumerate(_prompts(tok, 4))]
    p1 = SamplingParams(max_new_tokens=16, seed=7, stop_strings=())
    a = HFEngine(model, tok, reuse_cache=False).generate(reqs, p1)
    b = HFEngine(model, tok, reuse_cache=False, seed=99).generate(reqs, p1)
    c = HFEngine(model, tok, reuse_cache=False).generate(
        reqs, SamplingParams(max_new_tokens=16, seed=8, stop_strings=())
    )
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_stop_string_eos_and_length(policy) -> None:
    model, tok = policy
    prompt = _prompts(tok, 1)[0]
    free = HFEngine(model, tok).generate(
        [GenerationRequest("a", prompt)], SamplingParams(max_new_tokens=20, seed=3, stop_strings=())
    )[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    pieces = [tok.decode([t]) for t in free.token_ids]
    # a stop string = the text of the first token whose text did not occur earlier in the response
    k = next(i for i in range(2, 20) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    stopped = HFEngine(model, tok).generate(
        [GenerationRequest("a", prompt)], SamplingParams(max_new_tokens=20, seed=3, stop_strings=(pieces[k],))
    )[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: k + 1]
    assert stopped.text.endswith(pieces[k])
    eos = HFEngine(model, tok, eos_token_ids=[free.token_ids[3]]).generate(
        [GenerationRequest("a", prompt)], SamplingParams(max_new_tokens=20, seed=3, stop_strings=())
    )[0]
    first = free.token_ids.index(free.token_ids[3])
    assert eos.finish_reason == "eos" and eos.token_ids == free.token_ids[: first + 1]


def test_bfloat16_engine_runs(tmp_path) -> None:
    model, tok = load_policy("tiny", dtype="bfloat16", cache_dir=tmp_path)
    gens = HFEngine(model, tok).generate(
        [GenerationRequest(f"s{i}", p) for i, p in enumerate(_prompts(tok, 3))],
        SamplingParams(max_new_tokens=6, seed=0),
    )
    assert all(len(g.token_ids) == len(g.logprobs) >= 1 for g in gens)
    assert all(lp <= 0 and lp == lp for g in gens for lp in g.logprobs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
    ],
)
def test_bad_params_name_the_field(policy, kwargs, needle) -> None:
    engine = HFEngine(*policy)
    with pytest.raises(ValueError, match=needle):
        engine.generate([GenerationRequest("a", [1, 2])], SamplingParams(**kwargs))


def test_bad_requests_are_rejected(policy) -> None:
    engine = HFEngine(*policy)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt_ids"):
        engine.generate([GenerationRequest("a", [])], params)
    with pytest.raises(ValueError, match="twice"):
        engine.generate([GenerationRequest("a", [1]), GenerationRequest("a", [2])], params)
    with pytest.raises(ValueError, match="exceeds the model context"):
        engine.generate([GenerationRequest("a", [5] * engine.max_positions)], params)
    assert engine.generate([], params) == []


def test_filter_logits_matches_a_loop_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 30, generator=gen)
    for top_k, top_p in [(5, 1.0), (0, 0.6), (8, 0.3), (0, 1.0)]:
        out = filter_logits(logits, top_k=top_k, top_p=top_p)
        for row, got in zip(logits, out, strict=True):
            order = row.argsort(descending=True).tolist()
            keep = order[:top_k] if top_k else order
            if top_p < 1:
                probs = row[keep].softmax(-1).tolist()  # nucleus applied after top-k
                mass, cut = 0.0, []
                for tok_id, p in zip(keep, probs, strict=True):
                    if mass >= top_p:
                        break
                    cut.append(tok_id)
                    mass += p
                keep = cut
            assert set(torch.isfinite(got).nonzero().squeeze(1).tolist()) == set(keep)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=1, temperature=1.0, stop_strings=()),
        SamplingParams(max_new_tokens=1, temperature=1e4, stop_strings=()),  # reaches tokens of p < 1e-38
        SamplingParams(max_new_tokens=1, temperature=1e4, top_k=3, top_p=0.9, stop_strings=()),
        SamplingParams(max_new_tokens=1, temperature=0.0, stop_strings=()),
    ],
)
def test_sampled_logprobs_equal_log_softmax(policy, params) -> None:
    """The log-prob of a sampled token (taken from the softmax) equals log_softmax's, down to tokens whose
    probability underflows float32 (log-prob -200 here), which are sampled at a very high temperature."""
    engine = HFEngine(*policy)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    logits[32:, 1:] -= 200.0  # rows 32..63: every token but 0 has probability ~e^-200 (0 in float32)
    u01 = torch.from_numpy(uniforms(session_keys(0, [f"s{i}" for i in range(64)]), 1)[:, 0])  # (64,)
    tok, logprob = engine._sample(logits, params, u01)
    ref = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).squeeze(1)
    assert torch.isfinite(logprob).all()
    assert torch.allclose(logprob, ref, atol=1e-5, rtol=0), (logprob - ref).abs().max()
    if params.temperature == 1e4 and params.top_k == 0:
        assert (logprob < -150).any()  # the underflow path was exercised


def test_texts_equal_the_tokenizers_decode(policy) -> None:
    """The batched decode (one call into the Rust backend) gives what tokenizer.decode gives per row."""
    model, tok = policy
    gens = HFEngine(model, tok).generate(
        [GenerationRequest(f"t{i}", p) for i, p in enumerate(_prompts(tok, 8))],
        SamplingParams(max_new_tokens=24, seed=3, stop_strings=()),
    )
    assert all(g.text == tok.decode(g.token_ids, skip_special_tokens=True) for g in gens)


def test_fast_forward_needs_a_mask_except_for_decode_steps(policy) -> None:
    """mask=None means "a one-token decode step on a cache that already knows its padding"."""
    from ragen_tasks.models.fast_qwen2 import FastQwen2, KVCache

    model, _ = policy
    fast = FastQwen2(model)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])  # (B, Q)
    pos = torch.arange(3).expand(2, 3)
    with torch.inference_mode(), pytest.raises(ValueError, match="mask=None"):
        fast.forward(ids, pos, None, KVCache([], capacity=8))
    cache = KVCache([], capacity=8)
    mask = torch.ones((2, 1, 3, 3), dtype=torch.bool).tril()  # (B, 1, Q, K) causal, no pads
    with torch.inference_mode():
        fast.forward(ids, pos, mask, cache)
        with pytest.raises(ValueError, match="mask=None"):
            fast.forward(ids, pos + 3, None, cache)  # three new tokens without a mask
        assert fast.forward(ids[:, :1], pos[:, :1] + 3, None, cache).shape == (2, model.config.vocab_size)
    assert cache.length == 4


def test_rows_finishing_at_different_steps_stay_exact(policy) -> None:
    """Padded rows of different lengths, with ~1/15 of the vocabulary ending a row, so rows end at
    different steps and the batch is compacted (the cache's keys, values and key mask re-indexed):
    every row's log-probs equal a plain forward pass on its own sequence, and the fast forward gives
    what the transformers forward gives."""
    model, tok = policy
    eos = list(range(5, model.config.vocab_size, 15))
    params = SamplingParams(max_new_tokens=24, seed=3, stop_strings=())
    prompts = _prompts(tok, 12)
    reqs = [GenerationRequest(f"s{i}", p) for i, p in enumerate(prompts)]
    fast = HFEngine(model, tok, reuse_cache=False, eos_token_ids=eos).generate(reqs, params)
    slow = HFEngine(model, tok, reuse_cache=False, eos_token_ids=eos, fast=False).generate(reqs, params)
    lengths = sorted(len(g.token_ids) for g in fast)
    assert len(set(lengths)) >= 3 and lengths[3] < 24, lengths  # a quarter ended early: compaction ran
    for prompt, f, s in zip(prompts, fast, slow, strict=True):
        assert f.token_ids == s.token_ids
        ref = _full_logprobs(model, prompt, f.token_ids)
        assert torch.allclose(torch.tensor(f.logprobs), ref, atol=1e-4)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)

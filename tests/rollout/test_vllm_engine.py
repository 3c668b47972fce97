"""VLLMEngine: lazy import (CPU), output conversion (CPU, with a stand-in completion), real vLLM (GPU)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from ragen_tasks.rollout.engine import GenerationRequest, SamplingParams


def test_module_does_not_import_vllm() -> None:
    code = "import sys, ragen_tasks.rollout.vllm_engine; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_completion_conversion() -> None:
    from ragen_tasks.rollout.vllm_engine import _to_generation

    lp = SimpleNamespace
    done = SimpleNamespace(
        token_ids=(5, 7),
        logprobs=[{5: lp(logprob=-0.5), 9: lp(logprob=-2.0)}, {7: lp(logprob=-0.25)}],
        finish_reason="stop",
        stop_reason="</answer>",
        text="ab",
    )
    gen = _to_generation(done)
    assert gen.token_ids == [5, 7] and gen.logprobs == [-0.5, -0.25] and gen.finish_reason == "stop"
    assert _to_generation(SimpleNamespace(**{**vars(done), "stop_reason": None})).finish_reason == "eos"
    assert _to_generation(SimpleNamespace(**{**vars(done), "finish_reason": "length"})).finish_reason == "length"


@pytest.mark.gpu
def test_vllm_generates_and_reloads(tmp_path) -> None:
    pytest.importorskip("vllm")
    from ragen_tasks.models import load_policy
    from ragen_tasks.rollout.vllm_engine import VLLMEngine

    model, tok = load_policy("tiny", dtype="float32", device="cpu")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), dtype="float32", gpu_memory_utilization=0.2)
    prompt = tok.encode("hello", add_special_tokens=False)
    reqs = [GenerationRequest(session_id=f"s{i}", prompt_ids=prompt) for i in range(4)]
    gens = engine.generate(reqs, SamplingParams(max_new_tokens=8, seed=0))
    assert len(gens) == 4 and all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens)
    engine.load_weights(str(tmp_path))
    again = engine.generate(reqs, SamplingParams(max_new_tokens=8, seed=0))
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]

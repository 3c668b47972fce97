"""The generation engine contract: token ids in, sampled token ids + log-probs out.

The multi-turn loop calls ``generate`` once per turn for all live episodes. Each request carries
the FULL token sequence of its episode so far (prompt, earlier responses, observations) and a
``session_id``. The call is stateless for the caller; an engine MAY keep a session's KV cache
between calls and prefill only the new suffix (it must check that the cached ids are a prefix of
the new request and fall back to a full prefill otherwise). ``release`` frees a session's cache.
vLLM's automatic prefix caching gives the same effect behind the same interface.

Engines are chosen by name or by dotted path (``"pkg.module:Class"``), so heavy engines (vLLM)
are imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int  # per-turn token cap
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_strings: tuple[str, ...] = ("</answer>",)  # stop once the decoded response ends with one
    seed: int | None = None  # reproducible calls: a session samples from (seed, session_id) alone, see seeding.py


@dataclass(frozen=True)
class GenerationRequest:
    session_id: str  # stable per episode; the engine may key its KV cache on it
    prompt_ids: Sequence[int]  # the episode's full token sequence so far


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # sampled ids, including the stop / eos token if one was sampled
    logprobs: list[float]  # log p(token) under the sampling distribution BEFORE temperature/top-p/top-k
    #                        (i.e. the policy's own log-prob, what the update recomputes); same length
    finish_reason: Literal["stop", "eos", "length"]  # stop string, end-of-sequence token, or token cap
    text: str = field(default="")  # decoded token_ids, for parsing and reports only


@runtime_checkable
class Engine(Protocol):
    """Anything that can continue a batch of token sequences."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        """One Generation per request, in order."""
        ...

    def release(self, session_ids: Sequence[str]) -> None:
        """Forget cached state of finished episodes (no-op for stateless engines)."""
        ...

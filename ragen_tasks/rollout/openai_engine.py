"""OpenAIEngine: the Engine Protocol over an OpenAI-compatible ``/v1/completions`` server (vLLM).

Token ids in, token ids + log-probs out, so the rollout stays token-in/token-out across the wire:
each request sends ``prompt`` as a list of token ids, asks for ``logprobs: 0`` (the sampled
token's own log-prob) with ``return_tokens_as_token_ids`` (tokens come back as
``"token_id:123"``) and ``return_token_ids`` (newer vLLM: a ``token_ids`` list per choice; used
when present), ``include_stop_str_in_output`` (the stop string's tokens were sampled, so they
belong to the sequence) and vLLM's ``top_k``/``seed`` extras.

Server requirements (``vllm serve MODEL``): the returned log-probs must be the policy's raw
log-probs (vLLM's default ``--logprobs-mode raw_logprobs``), and the server should run with prefix
caching (vLLM's default) so re-sending an episode's history costs little.

One HTTP request per prompt, sent concurrently (the server batches them); with
``SamplingParams.seed`` set, each request's ``seed`` is ``session_seed(seed, session_id)``
(``rollout/seeding.py``): identical prompts of a group still get different samples, and a session's
seed does not depend on its position in the call, so a batch split over several servers
(``engine_options.base_urls``) sends every episode the seeds one server would have got. Finish reasons: ``length`` -> "length"; ``stop`` with a string
``stop_reason`` -> "stop"; ``stop`` without one (end-of-sequence token) -> "eos".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx

from ragen_tasks.rollout.engine import Generation, GenerationRequest, SamplingParams
from ragen_tasks.rollout.seeding import session_seed

logger = logging.getLogger(__name__)


class EngineServerError(RuntimeError):
    """The OpenAI-compatible server could not be reached, timed out, or answered badly."""


class OpenAIEngine:
    """Client of an OpenAI-compatible completions server. Stateless: ``release`` is a no-op."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 120.0,
        max_concurrency: int = 32,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport)

    def close(self) -> None:
        self._client.close()

    def release(self, session_ids: Sequence[str]) -> None:
        """No-op: the server's prefix cache is managed by the server."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        bodies = [self._body(r, params) for r in requests]
        if not bodies:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies))) as pool:
            return list(pool.map(self._post, bodies))

    def _body(self, request: GenerationRequest, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in request.prompt_ids],
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # vLLM: -1 = off
            "stop": list(params.stop_strings),
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "n": 1,
        }
        if params.seed is not None:
            body["seed"] = session_seed(params.seed, request.session_id)
        return body

    def _post(self, body: dict[str, Any]) -> Generation:
        url = f"{self.base_url}/v1/completions"
        try:
            response = self._client.post("/v1/completions", json=body)
        except httpx.TimeoutException as exc:
            raise EngineServerError(
                f"{url} did not answer within {self.timeout_s}s; raise engine_options.timeout_s or check the server"
            ) from exc
        except httpx.TransportError as exc:
            raise EngineServerError(f"cannot reach {url} ({exc}); is `vllm serve` running at that address?") from exc
        if response.status_code != 200:
            raise EngineServerError(f"{url} answered HTTP {response.status_code}: {response.text[:500]}")
        try:
            return _parse_choice(response.json())
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineServerError(f"{url} sent a completion this engine cannot read: {exc!r}") from exc


def _parse_choice(payload: dict[str, Any]) -> Generation:
    choice = payload["choices"][0]
    logprobs = choice.get("logprobs")
    if not logprobs or logprobs.get("token_logprobs") is None:
        raise ValueError("no 'logprobs.token_logprobs' in the choice: the server must support 'logprobs'")
    values = [float(v) for v in logprobs["token_logprobs"]]
    if choice.get("token_ids") is not None:
        ids = [int(t) for t in choice["token_ids"]]
    else:
        tokens = logprobs.get("tokens") or []
        if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            raise ValueError("tokens are not 'token_id:N' strings: the server ignored return_tokens_as_token_ids")
        ids = [int(t.split(":", 1)[1]) for t in tokens]
    if len(ids) != len(values):
        raise ValueError(f"{len(ids)} token ids but {len(values)} log-probs")
    reason = choice.get("finish_reason")
    finish: Literal["stop", "eos", "length"]
    if reason == "length":
        finish = "length"
    elif reason == "stop":
        finish = "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
    else:
        raise ValueError(f"finish_reason={reason!r}, expected 'stop' or 'length'")
    return Generation(token_ids=ids, logprobs=values, finish_reason=finish, text=str(choice.get("text", "")))

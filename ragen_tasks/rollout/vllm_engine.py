"""VLLMEngine: the Engine Protocol over an in-process ``vllm.LLM`` (GPU rollout pods only).

vLLM is imported ONLY inside this module's functions, so CPU installs (and the Prefect image,
whose pins clash with vLLM's) never import it; choose it by name ``"vllm"`` or dotted path
``"ragen_tasks.rollout.vllm_engine:VLLMEngine"``. Requests go in as token ids (``TokensPrompt``),
one ``SamplingParams`` per prompt so each session of a seeded call gets its own seed
``session_seed(seed, session_id)`` (identical group prompts still differ, and the seed does not
depend on the session's position in the call: see ``rollout/seeding.py``). ``logprobs=0`` returns the sampled token's log-prob; the engine is
built with ``logprobs_mode="raw_logprobs"`` where the vLLM version supports it, so they are the
policy's own log-probs before temperature/top-p (the Engine contract). Automatic prefix caching
replaces a per-session KV cache, so ``release`` is a no-op.

``load_weights(checkpoint_dir)`` pushes a new policy's safetensors into the running engine
(``collective_rpc`` on every worker, then ``reset_prefix_cache`` so no stale KV is reused).
Not exercised on this CPU machine: its tests are ``@pytest.mark.gpu`` and skip without vllm.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from ragen_tasks.rollout.engine import Generation, GenerationRequest, SamplingParams
from ragen_tasks.rollout.seeding import session_seed

logger = logging.getLogger(__name__)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the image
        raise ImportError(
            "the 'vllm' engine needs the vllm package: run rollout in the docker/Dockerfile.vllm image, "
            "or use rollout.engine='openai' against a `vllm serve` sidecar, or 'hf' on CPU"
        ) from exc
    return vllm


def _iter_safetensors(checkpoint_dir: str) -> Iterator[tuple[str, Any]]:
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in checkpoint_dir={checkpoint_dir!r}")
    for file in files:
        yield from load_file(str(file)).items()


def _load_on_worker(worker: Any, checkpoint_dir: str) -> None:
    """Runs inside each vLLM worker (via collective_rpc): load the weights into its model."""
    worker.model_runner.model.load_weights(weights=_iter_safetensors(checkpoint_dir))


class VLLMEngine:
    """In-process vLLM. ``model`` is a hub id or a local folder (config + tokenizer + safetensors)."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_prefix_caching": True,
            **llm_kwargs,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.setdefault("logprobs_mode", "raw_logprobs")
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError:  # an older vLLM without logprobs_mode: its logprobs are raw already
            kwargs.pop("logprobs_mode")
            self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm

    def release(self, session_ids: Sequence[str]) -> None:
        """No-op: vLLM's automatic prefix caching manages the KV cache."""

    def load_weights(self, checkpoint_dir: str) -> None:
        """Load the safetensors of ``checkpoint_dir`` into the running engine and drop cached prefixes."""
        if not Path(checkpoint_dir).is_dir():
            raise FileNotFoundError(f"checkpoint_dir={checkpoint_dir!r} is not a folder")
        self.llm.collective_rpc(_load_on_worker, args=(checkpoint_dir,))
        self.llm.reset_prefix_cache()
        logger.info("vLLM weights reloaded from %s", checkpoint_dir)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        if not requests:
            return []
        prompts = [{"prompt_token_ids": [int(t) for t in r.prompt_ids]} for r in requests]
        per_prompt = [
            self._vllm.SamplingParams(
                n=1,
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                stop=list(params.stop_strings),
                include_stop_str_in_output=True,
                logprobs=0,
                seed=None if params.seed is None else session_seed(params.seed, r.session_id),
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, per_prompt, use_tqdm=False)
        return [_to_generation(out.outputs[0]) for out in outputs]


def _to_generation(completion: Any) -> Generation:
    ids = [int(t) for t in completion.token_ids]
    # completion.logprobs: one {token_id: Logprob} dict per sampled token (the sampled id is in it)
    values = [float(step[token].logprob) for token, step in zip(ids, completion.logprobs or [], strict=True)]
    finish: Literal["stop", "eos", "length"]
    if completion.finish_reason == "length":
        finish = "length"
    else:
        finish = "stop" if isinstance(completion.stop_reason, str) else "eos"
    return Generation(token_ids=ids, logprobs=values, finish_reason=finish, text=str(completion.text))

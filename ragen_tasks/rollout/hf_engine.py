"""The HF engine: our own lean, batched decode loop over a transformers causal LM (no ``generate``).

One ``generate`` call = one prefill of every request's NEW tokens + one decode step per new token
for all live rows. Per row the layout of the key/value axis is

    [pad .. | cached tokens (reused KV) | pad .. | new tokens | generated tokens ...]
     past region (length P)              new region (length S)   one column per step

so sessions with different cache lengths and different new suffixes share one batch. Pads are
masked out of attention; positions are given explicitly (row i's new tokens start at its cached
length), so a padded row computes exactly what it would compute alone. We build the 4-D boolean
attention mask ourselves and pass it as ``{"full_attention": mask}`` (the form transformers'
``generate`` passes), which skips transformers' per-step mask construction.

KV reuse: after a row finishes, its KV (prompt + response minus the last sampled token) is kept
under its ``session_id``; the next call prefills only the part of the request after the longest
common prefix with the cached ids (at least one token is always re-fed to get logits).

Sampling randomness is per session (``rollout/seeding.py``): the uniform number that picks row
``b``'s token at decode step ``t`` depends only on (call seed, row ``b``'s ``session_id``, ``t``),
so a session samples the same tokens whichever other sessions share the call, in whatever order
(the condition for a batch split over several engines to give one engine's trajectories). What a
batch can still change is float rounding: see "Batch composition" below.

Log-probs are ``log_softmax`` of the raw logits (temperature 1, before top-k / top-p): the
policy's own log-prob, which a plain forward pass on the full sequence reproduces.

Batch composition: the logits of a row are computed on a batch padded to the longest row (and
compacted as rows finish), so other rows change the shapes of the matrix products and the position
of the row's keys in the padded key axis, and the row's place in the batch can change how the
matrix kernel blocks rows. Vectorised sums then group the same terms differently,
which can move a logit in its last bits (float32: ~1e-7 relative). A token can only change if a
row's uniform number falls within that distance of a boundary of the cumulative distribution
(probability ~1e-7 per token); log-probs agree to ~1e-6, not bit for bit. See
``tests/rollout/test_sharding.py``.

Simplifications: attention implementations ``sdpa`` and ``eager`` only; models with sliding-window
layers are used only while the sequence fits in the window.
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from transformers import DynamicCache

from ragen_tasks.models import fast_qwen2
from ragen_tasks.models.fast_qwen2 import FastQwen2, KVCache
from ragen_tasks.rollout.engine import Generation, GenerationRequest, SamplingParams
from ragen_tasks.rollout.seeding import session_keys, uniforms

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "eos", "length"]


@dataclass
class _Session:
    ids: list[int]  # the token ids whose keys/values are cached
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (1, H_kv, len(ids), D)


@dataclass
class _Row:
    index: int  # position of the request in the call
    request: GenerationRequest
    reuse: int  # cached tokens reused
    tokens: list[int]
    logprobs: list[float]
    finish: FinishReason | None = None
    # this row's key columns: [reused_from, reused_from + reuse) hold its reused KV, [fed_from, ...)
    # its new tokens and then one column per decode step (set by _prefill)
    reused_from: int = 0
    fed_from: int = 0


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, a history extended by a turn: one C-level compare
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / nucleus top-p with -inf. logits: (B, V) float32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass BEFORE it already reaches top_p (the top token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFEngine:
    """Engine Protocol over a transformers causal LM with KV reuse across turns per session.

    ``model``/``tokenizer``: e.g. from ``ragen_tasks.models.load_policy``.
    ``seed``: seeds the engine's own generator of call seeds, used when ``SamplingParams.seed`` is
    None (a call with ``SamplingParams.seed`` set is reproducible on its own, session by session).
    ``reuse_cache``: keep each session's KV between calls (turn off to measure or to save memory).
    ``fast``: use our functional Qwen2 forward (``models/fast_qwen2.py``) when the model is a
    Qwen2 causal LM; False = always the transformers forward.
    ``eos_token_ids``: ids that end a response; default = the tokenizer's eos, ``<|im_end|>`` and
    the model's ``generation_config.eos_token_id``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        seed: int = 0,
        reuse_cache: bool = True,
        fast: bool = True,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        attn = getattr(model.config, "_attn_implementation", None)
        if attn not in ("sdpa", "eager"):
            raise ValueError(
                f"HFEngine supports attn_implementation 'sdpa' or 'eager', got {attn!r}; load the model with "
                "attn_implementation='sdpa' (load_policy does)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.reuse_cache = reuse_cache
        self._use_fast = fast and fast_qwen2.supports(model)
        self._fast_model: FastQwen2 | None = None
        self._attn = attn
        self._rng = random.Random(seed)
        self._sessions: dict[str, _Session] = {}
        self._eos = set(eos_token_ids) if eos_token_ids is not None else self._default_eos()
        self._token_text: list[str] | None = None  # id -> decoded text, for ASCII stop strings
        self._ending_cache: dict[tuple[str, ...], set[int]] = {}  # stop strings -> ids, see _ending_tokens
        self._layer_types = sorted(set(getattr(model.config, "layer_types", None) or ["full_attention"]))
        self._window = getattr(model.config, "sliding_window", None)
        # transformers >= 5.24 names the cache argument ``cache`` (``past_key_values`` is deprecated)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))

    # ------------------------------------------------------------------ public API
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        """One Generation per request, in order (see the module docstring for the layout)."""
        self._check(requests, params)
        if not requests:
            return []
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        device = self.model.device
        # (B, max_new_tokens) row b's uniform number for each decode step, from its session's own stream
        draws: torch.Tensor | None = None
        if params.temperature > 0:
            keys = session_keys(seed, [r.session_id for r in requests])
            draws = torch.from_numpy(uniforms(keys, params.max_new_tokens)).to(device)
        with torch.inference_mode():
            rows = self._prefill_rows(requests)
            # Qwen2 models run through our functional forward (weights fused afresh: they may have been
            # updated since the last call); anything else through the transformers forward.
            self._fast_model = FastQwen2(self.model) if self._use_fast else None
            cache, valid, pos, logits = self._prefill(rows, params.max_new_tokens)
            mask: torch.Tensor | None = valid if self._fast_model is None else None  # (B, K) True = real token
            # batch line -> its row. A finished row stays in the batch (its samples ignored) until a
            # quarter of the lines are finished: compacting copies every kept row's KV, so it is batched.
            lines = list(rows)
            live = len(lines)
            may_end = self._ending_tokens(params.stop_strings)  # None: any token may complete a stop string
            for step in range(params.max_new_tokens):
                tok, lp = self._sample(logits, params, None if draws is None else draws[:, step])  # (B,), (B,)
                tok_list, lp_list = tok.tolist(), lp.tolist()
                last_step = step == params.max_new_tokens - 1
                for b, (row, t, logprob) in enumerate(zip(lines, tok_list, lp_list, strict=True)):
                    if row.finish is not None:
                        continue
                    row.tokens.append(t)
                    row.logprobs.append(logprob)
                    # only a token that can end a row is checked in full
                    if last_step or may_end is None or t in may_end:
                        row.finish = self._finish_reason(row, params, last_step=last_step)
                        if row.finish is not None:
                            self._store(row, cache, b)
                            live -= 1
                if live == 0:
                    break
                if live <= 3 * len(lines) // 4:
                    keep = [b for b, row in enumerate(lines) if row.finish is None]
                    idx = torch.tensor(keep, device=device)
                    cache = self._select(cache, idx)
                    pos, tok = pos[idx], tok[idx]
                    draws = draws[idx] if draws is not None else None  # a row keeps its own numbers
                    mask = mask[idx] if mask is not None else None
                    lines = [lines[b] for b in keep]
                # one decode step for the live rows: the new token attends to every valid column (the
                # fast forward's cache keeps the key mask itself: no per-step mask)
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, K+1) True = real token
                pos = pos + 1  # (B,) position of the fed token
                logits = self._forward(
                    tok[:, None], pos[:, None], mask[:, None, None, :] if mask is not None else None, cache
                )
        texts = self._decode([row.tokens for row in rows])
        return [self._to_generation(row, text) for row, text in zip(rows, texts, strict=True)]

    def release(self, session_ids: Sequence[str]) -> None:
        """Forget the cached KV of these sessions (unknown ids are ignored)."""
        for sid in session_ids:
            self._sessions.pop(sid, None)

    @property
    def cached_sessions(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ steps
    def _check(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        if params.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens}; must be >= 1")
        if params.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={params.temperature}; must be >= 0 (0 = greedy)")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={params.top_p}; must be in (0, 1]")
        if params.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={params.top_k}; must be >= 0 (0 = off)")
        seen: set[str] = set()
        for req in requests:
            if len(req.prompt_ids) == 0:
                raise ValueError(f"request {req.session_id!r} has empty prompt_ids; give at least one token")
            if req.session_id in seen:
                raise ValueError(f"session_id {req.session_id!r} appears twice in one generate call")
            seen.add(req.session_id)
            total = len(req.prompt_ids) + params.max_new_tokens
            if total > self.max_positions:
                raise ValueError(
                    f"request {req.session_id!r}: prompt of {len(req.prompt_ids)} tokens + max_new_tokens="
                    f"{params.max_new_tokens} exceeds the model context of {self.max_positions}; shorten the "
                    "episode (agent.max_context_tokens / max_turns) or lower max_new_tokens"
                )

    def _prefill_rows(self, requests: Sequence[GenerationRequest]) -> list[_Row]:
        rows = []
        for i, req in enumerate(requests):
            reuse = 0
            sess = self._sessions.get(req.session_id)
            if sess is not None and self.reuse_cache:
                # at least one token must be fed to get next-token logits
                reuse = min(_lcp(sess.ids, req.prompt_ids), len(req.prompt_ids) - 1)
            if reuse == 0:
                self._sessions.pop(req.session_id, None)
            rows.append(_Row(index=i, request=req, reuse=reuse, tokens=[], logprobs=[]))
        return rows

    def _prefill(self, rows: list[_Row], max_new_tokens: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed every row's new tokens on top of its reused KV. Returns (cache, mask (B, P+S), pos (B,), logits (B, V))."""
        device = self.model.device
        n_rows = len(rows)
        past = max(r.reuse for r in rows)  # P
        new = max(len(r.request.prompt_ids) - r.reuse for r in rows)  # S
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        id_rows, pos_rows, valid_rows = [], [], []
        for r in rows:
            suffix = list(r.request.prompt_ids[r.reuse :])
            pad = new - len(suffix)
            r.reused_from, r.fed_from = past - r.reuse, past + pad
            id_rows.append([pad_id] * pad + suffix)
            pos_rows.append([0] * pad + list(range(r.reuse, r.reuse + len(suffix))))
            valid_rows.append([False] * (past - r.reuse) + [True] * r.reuse + [False] * pad + [True] * len(suffix))
        ids = torch.tensor(id_rows, dtype=torch.long)  # (B, S) new tokens, left-padded
        pos = torch.tensor(pos_rows, dtype=torch.long)  # (B, S) position of each fed token
        valid = torch.tensor(valid_rows, dtype=torch.bool)  # (B, P+S) True = real token
        past_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if past:
            template = next(self._sessions[r.request.session_id].kv for r in rows if r.reuse)
            for layer in range(len(template)):
                k0, v0 = template[layer]
                keys = k0.new_zeros((n_rows, k0.shape[1], past, k0.shape[3]))  # (B, H_kv, P, D)
                values = v0.new_zeros((n_rows, v0.shape[1], past, v0.shape[3]))
                for b, r in enumerate(rows):
                    if r.reuse:
                        k, v = self._sessions[r.request.session_id].kv[layer]
                        keys[b, :, past - r.reuse :] = k[0, :, : r.reuse]
                        values[b, :, past - r.reuse :] = v[0, :, : r.reuse]
                past_kv.append((keys, values))
        # (B, 1, S, P+S): query q sees valid keys in the past region and valid new keys up to itself;
        # a pad query also sees itself so that no softmax row is empty (its output is never used).
        causal = torch.ones((new, new), dtype=torch.bool).tril()  # (S, S)
        mask4 = torch.cat([valid[:, None, :past].expand(n_rows, new, past), valid[:, None, past:] & causal], dim=2)
        mask4 = mask4 | torch.cat([torch.zeros((new, past), dtype=torch.bool), torch.eye(new, dtype=torch.bool)], 1)
        cache = self._new_cache(past_kv, capacity=past + new + max_new_tokens)
        logits = self._forward(ids.to(device), pos.to(device), mask4[:, None].to(device), cache)
        return cache, valid.to(device), pos[:, -1].to(device), logits

    # ------------------------------------------------------------------ cache: fast path or transformers
    def _new_cache(self, past_kv: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> Any:
        """A cache holding past_kv (per layer (B, H_kv, P, D) keys, values) with room for ``capacity`` columns."""
        if self._fast_model is not None:
            return KVCache(past_kv, capacity)
        cache = DynamicCache()
        for layer, (keys, values) in enumerate(past_kv):
            cache.update(keys, values, layer)
        return cache

    def _select(self, cache: Any, idx: torch.Tensor) -> Any:
        """Keep only batch rows idx (finished rows stop costing compute)."""
        if self._fast_model is not None:
            cache.select(idx)
            return cache
        cache.batch_select_indices(idx)
        return cache

    def _layer_kv(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values), each (B, H_kv, K, D)."""
        if self._fast_model is not None:
            return cast(list[tuple[torch.Tensor, torch.Tensor]], cache.layers())
        return [(layer.keys, layer.values) for layer in cast(list[Any], cache.layers)]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask4: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """Run the model on ids (B, Q) at positions pos (B, Q) with mask (B, 1, Q, K); logits of the last query (B, V).
        mask4 None (fast forward only): a decode step, the new token attends to every real key and itself."""
        if self._fast_model is not None:
            return self._fast_model.forward(ids, pos, mask4, cache)
        if mask4 is None:
            raise ValueError("the transformers forward needs an attention mask on every call")
        if self._window is not None and "sliding_attention" in self._layer_types and mask4.shape[-1] > self._window:
            raise ValueError(f"sequence of {mask4.shape[-1]} tokens exceeds the model's sliding window {self._window}")
        if self._attn == "eager":
            mask: torch.Tensor = torch.zeros(mask4.shape, dtype=self.model.dtype, device=mask4.device)
            mask = mask.masked_fill(~mask4, torch.finfo(self.model.dtype).min)
        else:
            mask = mask4
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=dict.fromkeys(self._layer_types, mask),
            **{self._cache_kwarg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()  # (B, V)
        return logits

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, u01: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row and its log-prob at temperature 1. logits: (B, V) float32; u01: (B,) float32
        in [0, 1), the uniform number that picks row b's token (None when greedy)."""
        probs = torch.softmax(logits, dim=-1)  # (B, V) the policy's own distribution (temperature 1)
        if params.temperature == 0 or u01 is None:
            tok = logits.argmax(dim=-1)
        else:
            if params.temperature == 1 and params.top_k == 0 and params.top_p == 1:
                probs_t = probs  # plain sampling draws from the policy's own distribution
            else:
                probs_t = filter_logits(logits / params.temperature, top_k=params.top_k, top_p=params.top_p).softmax(-1)
            # inverse-CDF sampling: one uniform number per row (torch.multinomial draws far more on CPU).
            # u is scaled by the row total, so it never falls past the last non-zero probability.
            cdf = probs_t.cumsum(dim=-1)  # (B, V)
            u = u01[:, None] * cdf[:, -1:]  # (B, 1)
            tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)  # (B,)
        # log of the chosen probability: equal to log_softmax's value to float rounding (~1e-7) while the
        # probability is a normal float; below that (log-prob < -87, in practice never sampled) the rows
        # take the exact log_softmax instead.
        chosen = probs.gather(1, tok[:, None]).squeeze(1)  # (B,)
        logprob = chosen.log()
        tiny = chosen < torch.finfo(chosen.dtype).tiny
        if bool(tiny.any()):
            exact = torch.log_softmax(logits[tiny], dim=-1).gather(1, tok[tiny][:, None]).squeeze(1)
            logprob = logprob.masked_scatter(tiny, exact)
        return tok, logprob

    def _ending_tokens(self, stops: tuple[str, ...]) -> set[int] | None:
        """Ids whose sampling can end a row: eos ids and, for ASCII stop strings, every token whose
        text holds a stop string's last character (a stop string is completed by the newest token).
        None when any token may end one (non-ASCII stop strings: per-token text is not exact)."""
        if not stops:
            return self._eos
        if not all(s.isascii() for s in stops):
            return None
        if stops not in self._ending_cache:
            last_chars = {s[-1] for s in stops}
            table = self._token_table()
            self._ending_cache[stops] = self._eos | {i for i, text in enumerate(table) if last_chars & set(text)}
        return self._ending_cache[stops]

    def _finish_reason(self, row: _Row, params: SamplingParams, *, last_step: bool) -> FinishReason | None:
        if row.tokens[-1] in self._eos:
            return "eos"
        if params.stop_strings and self._hits_stop(row.tokens, params.stop_strings):
            return "stop"
        return "length" if last_step else None

    def _hits_stop(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        """True once the decoded tail ending at the newest token holds a stop string.

        Checked after every token, so a stop string can only be completed by the newest token:
        the tail only needs as many tokens as the longest stop string has bytes (+1).
        """
        window = tokens[-max(len(s.encode()) for s in stops) - 1 :]
        if all(s.isascii() for s in stops):  # per-token text is exact for ASCII (no split characters)
            table = self._token_table()
            if not any(s[-1] in table[tokens[-1]] for s in stops):  # cheap filter
                return False
            tail = "".join(table[t] for t in window)
        else:
            tail = self.tokenizer.decode(window)
        return any(s in tail for s in stops)

    def _token_table(self) -> list[str]:
        if self._token_text is None:
            size = max(len(self.tokenizer), int(self.model.config.vocab_size))
            self._token_text = self.tokenizer.batch_decode([[i] for i in range(size)])
        return self._token_text

    def _store(self, row: _Row, cache: Any, b: int) -> None:
        """Keep row b's KV (its valid columns) under its session id: prompt + response[:-1]."""
        if not self.reuse_cache:
            return

        def own_columns(t: torch.Tensor) -> torch.Tensor:  # (B, H_kv, K, D) -> (1, H_kv, L, D), a copy
            fed = t[b : b + 1, :, row.fed_from :]  # new tokens + decoded tokens, up to the filled length
            if row.reuse == 0:
                return fed.clone()
            return torch.cat([t[b : b + 1, :, row.reused_from : row.reused_from + row.reuse], fed], dim=2)

        kv = [(own_columns(k), own_columns(v)) for k, v in self._layer_kv(cache)]
        ids = list(row.request.prompt_ids) + row.tokens[:-1]
        if kv and kv[0][0].shape[2] != len(ids):
            raise RuntimeError(f"cache bookkeeping error: {kv[0][0].shape[2]} cached columns for {len(ids)} ids")
        self._sessions[row.request.session_id] = _Session(ids=ids, kv=kv)

    def _decode(self, sequences: list[list[int]]) -> list[str]:
        """Texts of the sampled ids (special tokens skipped): one batched call into a fast tokenizer's
        Rust backend when decoding needs no Python-side clean-up, else ``tokenizer.decode`` per row."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return list(backend.decode_batch(sequences, skip_special_tokens=True))
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]

    def _to_generation(self, row: _Row, text: str) -> Generation:
        if row.finish is None:
            raise RuntimeError(f"row {row.index} ended without a finish reason")
        return Generation(token_ids=row.tokens, logprobs=row.logprobs, finish_reason=row.finish, text=text)

    def _default_eos(self) -> set[int]:
        eos: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            eos.add(im_end)
        cfg = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(cfg, int):
            eos.add(cfg)
        elif cfg is not None:
            eos.update(int(i) for i in cfg)
        return eos

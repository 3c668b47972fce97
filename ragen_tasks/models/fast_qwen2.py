"""A lean functional forward pass for Qwen2-architecture models, used by HFEngine's decode loop.

Same math as ``transformers``' ``Qwen2ForCausalLM`` (RMSNorm in float32, rotary embeddings from
the model's own ``inv_freq``, grouped-query attention, SwiGLU MLP) with the per-call machinery
removed: q/k/v and gate/up projections are fused into one matrix product each, the RMSNorm weights
and the attention scale are folded into those matrices, rotary tables are built once per call, no
mask construction, no output objects, no hooks. The prefill attends through
``scaled_dot_product_attention``, except in the last layer, where past the keys and values only the
last query is computed (only its logits are used); a decode step (one query per row) attends through
two batched matrix products, cheaper on CPU than SDPA's flash kernel at Q = 1, with
the padding mask kept by the cache (``KVCache.key_bias``), not rebuilt per step. On a ~100k-parameter
model on CPU much of the per-token cost is Python and dispatch overhead, which this removes. The
results equal the transformers forward up to float rounding (the engine tests hold log-probs to 1e-4).

Weights are fused at construction; build a new ``FastQwen2`` after every weight update (HFEngine
does so on every ``generate`` call, which costs one copy of the weights).

Simplifications: only default rotary scaling, no sliding window, ``silu`` activation; anything
else is rejected by ``supports`` and the engine falls back to the transformers forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class KVCache:
    """Preallocated keys/values for ``length`` filled columns of ``capacity``, per layer: keys stored
    TRANSPOSED, (B, H_kv, D, capacity), so a decode step's query-key product reads them as a plain
    (D, K) matrix per row and head (cheaper than a transposed operand on CPU); values (B, H_kv,
    capacity, D). ``write`` and ``layers`` hand out keys as (B, H_kv, K, D) views.

    All rows advance together (padding is the mask's job), so one ``length`` serves the batch.
    ``key_bias`` (B, H_kv, 1, capacity): the additive attention mask of every column, 0 = a real key,
    -inf = a pad; set from the mask of the call that fed a batch's first tokens (``set_key_mask``),
    and 0 beyond it, so decode steps (whose new key is always real) need no mask at all.
    """

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> None:
        self.length = past[0][0].shape[2] if past else 0
        self.capacity = capacity
        self.keys_t: list[torch.Tensor] = []  # per layer (B, H_kv, D, capacity)
        self.values: list[torch.Tensor] = []  # per layer (B, H_kv, capacity, D)
        self.key_bias: torch.Tensor | None = None
        for k, v in past:
            self._alloc(k, v)
            self.keys_t[-1][..., : self.length] = k.transpose(2, 3)
            self.values[-1][:, :, : self.length] = v

    def _alloc(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, _, d = k.shape
        self.keys_t.append(k.new_empty((b, h, d, self.capacity)))
        self.values.append(v.new_empty((b, h, self.capacity, v.shape[3])))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, Q, D) at [length, length + Q); return the filled TRANSPOSED keys
        (B, H_kv, D, length + Q) and values (B, H_kv, length + Q, D), views of the cache."""
        if layer == len(self.keys_t):
            self._alloc(k, v)
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end} columns)")
        self.keys_t[layer][..., self.length : end] = k.transpose(2, 3)
        self.values[layer][:, :, self.length : end] = v
        return self.keys_t[layer][..., :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def set_key_mask(self, valid: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> None:
        """valid: (B, K) bool, True = column k holds a real key; columns from K on are taken as real."""
        b, k = valid.shape
        bias = torch.zeros((b, kv_heads, 1, self.capacity), dtype=dtype, device=valid.device)
        bias[:, :, 0, :k].masked_fill_(~valid[:, None], float("-inf"))
        self.key_bias = bias

    def select(self, idx: torch.Tensor) -> None:
        """Keep batch rows idx only (copies the filled columns; the rest of the capacity stays unset)."""
        n = self.length
        self.keys_t = [self._take(k, idx, (..., slice(0, n))) for k in self.keys_t]
        self.values = [self._take(v, idx, (slice(None), slice(None), slice(0, n))) for v in self.values]
        if self.key_bias is not None:
            self.key_bias = self.key_bias[idx]

    @staticmethod
    def _take(t: torch.Tensor, idx: torch.Tensor, filled: tuple[Any, ...]) -> torch.Tensor:
        """Rows idx of t into a new buffer of t's shape; only the ``filled`` part is copied."""
        out = t.new_empty((len(idx), *t.shape[1:]))
        torch.index_select(t[filled], 0, idx, out=out[filled])
        return out

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer filled (keys, values), each a (B, H_kv, length, D) view."""
        n = self.length
        return [(k[..., :n].transpose(2, 3), v[:, :, :n]) for k, v in zip(self.keys_t, self.values, strict=True)]


def supports(model: Any) -> bool:
    """True when ``model`` is a Qwen2 causal LM this forward reproduces exactly."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return (
        type(model).__name__ == "Qwen2ForCausalLM"
        and not getattr(cfg, "use_sliding_window", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and rope.get("rope_type", "default") == "default"
        and float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) == 1.0
    )


class FastQwen2:
    """Functional forward over a ``Qwen2ForCausalLM``'s weights (fused copies, no autograd)."""

    def __init__(self, model: Any) -> None:
        if not supports(model):
            raise ValueError(f"FastQwen2 does not support {type(model).__name__} with this config; use the HF forward")
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        inner = model.model
        self.embed = inner.embed_tokens.weight  # (V, C)
        self.inv_freq = inner.rotary_emb.inv_freq  # (D/2,) float32
        self._cos = self._sin = torch.empty(0)  # (P, D) rotary tables for positions [0, P), see _rope
        # Folded into the matrices (same math, other rounding): each RMSNorm's weight into the
        # projection that follows it (W @ (w * x) == (W * w) @ x), and the attention scale
        # D^-1/2 into the query rows of qkv (rotary embedding is linear, so it commutes).
        scale = self.head_dim**-0.5
        q_rows = self.heads * self.head_dim
        with torch.no_grad():
            self.lm_head = model.lm_head.weight * inner.norm.weight  # (V, C)
            self.layers = []
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])  # (Q+2K, C)
                qkv_b = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])  # (Q+2K,)
                qkv_w[:q_rows] *= scale
                qkv_b[:q_rows] *= scale
                self.layers.append(
                    {
                        "qkv_w": qkv_w * layer.input_layernorm.weight,
                        "qkv_b": qkv_b,
                        "o_w": att.o_proj.weight,
                        "gate_up_w": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # (2I, C)
                        * layer.post_attention_layernorm.weight,
                        "down_w": mlp.down_proj.weight,
                    }
                )

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        """RMS normalisation without the weight (folded into the next matrix), in float32."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], None, self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and SIGNED sin for positions pos (B, Q), each (B, Q, 1, D), looked up in tables built once.

        cos/sin values are those transformers computes (float32 ``pos * inv_freq``, duplicated halves).
        The sin table's first half is negated so that rotate_half(x) * sin == roll(x, D/2) * signed_sin.
        ``max_pos``: an upper bound of pos + 1 (the tables grow to it when needed).
        """
        if self._cos.shape[0] < max_pos or self._cos.dtype != dtype:
            freqs = torch.arange(max_pos, device=self.inv_freq.device).float()[:, None] * self.inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
            half = emb.shape[-1] // 2
            sign = torch.ones_like(emb)
            sign[:, :half] = -1.0
            self._cos, self._sin = emb.cos().to(dtype), (emb.sin() * sign).to(dtype)
        return self._cos[pos][:, :, None], self._sin[pos][:, :, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * sign."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    @staticmethod
    def _decode_attention(
        q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ONE query per row, as two batched matrix products (on CPU much cheaper than
        scaled_dot_product_attention's flash kernel at Q = 1).

        q: (B, Hq, 1, D) already scaled by D^-1/2; keys_t: (B, Hkv, D, K), values: (B, Hkv, K, D) (views of the cache);
        bias: (B * Hkv, 1, K) additive mask (a view of ``KVCache.key_bias``), 0 = may attend, -inf = pad.
        Returns (B, 1, Hq * D).
        Query heads are grouped as transformers groups them: head h reads kv head h // (Hq / Hkv).
        """
        b, hq, _, d = q.shape
        hk, k_len = keys_t.shape[1], keys_t.shape[3]
        qg = q.reshape(b * hk, hq // hk, d)  # (B Hkv, G, D) the G query heads sharing a kv head
        scores = torch.baddbmm(bias, qg, keys_t.reshape(b * hk, d, k_len))  # (B Hkv, G, K)
        out = torch.bmm(scores.softmax(dim=-1), values.reshape(b * hk, k_len, d))  # (B Hkv, G, D)
        return out.view(b, 1, hq * d)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) of the LAST query.

        ids, pos: (B, Q) token ids and their positions (every position < ``cache.capacity``, as in
        HFEngine's layout); the new keys/values are written into ``cache``.
        mask: (B, 1, Q, K) bool, True = may attend, K = cache.length + Q, given for the call that feeds
        a batch's first tokens (its last query's row becomes ``cache.key_bias``); None for a decode
        step, whose query attends to every real key so far and itself.
        """
        b, q = ids.shape
        d, hq, hk = self.head_dim, self.heads, self.kv_heads
        x = F.embedding(ids, self.embed)  # (B, Q, C)
        cos, sin = self._rope(pos, x.dtype, cache.capacity)  # (B, Q, 1, D)
        if mask is not None:
            cache.set_key_mask(mask[:, 0, -1], hk, x.dtype)  # the last query is real and sees every real key
        key_bias = cache.key_bias
        if key_bias is None or (mask is None and q > 1):
            raise ValueError(
                "FastQwen2.forward: mask=None is for one-token decode steps on a cache fed by an earlier masked call"
            )
        last_bias = key_bias.view(b * hk, 1, cache.capacity)[:, :, : cache.length + q]  # (B Hkv, 1, K) view
        # (B, 1, Q, K) additive form of the mask for SDPA, built once: SDPA converts a bool mask on every call
        full_bias = (
            None
            if mask is None or q == 1
            else torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        )
        for i, w in enumerate(self.layers):
            h = self._rms(x)
            qkv = F.linear(h, w["qkv_w"], w["qkv_b"])  # (B, Q, (Hq + 2 Hkv) D)
            qk = self._rotate(qkv[..., : (hq + hk) * d].view(b, q, hq + hk, d), cos, sin)  # (B, Q, Hq + Hkv, D)
            qs, ks = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)  # (B, Hq, Q, D), (B, Hkv, Q, D)
            vs = qkv[..., (hq + hk) * d :].view(b, q, hk, d).transpose(1, 2)  # (B, Hkv, Q, D)
            ks_t, vs = cache.write(i, ks, vs)  # (B, Hkv, D, K), (B, Hkv, K, D)
            if x.shape[1] > 1 and i == len(self.layers) - 1:
                # past this layer's keys/values only the last query's output is used (logits of the
                # last token): the rest of the last layer runs for that query alone
                x, qs = x[:, -1:], qs[:, :, -1:]
            if x.shape[1] == 1:  # queries come pre-scaled by D^-1/2 (folded into qkv_w)
                att = self._decode_attention(qs, ks_t, vs, last_bias)  # (B, 1, Hq D)
            else:
                # contiguous keys: with a strided last dimension SDPA leaves its flash kernel
                keys = ks_t.transpose(2, 3).contiguous()  # (B, Hkv, K, D)
                att = F.scaled_dot_product_attention(qs, keys, vs, attn_mask=full_bias, scale=1.0, enable_gqa=hq != hk)
                att = att.transpose(1, 2).reshape(b, q, hq * d)  # (B, Q, Hq D)
            x = x + F.linear(att, w["o_w"])
            h = self._rms(x)
            gate, up = F.linear(h, w["gate_up_w"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down_w"])
        cache.advance(q)
        last = self._rms(x[:, -1])  # (B, C)
        return F.linear(last, self.lm_head).float()  # (B, V)

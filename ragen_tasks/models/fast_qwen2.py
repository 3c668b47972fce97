"""A lean functional forward pass for Qwen2-architecture models, used by HFEngine's decode loop.

Same math as ``transformers``' ``Qwen2ForCausalLM`` (RMSNorm in float32, rotary embeddings from
the model's own ``inv_freq``, grouped-query attention, SwiGLU MLP) with the per-call machinery
removed: q/k/v and gate/up projections are fused into one matrix product each, the RMSNorm weights
and the attention scale are folded into those matrices, rotary tables are built once per call, no
mask construction, no output objects, no hooks. The prefill attends through
``scaled_dot_product_attention``; a decode step (one query per row) through two batched matrix
products, which on CPU cost well under half of SDPA's flash kernel at Q = 1. On a ~100k-parameter
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
    """Preallocated keys/values: per layer (B, H_kv, capacity, D); columns [0, length) are filled.

    All rows advance together (padding is the mask's job), so one ``length`` serves the batch.
    """

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> None:
        self.length = past[0][0].shape[2] if past else 0
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for k, v in past:
            self._alloc(k, v)
            self.keys[-1][:, :, : self.length] = k
            self.values[-1][:, :, : self.length] = v

    def _alloc(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, _, d = k.shape
        self.keys.append(k.new_empty((b, h, self.capacity, d)))
        self.values.append(v.new_empty((b, h, self.capacity, v.shape[3])))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, Q, D) at [length, length + Q); return the filled views (B, H_kv, length + Q, D)."""
        if layer == len(self.keys):
            self._alloc(k, v)
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end} columns)")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def select(self, idx: torch.Tensor) -> None:
        """Keep batch rows idx only (copies the filled columns; the rest of the capacity stays unset)."""
        self.keys = [self._take(k, idx) for k in self.keys]
        self.values = [self._take(v, idx) for v in self.values]

    def _take(self, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((len(idx), *t.shape[1:]))  # (B', H_kv, capacity, D)
        torch.index_select(t[:, :, : self.length], 0, idx, out=out[:, :, : self.length])
        return out

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer filled (keys, values), each (B, H_kv, length, D)."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values, strict=True)]


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
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ONE query per row, as two batched matrix products (on CPU much cheaper than
        scaled_dot_product_attention's flash kernel at Q = 1).

        q: (B, Hq, 1, D) already scaled by D^-1/2; keys, values: (B, Hkv, K, D) (views of the cache);
        bias: (B * Hkv, 1, K) additive mask, 0 = may attend, -inf = pad. Returns (B, 1, Hq * D).
        Query heads are grouped as transformers groups them: head h reads kv head h // (Hq / Hkv).
        """
        b, hq, _, d = q.shape
        hk, k_len = keys.shape[1], keys.shape[2]
        qg = q.reshape(b * hk, hq // hk, d)  # (B Hkv, G, D) the G query heads sharing a kv head
        scores = torch.baddbmm(bias, qg, keys.reshape(b * hk, k_len, d).transpose(1, 2))  # (B Hkv, G, K)
        out = torch.bmm(scores.softmax(dim=-1), values.reshape(b * hk, k_len, d))  # (B Hkv, G, D)
        return out.view(b, 1, hq * d)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) of the LAST query.

        ids, pos: (B, Q) token ids and their positions (every position < ``cache.capacity``, as in
        HFEngine's layout); mask: (B, 1, Q, K) bool, True = may attend, K = cache.length + Q; the
        new keys/values are written into ``cache``.
        """
        b, q = ids.shape
        d, hq, hk = self.head_dim, self.heads, self.kv_heads
        x = F.embedding(ids, self.embed)  # (B, Q, C)
        cos, sin = self._rope(pos, x.dtype, cache.capacity)  # (B, Q, 1, D)
        bias = None
        if q == 1:  # decode step: (B Hkv, 1, K) additive mask, shared by the layers
            bias = torch.zeros(mask.shape[0], mask.shape[-1], dtype=x.dtype, device=x.device)
            bias = bias.masked_fill_(~mask.view(mask.shape[0], -1), float("-inf")).repeat_interleave(hk, dim=0)[:, None]
        for i, w in enumerate(self.layers):
            h = self._rms(x)
            qkv = F.linear(h, w["qkv_w"], w["qkv_b"])  # (B, Q, (Hq + 2 Hkv) D)
            qk = self._rotate(qkv[..., : (hq + hk) * d].view(b, q, hq + hk, d), cos, sin)  # (B, Q, Hq + Hkv, D)
            qs, ks = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)  # (B, Hq, Q, D), (B, Hkv, Q, D)
            vs = qkv[..., (hq + hk) * d :].view(b, q, hk, d).transpose(1, 2)  # (B, Hkv, Q, D)
            ks, vs = cache.write(i, ks, vs)  # (B, Hkv, K, D)
            if bias is not None:  # queries come pre-scaled by D^-1/2 (folded into qkv_w)
                att = self._decode_attention(qs, ks, vs, bias)  # (B, 1, Hq D)
            else:
                att = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=1.0, enable_gqa=hq != hk)
                att = att.transpose(1, 2).reshape(b, q, hq * d)  # (B, Q, Hq D)
            x = x + F.linear(att, w["o_w"])
            h = self._rms(x)
            gate, up = F.linear(h, w["gate_up_w"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down_w"])
        cache.advance(q)
        last = self._rms(x[:, -1])  # (B, C)
        return F.linear(last, self.lm_head).float()  # (B, V)

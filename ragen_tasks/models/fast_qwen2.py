"""A lean functional forward pass for Qwen2-architecture models, used by HFEngine's decode loop.

Same math as ``transformers``' ``Qwen2ForCausalLM`` (RMSNorm in float32, rotary embeddings from
the model's own ``inv_freq``, grouped-query attention through ``scaled_dot_product_attention(enable_gqa=True)``,
SwiGLU MLP) with the per-call machinery removed: q/k/v and gate/up projections are fused into one
matrix product each, no mask construction, no output objects, no hooks. On a ~100k-parameter model
on CPU much of the per-token cost is Python overhead, which this removes.

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
        """Keep batch rows idx only."""
        self.keys = [k[idx] for k in self.keys]
        self.values = [v[idx] for v in self.values]

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
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight  # (V, C)
        self.inv_freq = inner.rotary_emb.inv_freq  # (D/2,) float32
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                self.layers.append(
                    {
                        "ln1": layer.input_layernorm.weight,
                        "ln2": layer.post_attention_layernorm.weight,
                        "qkv_w": torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),  # (Q+2K, C)
                        "qkv_b": torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]),
                        "o_w": att.o_proj.weight,
                        "gate_up_w": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),  # (2I, C)
                        "down_w": mlp.down_proj.weight,
                    }
                )

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions pos (B, Q): each (B, 1, Q, D), as transformers computes them."""
        freqs = pos[..., None].float() * self.inv_freq.float()  # (B, Q, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, Q, D)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) of the LAST query.

        ids, pos: (B, Q) token ids and their positions; mask: (B, 1, Q, K) bool, True = may attend,
        K = cache.length + Q; the new keys/values are written into ``cache``.
        """
        b, q = ids.shape
        d, hq, hk = self.head_dim, self.heads, self.kv_heads
        x = F.embedding(ids, self.embed)  # (B, Q, C)
        cos, sin = self._rope(pos, x.dtype)
        for i, w in enumerate(self.layers):
            h = self._rms(x, w["ln1"])
            qkv = F.linear(h, w["qkv_w"], w["qkv_b"])  # (B, Q, (Hq + 2 Hkv) D)
            qs, ks, vs = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d], qkv[..., (hq + hk) * d :]
            qs = self._rotate(qs.view(b, q, hq, d).transpose(1, 2), cos, sin)  # (B, Hq, Q, D)
            ks = self._rotate(ks.view(b, q, hk, d).transpose(1, 2), cos, sin)  # (B, Hkv, Q, D)
            vs = vs.view(b, q, hk, d).transpose(1, 2)
            ks, vs = cache.write(i, ks, vs)  # (B, Hkv, K, D)
            att = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=d**-0.5, enable_gqa=hq != hk)
            att = att.transpose(1, 2).reshape(b, q, hq * d)  # (B, Q, Hq D)
            x = x + F.linear(att, w["o_w"])
            h = self._rms(x, w["ln2"])
            gate, up = F.linear(h, w["gate_up_w"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down_w"])
        cache.advance(q)
        last = self._rms(x[:, -1], self.norm)  # (B, C)
        return F.linear(last, self.lm_head).float()  # (B, V)

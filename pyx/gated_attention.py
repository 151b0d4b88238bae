"""Qwen3-Next's (and Qwen3.5's) full attention: the Qwen3 attention (per-head q/k RMSNorm, RoPE on
a part of each head, paged K/V) with an output gate: q_proj yields, per head, the head's query and
then its gate, and the attention output is multiplied by sigmoid(gate) before o_proj.

Like pyx/layers.pyx, no device code: backend ops and the array API NumPy and CuPy share.
"""
from __future__ import annotations

import numpy as np

from pyx.gated_delta_net import as_float32, sigmoid, store


class GatedAttention:
    def __init__(self, backend, qkv_weight, qkv_bias, o_weight, o_bias, q_norm, k_norm,
                 cos_sin_cache, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 k_scale=None, v_scale=None):
        """qkv_weight: q_proj (2 * Hq * D rows, each head's query then its gate), k_proj and
        v_proj stacked; q_norm, k_norm (D,): the per-head RMSNorm weights; k_scale, v_scale
        (Hkv,): the FP8 KV cache's scales (None: 1.0)."""
        self.backend, self.xp = backend, backend.xp
        self.qkv_weight, self.qkv_bias = qkv_weight, qkv_bias
        self.o_weight, self.o_bias = o_weight, o_bias
        self.q_norm, self.k_norm = q_norm, k_norm
        self.cos_sin_cache = cos_sin_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.eps = eps
        self.scale = head_dim ** -0.5
        ones = np.ones(num_kv_heads, np.float32)
        self.k_scale = ones if k_scale is None else k_scale
        self.v_scale = ones if v_scale is None else v_scale

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        """x (T, H) -> out (T, H)."""
        b, xp = self.backend, self.xp
        T = x.shape[0]
        Hq, Hkv, D, qs, kvs = (self.num_heads, self.num_kv_heads, self.head_dim, self.q_size,
                               self.kv_size)
        qkv = ws.get("qkv", T, 2 * qs + 2 * kvs)
        b.linear(x, self.qkv_weight, self.qkv_bias, qkv)
        query_gate = qkv[:, :2 * qs].reshape(T, Hq, 2 * D)
        raw_q = ws.get("raw_q", T, qs)
        raw_k = ws.get("raw_k", T, kvs)
        gate = ws.get("attn_gate", T, qs)
        xp.copyto(raw_q.reshape(T, Hq, D), query_gate[:, :, :D])
        xp.copyto(gate.reshape(T, Hq, D), query_gate[:, :, D:])
        xp.copyto(raw_k, qkv[:, 2 * qs:2 * qs + kvs])
        q = ws.get("q", T, qs)
        k = ws.get("k", T, kvs)
        v = ws.get("v", T, kvs)
        xp.copyto(v, qkv[:, 2 * qs + kvs:])
        b.rms_norm(raw_q.reshape(T * Hq, D), self.q_norm, self.eps, q.reshape(T * Hq, D))
        b.rms_norm(raw_k.reshape(T * Hkv, D), self.k_norm, self.eps, k.reshape(T * Hkv, D))
        b.rotary_embedding(batch.positions, q, k, self.cos_sin_cache, D, True)
        k3, v3 = k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        attn = ws.get("attn", T, qs)
        scales = (self.k_scale, self.v_scale) if k_cache.dtype.itemsize == 1 else ()
        b.reshape_and_cache(k3, v3, k_cache, v_cache, batch.slot_mapping, *scales)
        b.paged_attention(attn.reshape(T, Hq, D), q.reshape(T, Hq, D), k_cache, v_cache,
                          batch.block_tables, batch.seq_lens, batch.query_start_loc, self.scale,
                          0, *scales)
        store(attn, as_float32(attn, xp) * sigmoid(as_float32(gate, xp), xp), xp)
        b.linear(attn, self.o_weight, self.o_bias, out)

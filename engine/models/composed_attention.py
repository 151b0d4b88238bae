"""Attention written over the backend's ops in Python, for families whose attention needs a step
that pyx/layers.pyx's compiled Attention lacks (Llama 4's NoPE layers, temperature and chunked
attention; MiniMax-M2's q/k norm over all heads; Gemma 4's v norm and per-layer head sizes). The
steps are Attention's: the fused qkv projection, the q/k split, the family's steps around RoPE
(hooks), the KV cache write, paged attention over the batch, the output projection. No bias, no
FP8 cache, no LoRA slots (engine/lora/slots.py hooks only the compiled Attention and refuses
adapters otherwise).
"""
from __future__ import annotations


class ComposedAttention:
    def __init__(self, backend, qkv_weight, o_weight, cos_sin_cache, num_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float, is_neox: bool, scale=None):
        """cos_sin_cache None: no RoPE (a NoPE layer). scale: the scores' multiplier (None:
        head_dim ** -0.5)."""
        self.backend, self.xp = backend, backend.xp
        self.qkv_weight, self.o_weight = qkv_weight, o_weight
        self.cos_sin_cache = cos_sin_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.eps, self.is_neox = eps, is_neox
        self.sliding_window = 0
        self.attention_chunk = 0        # paged_attention's (Llama 4's chunked layers)

    # ---- hooks a family overrides

    def _project(self, x, ws):
        """(q (T, q_size), k (T, kv_size), v (T, kv_size)), C-contiguous workspace arrays."""
        xp, T, qs, kvs = self.xp, x.shape[0], self.q_size, self.kv_size
        qkv = ws.get("qkv", T, qs + 2 * kvs)
        self.backend.linear(x, self.qkv_weight, None, qkv)
        q, k, v = ws.get("q", T, qs), ws.get("k", T, kvs), ws.get("v", T, kvs)
        # the ops take C-contiguous tensors: the fused output is split by copies
        xp.copyto(q, qkv[:, :qs])
        xp.copyto(k, qkv[:, qs:qs + kvs])
        xp.copyto(v, qkv[:, qs + kvs:])
        return q, k, v

    def _before_rope(self, batch, q, k, v, ws):
        """In place on q (T, q_size), k and v (T, kv_size), before RoPE."""

    def _after_rope(self, batch, q, k, ws):
        """In place on q and k, after RoPE."""

    # ----

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        """x (T, H) -> out (T, H)."""
        b = self.backend
        T, qs, D = x.shape[0], self.q_size, self.head_dim
        q, k, v = self._project(x, ws)
        self._before_rope(batch, q, k, v, ws)
        if self.cos_sin_cache is not None:
            b.rotary_embedding(batch.positions, q, k, self.cos_sin_cache, D, self.is_neox)
        self._after_rope(batch, q, k, ws)
        attn = ws.get("attn", T, qs)
        b.reshape_and_cache(k.reshape(T, self.num_kv_heads, D), v.reshape(T, self.num_kv_heads, D),
                            k_cache, v_cache, batch.slot_mapping)
        # attention_chunk only when set: the op's other callers keep its plain signature
        chunk = {"attention_chunk": self.attention_chunk} if self.attention_chunk else {}
        b.paged_attention(attn.reshape(T, self.num_heads, D), q.reshape(T, self.num_heads, D),
                          k_cache, v_cache, batch.block_tables, batch.seq_lens,
                          batch.query_start_loc, self.scale, self.sliding_window, **chunk)
        b.linear(attn, self.o_weight, None, out)


def rms_norm_in_place(backend, xp, x, weight, eps: float, rows: int, width: int, ws, name: str):
    """x viewed as (rows, width), RMSNormed with weight (width,), in place (through a copy: the
    op writes a separate output)."""
    copy = ws.get(name, x.shape[0], x.shape[1])
    xp.copyto(copy, x)
    backend.rms_norm(copy.reshape(rows, width), weight, eps, x.reshape(rows, width))

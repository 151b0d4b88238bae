"""MiniMax-M2 (MiniMaxM2ForCausalLM): Mixtral's graph and tensor names (engine/models/moe.py,
`block_sparse_moe.experts.{e}.w1/w3/w2`) with

- a sigmoid router: the experts chosen by sigmoid(logit) + e_score_correction_bias, weighted by
  their sigmoids renormalised (pyx/moe.py's route_grouped with one group and no scaling:
  ModelConfig's MoeConfig.grouped);
- q and k RMSNormed over their full width (all heads together, one weight of q_size and of
  kv_size) before RoPE (MiniMaxM2Attention);
- partial rotary: the first rotary_dim dims of each head rotate (RoPE settings, ModelConfig).

Every step is an existing backend op, so the CUDA backend runs it as it runs the CPU one.

Tensor (and expert) parallel: each rank holds its heads' part of the two norm weights, and the
norm's mean square over the full width is its rows' sums of squares all-reduced across the ranks
(a KV head replicated on r ranks counts r times, and the width it is divided by r times too).
"""
from __future__ import annotations

import numpy as np

from engine.models.composed_attention import ComposedAttention, rms_norm_in_place
from engine.models.model_config import ModelConfig
from engine.models.moe import MoeForCausalLM, moe_shapes
from engine.parallel import layers as tensor_parallel


def minimax_m2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = moe_shapes(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        shapes[f"{p}q_norm.weight"], shapes[f"{p}k_norm.weight"] = (c.q_size,), (c.kv_size,)
    return shapes


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    expected_shapes = staticmethod(minimax_m2_shapes)

    def _attention(self, weights, p, i):
        c = self.config
        if c.qkv_bias or c.o_bias:
            raise ValueError(f"{c.architecture}: attention_bias is not supported")
        return tensor_parallel.all_reduced_attention(MiniMaxM2Attention(
            self.backend, self._qkv(weights, p)[0],
            self._take(weights, f"{p}self_attn.o_proj.weight"), self.cos_sin_cache,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
            c.rope.is_neox, q_norm=self._norm(weights, f"{p}self_attn.q_norm.weight"),
            k_norm=self._norm(weights, f"{p}self_attn.k_norm.weight"),
            tensor_parallel=c.tensor_parallel), c)


class MiniMaxM2Attention(ComposedAttention):
    def __init__(self, *args, q_norm, k_norm, tensor_parallel=None):
        """q_norm (q_size,), k_norm (kv_size,): RMSNorm weights over all heads (the rank's
        heads' part under tensor_parallel, a TensorParallel)."""
        super().__init__(*args)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.tp = tensor_parallel

    def _before_rope(self, batch, q, k, v, ws):
        T = q.shape[0]
        if self.tp is not None:
            self._split_norm(q, self.q_norm)
            self._split_norm(k, self.k_norm)
            return
        rms_norm_in_place(self.backend, self.xp, q, self.q_norm, self.eps, T, self.q_size, ws,
                          "raw_q")
        rms_norm_in_place(self.backend, self.xp, k, self.k_norm, self.eps, T, self.kv_size, ws,
                          "raw_k")

    def _split_norm(self, x, weight):
        """x (T, the rank's width) RMSNormed over the whole width, in place."""
        xp = self.xp
        x32 = x.astype(xp.float32)
        squares = xp.ascontiguousarray((x32 * x32).sum(axis=1, keepdims=True))
        self.tp.comm.all_reduce(squares)
        mean = squares / np.float32(x.shape[1] * self.tp.size)
        x32 *= 1.0 / xp.sqrt(mean + np.float32(self.eps))
        x32 *= weight.astype(xp.float32)
        x[...] = x32.astype(x.dtype)

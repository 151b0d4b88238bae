"""MiniMax-M2 (MiniMaxM2ForCausalLM): Mixtral's graph and tensor names (engine/models/moe.py,
`block_sparse_moe.experts.{e}.w1/w3/w2`) with

- a sigmoid router: the experts chosen by sigmoid(logit) + e_score_correction_bias, weighted by
  their sigmoids renormalised (pyx/moe.py's route_grouped with one group and no scaling:
  ModelConfig's MoeConfig.grouped);
- q and k RMSNormed over their full width (all heads together, one weight of q_size and of
  kv_size) before RoPE (MiniMaxM2Attention);
- partial rotary: the first rotary_dim dims of each head rotate (RoPE settings, ModelConfig).

Every step is an existing backend op, so the CUDA backend runs it as it runs the CPU one.
"""
from __future__ import annotations

from engine.models.composed_attention import ComposedAttention, rms_norm_in_place
from engine.models.model_config import ModelConfig
from engine.models.moe import MoeForCausalLM, moe_shapes


def minimax_m2_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = moe_shapes(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        shapes[f"{p}q_norm.weight"], shapes[f"{p}k_norm.weight"] = (c.q_size,), (c.kv_size,)
    return shapes


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    expected_shapes = staticmethod(minimax_m2_shapes)

    def __init__(self, config: ModelConfig, weights: dict, backend):
        if config.tensor_parallel is not None:   # the q/k norms span every head
            raise ValueError(f"{config.architecture}: tensor parallel is not supported")
        super().__init__(config, weights, backend)

    def _attention(self, weights, p, i):
        c = self.config
        if c.qkv_bias or c.o_bias:
            raise ValueError(f"{c.architecture}: attention_bias is not supported")
        return MiniMaxM2Attention(
            self.backend, self._qkv(weights, p)[0],
            self._take(weights, f"{p}self_attn.o_proj.weight"), self.cos_sin_cache,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
            c.rope.is_neox, q_norm=self._norm(weights, f"{p}self_attn.q_norm.weight"),
            k_norm=self._norm(weights, f"{p}self_attn.k_norm.weight"))


class MiniMaxM2Attention(ComposedAttention):
    def __init__(self, *args, q_norm, k_norm):
        """q_norm (q_size,), k_norm (kv_size,): RMSNorm weights over all heads."""
        super().__init__(*args)
        self.q_norm, self.k_norm = q_norm, k_norm

    def _before_rope(self, batch, q, k, v, ws):
        T = q.shape[0]
        rms_norm_in_place(self.backend, self.xp, q, self.q_norm, self.eps, T, self.q_size, ws,
                          "raw_q")
        rms_norm_in_place(self.backend, self.xp, k, self.k_norm, self.eps, T, self.kv_size, ws,
                          "raw_k")

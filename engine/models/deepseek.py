"""DeepSeek-V2, DeepSeek-V3 and GLM-4.7-Flash (Glm4MoeLiteForCausalLM): the Llama graph with
multi-head latent attention (pyx/mla.py) in place of attention, its latent KV cache (one row of
kv_lora_rank + qk_rope_head_dim values per token and layer), and DeepSeekMoE (pyx/moe.py's MoE
with route_grouped and ungated shared experts) on the sparse layers. The config keys and routing
rules are in engine/models/deepseek_config.py.

Multi-token-prediction layers (num_nextn_predict_layers, stored as model.layers.{N} and on, N the
decoder's layer count) are kept as loaded, in `mtp_weights`: speculative decoding's MTP head
(engine/models/deepseek_mtp.py) takes them, and the engine drops them otherwise.
"""
from __future__ import annotations

import logging
import re

import numpy as np

from engine.models.llama import LlamaForCausalLM
from engine.models.model_config import ModelConfig
from engine.models.moe import held_experts
from engine.parallel import layers as tensor_parallel
from pyx.layers import MLP
from pyx.mla import MlaAttention, split_kv_b
from pyx.moe import MoE

logger = logging.getLogger("taper.models")

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def deepseek_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads, by its Hugging Face name."""
    m, e = c.mla, c.moe
    H, Hq = c.hidden_size, c.num_attention_heads
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = f"{p}self_attn."
        if m.q_lora_rank:
            shapes[f"{a}q_a_proj.weight"] = (m.q_lora_rank, H)
            shapes[f"{a}q_a_layernorm.weight"] = (m.q_lora_rank,)
            shapes[f"{a}q_b_proj.weight"] = (Hq * m.qk_head_dim, m.q_lora_rank)
            if m.attention_bias:
                shapes[f"{a}q_a_proj.bias"] = (m.q_lora_rank,)
        else:
            shapes[f"{a}q_proj.weight"] = (Hq * m.qk_head_dim, H)
        shapes[f"{a}kv_a_proj_with_mqa.weight"] = (m.latent_dim, H)
        shapes[f"{a}kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        shapes[f"{a}kv_b_proj.weight"] = (Hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        shapes[f"{a}o_proj.weight"] = (H, Hq * m.v_head_dim)
        if m.attention_bias:
            shapes[f"{a}kv_a_proj_with_mqa.bias"] = (m.latent_dim,)
            shapes[f"{a}o_proj.bias"] = (H,)
        shapes[f"{p}input_layernorm.weight"] = (H,)
        shapes[f"{p}post_attention_layernorm.weight"] = (H,)
        if not e.sparse_layers[i]:
            I = c.intermediate_size
            shapes.update({f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H),
                           f"{p}mlp.down_proj.weight": (H, I)})
            continue
        I = e.intermediate_size
        shapes[f"{p}mlp.gate.weight"] = (e.num_experts, H)
        if e.grouped.correction_bias:
            shapes[f"{p}mlp.gate.e_score_correction_bias"] = (e.num_experts,)
        for x in held_experts(c):      # (expert parallel: the rank's experts)
            q = f"{p}mlp.experts.{x}."
            shapes.update({f"{q}gate_proj.weight": (I, H), f"{q}up_proj.weight": (I, H),
                           f"{q}down_proj.weight": (H, I)})
        if e.shared_intermediate_size:
            S, q = e.shared_intermediate_size, f"{p}mlp.shared_experts."
            shapes.update({f"{q}gate_proj.weight": (S, H), f"{q}up_proj.weight": (S, H),
                           f"{q}down_proj.weight": (H, S)})
    return shapes


class DeepseekForCausalLM(LlamaForCausalLM):
    expected_shapes = staticmethod(deepseek_shapes)

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend):
        # The MTP layers' tensors, set aside before the decoder takes its own.
        self.mtp_weights = {n: weights.pop(n) for n in list(weights)
                            if (m := _LAYER.match(n)) and int(m[1]) >= config.num_hidden_layers}
        if self.mtp_weights:
            logger.info("keeping %d multi-token-prediction tensors (layers %d+) for speculative "
                        "decoding", len(self.mtp_weights), config.num_hidden_layers)
        super().__init__(config, weights, backend)

    def _attention(self, weights: dict, p: str, i: int):
        c, m = self.config, self.config.mla
        a = f"{p}self_attn."
        bias = m.attention_bias
        q_a_norm = q_b = q_proj = None
        if m.q_lora_rank:   # q_a_proj and kv_a_proj_with_mqa both read x: one GEMM
            names = [f"{a}q_a_proj", f"{a}kv_a_proj_with_mqa"]
            a_weight = self._fuse(weights, [f"{n}.weight" for n in names])
            a_bias = self._fuse(weights, [f"{n}.bias" for n in names]) if bias else None
            q_a_norm = self._norm(weights, f"{a}q_a_layernorm.weight")
            q_b = self._take(weights, f"{a}q_b_proj.weight")
        else:
            a_weight = self._take(weights, f"{a}kv_a_proj_with_mqa.weight")
            a_bias = self._take(weights, f"{a}kv_a_proj_with_mqa.bias") if bias else None
            q_proj = self._take(weights, f"{a}q_proj.weight")
        kv_b = weights.pop(f"{a}kv_b_proj.weight")
        if not isinstance(kv_b, np.ndarray):
            raise ValueError(f"{a}kv_b_proj.weight: a {type(kv_b).__name__}; MLA splits it per "
                             f"head and needs it in float")
        uk_t, uv = split_kv_b(kv_b, c.num_attention_heads, m.qk_nope_head_dim, m.v_head_dim)
        # (tensor parallel: the rank's heads, o_proj's partial sum all-reduced)
        return tensor_parallel.all_reduced_attention(MlaAttention(
            self.backend, m, c.num_attention_heads, a_weight, a_bias, q_a_norm, q_b, q_proj,
            self._norm(weights, f"{a}kv_a_layernorm.weight"),
            self.backend.place_weight(np.ascontiguousarray(kv_b)),
            self._stack(uk_t), self._stack(uv), self._take(weights, f"{a}o_proj.weight"),
            self._take(weights, f"{a}o_proj.bias") if bias else None,
            self._rope_cache(i), c.rope.is_neox, c.rms_norm_eps), c)

    def _stack(self, w: np.ndarray):
        """A (G, N, K) weight stack placed as the backend places a matrix (its dtype, device)."""
        G, N, K = w.shape
        return self.backend.place_weight(w.reshape(G * N, K)).reshape(G, N, K)

    def _mlp(self, weights: dict, p: str, i: int):
        if not self.config.moe.sparse_layers[i]:
            return super()._mlp(weights, p, i)
        return self._moe(weights, p)

    def _moe(self, weights: dict, p: str):
        """The DeepSeekMoE block of layer prefix p."""
        e = self.config.moe
        q = f"{p}mlp."
        held = held_experts(self.config)     # (expert parallel: GLM-4.5's rank's experts)
        gate_up = [self._fuse(weights, [f"{q}experts.{x}.gate_proj.weight",
                                        f"{q}experts.{x}.up_proj.weight"])
                   for x in held]
        downs = [self._take(weights, f"{q}experts.{x}.down_proj.weight") for x in held]
        shared = None
        if e.shared_intermediate_size:
            s = f"{q}shared_experts."
            shared = MLP(self.backend, self._fuse(weights, [f"{s}gate_proj.weight",
                                                            f"{s}up_proj.weight"]),
                         None, self._take(weights, f"{s}down_proj.weight"), None)
        bias = None
        if e.grouped.correction_bias:
            bias = self.backend.asarray(np.asarray(
                weights.pop(f"{q}gate.e_score_correction_bias"), dtype=np.float32))
        return MoE(self.backend, self._take(weights, f"{q}gate.weight"), gate_up, downs, e.top_k,
                   e.normalize, shared, None, fused=self.backend.fused_moe, grouped=e.grouped,
                   correction_bias=bias, first_expert=held.start, num_experts=e.num_experts)

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype) -> list:
        """One latent cache per layer (kv_cache_shape: (NB, BS, 1, L + R)), given as both the
        layer's K and V cache."""
        if np.dtype(dtype).itemsize == 1:
            raise ValueError(f"{self.config.architecture}: an FP8 KV cache is not supported for "
                             f"multi-head latent attention yet; use --kv-cache-dtype auto")
        shape = self.kv_cache_shape(num_blocks, block_size)
        caches = [self.xp.zeros(shape, dtype) for _ in range(self.num_layers)]
        c, m = self.config, self.config.mla
        itemsize = np.dtype(dtype).itemsize
        full = c.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
        logger.info("MLA latent KV cache: %d values per token and layer (kv_lora_rank %d + "
                    "qk_rope_head_dim %d), %d bytes per token over %d layers; full K/V would be "
                    "%d values (%.1fx)", m.latent_dim, m.kv_lora_rank, m.qk_rope_head_dim,
                    m.latent_dim * itemsize * self.num_layers, self.num_layers, full,
                    full / m.latent_dim)
        return [(cache, cache) for cache in caches]

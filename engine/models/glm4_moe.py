"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): the Llama graph's attention (q/k/v bias from
attention_bias, an unbiased o_proj, per-head q/k RMSNorm when use_qk_norm, half of each head
rotated in rotate-half pairs by default: config flags, ModelConfig) with DeepSeek-V3's MoE
(engine/models/deepseek.py's block: sigmoid routing with e_score_correction_bias over n_group /
topk_group, norm_topk_prob, routed_scaling_factor, ungated shared experts) after the first
first_k_dense_replace dense layers. Multi-token-prediction layers are set aside as DeepSeek's are.
"""
from __future__ import annotations

from engine.models.deepseek import DeepseekForCausalLM
from engine.models.llama import LlamaForCausalLM, expected_shapes
from engine.models.model_config import ModelConfig
from engine.models.moe import held_experts


def glm4_moe_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = expected_shapes(c)
    e, H = c.moe, c.hidden_size
    I, S = e.intermediate_size, e.shared_intermediate_size
    for i, sparse in enumerate(e.sparse_layers):
        if not sparse:
            continue
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}{name}.weight"]
        shapes[f"{p}gate.weight"] = (e.num_experts, H)
        shapes[f"{p}gate.e_score_correction_bias"] = (e.num_experts,)
        for x in held_experts(c):
            q = f"{p}experts.{x}."
            shapes.update({f"{q}gate_proj.weight": (I, H), f"{q}up_proj.weight": (I, H),
                           f"{q}down_proj.weight": (H, I)})
        if S:
            q = f"{p}shared_experts."
            shapes.update({f"{q}gate_proj.weight": (S, H), f"{q}up_proj.weight": (S, H),
                           f"{q}down_proj.weight": (H, S)})
    return shapes


class Glm4MoeForCausalLM(DeepseekForCausalLM):
    """DeepSeek's MoE layers and MTP handling with Llama's attention and K/V cache."""
    expected_shapes = staticmethod(glm4_moe_shapes)
    _attention = LlamaForCausalLM._attention
    new_kv_caches = LlamaForCausalLM.new_kv_caches

"""GLM-4 (Glm4ForCausalLM): the Llama graph (engine/models/llama.py) with a post-norm after
attention and after the MLP (SandwichDecoderLayer) and the checkpoint's fused gate_up_proj. Its
partial rotary in interleaved pairs and its q/k/v-only bias are config flags (ModelConfig).
"""
from __future__ import annotations

from engine.models.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, expected_shapes
from pyx.layers import SandwichDecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(c)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            del shapes[f"{p}mlp.gate_proj.weight"], shapes[f"{p}mlp.up_proj.weight"]
            shapes[f"{p}mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
            for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                shapes[f"{p}{name}.weight"] = (c.hidden_size,)
        return shapes

    def _gate_up(self, weights, p):
        return self._take(weights, f"{p}mlp.gate_up_proj.weight"), None

    def _layer(self, weights, p, i, attn, mlp):
        # GLM-4 names: post_self_attn_layernorm after attention, post_attention_layernorm before
        # the MLP, post_mlp_layernorm after it.
        norms = [self._norm(weights, f"{p}{n}.weight") for n in (
            "input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
            "post_mlp_layernorm")]
        return SandwichDecoderLayer(self.backend, attn, mlp, *norms, self.config.rms_norm_eps,
                                    i == 0)

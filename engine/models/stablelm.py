"""StableLM (StableLmForCausalLM): the Llama graph (engine/models/llama.py) with LayerNorm (weight
and bias) for every norm and, where configured, GPT-NeoX's parallel residual
(LayerNormDecoderLayer). Partial rotary and the q/k/v bias are config flags (ModelConfig).
"""
from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, expected_shapes
from pyx.layers import LayerNormDecoderLayer


class StableLmForCausalLM(LlamaForCausalLM):
    @staticmethod
    def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(c)
        norms = ["model.norm"]
        for i in range(c.num_hidden_layers):
            norms.append(f"model.layers.{i}.input_layernorm")
            if c.parallel_residual:     # the MLP reads the input norm too
                del shapes[f"model.layers.{i}.post_attention_layernorm.weight"]
            else:
                norms.append(f"model.layers.{i}.post_attention_layernorm")
        shapes.update({f"{n}.bias": (c.hidden_size,) for n in norms})
        return shapes

    def _layer(self, weights, p, i, attn, mlp):
        c = self.config
        post = [None, None] if c.parallel_residual else [
            self._take(weights, f"{p}post_attention_layernorm.{n}") for n in ("weight", "bias")]
        return LayerNormDecoderLayer(
            self.backend, attn, mlp, self._take(weights, f"{p}input_layernorm.weight"),
            self._take(weights, f"{p}input_layernorm.bias"), *post, c.rms_norm_eps, i == 0,
            c.parallel_residual)

    def _norm(self, weights, name):
        # Only the final norm comes through here (the layers' norms are taken in _layer and there
        # is no q/k norm): its bias, model.norm.bias, is taken alongside.
        self.norm_bias = self._take(weights, name.removesuffix("weight") + "bias")
        return self._take(weights, name)

    def _final_norm(self, hidden, residual):
        self.backend.fused_add_layer_norm(hidden, residual, self.norm, self.norm_bias,
                                          self.config.rms_norm_eps)

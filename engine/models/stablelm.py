"""StableLM (StableLmForCausalLM): the Llama graph (engine/models/llama.py) with LayerNorm (weight
and bias) for every norm and, where configured, GPT-NeoX's parallel residual
(LayerNormDecoderLayer) and a bias-free LayerNorm on each q and k head with a weight per head
(qk_layernorm, StableLM-2 12B). Partial rotary and the q/k/v bias are config flags (ModelConfig).
"""
from __future__ import annotations

from engine.models.model_config import ModelConfig
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
        if c.qk_layernorm:
            for i in range(c.num_hidden_layers):
                for name, first, heads in _qk_heads(c):
                    for h in range(first, first + heads):
                        shapes[f"model.layers.{i}.self_attn.{name}.norms.{h}.weight"] = \
                            (c.head_dim,)
        return shapes

    def _qk_norms(self, weights, p):
        if not self.config.qk_layernorm:
            return None, None
        return tuple([self._take(weights, f"{p}self_attn.{name}.norms.{h}.weight")
                      for h in range(first, first + heads)]
                     for name, first, heads in _qk_heads(self.config))

    def _layer(self, weights, p, i, attn, mlp):
        c = self.config
        post = [None, None] if c.parallel_residual else [
            self._take(weights, f"{p}post_attention_layernorm.{n}") for n in ("weight", "bias")]
        return LayerNormDecoderLayer(
            self.backend, attn, mlp, self._take(weights, f"{p}input_layernorm.weight"),
            self._take(weights, f"{p}input_layernorm.bias"), *post, c.rms_norm_eps, i == 0,
            c.parallel_residual)

    def _norm(self, weights, name):
        # Only the final norm comes through here (the layers' norms are taken in _layer, the q/k
        # ones in _qk_norms): its bias, model.norm.bias, is taken alongside.
        self.norm_bias = self._take(weights, name.removesuffix("weight") + "bias")
        return self._take(weights, name)

    def _final_norm(self, hidden, residual):
        self.backend.fused_add_layer_norm(hidden, residual, self.norm, self.norm_bias,
                                          self.config.rms_norm_eps)


def _qk_heads(c: ModelConfig) -> tuple:
    """(name, first head, heads) of the q and k norms; under tensor parallel the rank's heads,
    named by their index in the whole model (engine/parallel/sharding.py)."""
    tp = c.tensor_parallel
    q_first, kv_first = (0, 0) if tp is None else (tp.rank * c.num_attention_heads,
                                                    tp.kv_head_start)
    return (("q_layernorm", q_first, c.num_attention_heads),
            ("k_layernorm", kv_first, c.num_key_value_heads))

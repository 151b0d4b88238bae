"""Gemma-2 and Gemma-3 (text): the Llama graph (engine/models/llama.py) with Gemma's quirks.

Both: RMSNorm multiplies by (1 + w) (the offset is added to every norm weight at load), pre- and
post-norms around attention and the MLP (SandwichDecoderLayer), a GeGLU MLP with tanh GELU, the
embedding scaled by sqrt(hidden) in the activation dtype, attention scaled by
query_pre_attn_scalar ** -0.5, alternating sliding-window layers. The config flags (ModelConfig)
carry Gemma-2's attention and final logit soft-caps; Gemma-3 adds q/k norm and a RoPE base of its
own for the sliding (local) layers.
"""
from __future__ import annotations

import math

from engine.models.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, expected_shapes
from engine.models.rotary import build_cos_sin_cache
from pyx.layers import SandwichDecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    norm_offset = 1.0

    @staticmethod
    def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = expected_shapes(c)
        for i in range(c.num_hidden_layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{i}.{name}.weight"] = (c.hidden_size,)
        return shapes

    @staticmethod
    def embedding_multiplier(c: ModelConfig) -> float:
        return math.sqrt(c.hidden_size)

    def _layer(self, weights, p, i, attn, mlp):
        norms = [self._norm(weights, f"{p}{n}.weight") for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")]
        return SandwichDecoderLayer(self.backend, attn, mlp, *norms, self.config.rms_norm_eps,
                                    i == 0)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def _rope_cache(self, i):
        c = self.config
        if not c.sliding_windows[i] or c.local_rope is None:
            return self.cos_sin_cache
        if not hasattr(self, "_local_cache"):
            self._local_cache = self._to_device(build_cos_sin_cache(
                c.local_rope, c.max_position_embeddings, c.max_model_len))
        return self._local_cache

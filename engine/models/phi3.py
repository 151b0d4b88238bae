"""Phi-3 / Phi-3.5: the Llama graph (engine/models/llama.py) reading weights that the checkpoint
already fuses (self_attn.qkv_proj, mlp.gate_up_proj). LongRoPE and partial rotary are RoPE
settings (engine/models/model_config.py, engine/models/rotary.py) that every family can use.
"""
from __future__ import annotations

from engine.models.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
        H, I = c.hidden_size, c.intermediate_size
        shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, H)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[f"{p}self_attn.qkv_proj.weight"] = (c.q_size + 2 * c.kv_size, H)
            shapes[f"{p}self_attn.o_proj.weight"] = (H, c.q_size)
            shapes[f"{p}mlp.gate_up_proj.weight"] = (2 * I, H)
            shapes[f"{p}mlp.down_proj.weight"] = (H, I)
            shapes[f"{p}input_layernorm.weight"] = (H,)
            shapes[f"{p}post_attention_layernorm.weight"] = (H,)
        return shapes

    def _qkv(self, weights, p):
        return self._take(weights, f"{p}self_attn.qkv_proj.weight", role="qkv"), None

    def _gate_up(self, weights, p):
        return self._take(weights, f"{p}mlp.gate_up_proj.weight"), None

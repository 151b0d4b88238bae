"""Phi-2 (PhiForCausalLM): StableLM's graph (engine/models/stablelm.py: LayerNorm with bias,
GPT-NeoX's parallel residual, always on here) with Phi's names and two quirks of its own: an
ungated MLP, fc2(gelu_new(fc1(x))) with biases, and a bias on the lm_head. Attention has biases
on q/k/v and on its output projection (`dense`); half of each head rotates by default (rotate-half
pairs); the final norm is `model.final_layernorm`. These are config flags (ModelConfig).

gelu_new is the tanh GELU; the op table has it only gated (gelu_tanh_and_mul), so the MLP
multiplies it by a block of ones that stays in place between steps: an exact composition
(x * 1.0 == x) of an op every backend has.
"""
from __future__ import annotations

from engine.models.model_config import ModelConfig
from engine.models.stablelm import StableLmForCausalLM
from engine.parallel import layers as tensor_parallel


class PhiForCausalLM(StableLmForCausalLM):
    @staticmethod
    def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
        H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
        shapes = {"model.embed_tokens.weight": (V, H), "model.final_layernorm.weight": (H,),
                  "model.final_layernorm.bias": (H,), "lm_head.bias": (V,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, H)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            for name, n in (("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size),
                            ("dense", H)):
                shapes[f"{p}self_attn.{name}.weight"] = (n, c.q_size if name == "dense" else H)
                shapes[f"{p}self_attn.{name}.bias"] = (n,)
            shapes[f"{p}mlp.fc1.weight"], shapes[f"{p}mlp.fc1.bias"] = (I, H), (I,)
            shapes[f"{p}mlp.fc2.weight"], shapes[f"{p}mlp.fc2.bias"] = (H, I), (H,)
            shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}input_layernorm.bias"] = (H,)
        return shapes

    def __init__(self, config: ModelConfig, weights: dict, backend):
        self._gelu = GeluTanh(backend, config.intermediate_size)
        super().__init__(config, weights, backend)

    def _attention(self, weights, p, i):
        for n in ("weight", "bias"):      # Phi's output projection is `dense`
            weights[f"{p}self_attn.o_proj.{n}"] = weights.pop(f"{p}self_attn.dense.{n}")
        return super()._attention(weights, p, i)

    def _mlp(self, weights, p, i):
        return PhiMLP(self.backend, self._gelu,
                      *(self._take(weights, f"{p}mlp.{n}") for n in (
                          "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")))

    def _norm(self, weights, name):
        # Only the final norm comes here (as in StableLM), just before the lm_head is taken: the
        # head's bias is taken alongside.
        if self.config.tensor_parallel is not None and self.config.tie_word_embeddings:
            # the tied head is the embedding share with its zero row: a zero bias for that row
            weights["lm_head.bias"] = tensor_parallel.with_zero_row(weights["lm_head.bias"])
        self.lm_head_bias = self._take(weights, "lm_head.bias")
        return super()._norm(weights, "model.final_layernorm.weight")

    def logits(self, rows_hidden):
        if not len(rows_hidden):
            return super().logits(rows_hidden)
        # (under tensor parallel the rank's vocabulary share of the head and its bias, gathered)
        return tensor_parallel.logits(self.backend, self.config, rows_hidden, self.lm_head,
                                      self.lm_head_bias)


class GeluTanh:
    """out = gelu_tanh(x) for (T, I) rows, through gelu_tanh_and_mul on [x | ones]; one buffer
    shared by every layer, its ones half written once per growth."""

    def __init__(self, backend, intermediate_size: int):
        self.backend, self.xp, self.size = backend, backend.xp, intermediate_size
        self.buffer = None

    def __call__(self, x, out):
        T = x.shape[0]
        if self.buffer is None or self.buffer.shape[0] < T:
            self.buffer = self.xp.ones((max(T, 1), 2 * self.size), dtype=x.dtype)
        gated = self.buffer[:T]
        self.xp.copyto(gated[:, :self.size], x)
        self.backend.gelu_tanh_and_mul(gated, out)


class PhiMLP:
    """fc2(gelu_new(fc1(x))), both with biases."""

    def __init__(self, backend, gelu: GeluTanh, fc1, fc1_bias, fc2, fc2_bias):
        self.backend, self.gelu = backend, gelu
        self.fc1, self.fc1_bias, self.fc2, self.fc2_bias = fc1, fc1_bias, fc2, fc2_bias
        self.intermediate_size = fc1.shape[0]

    def forward(self, x, out, ws):
        """x (T, H) -> out (T, H); out may be x (the parallel residual's MLP writes over its
        input, which only fc1 reads)."""
        T = x.shape[0]
        b = self.backend
        up = ws.get("phi_fc1", T, self.intermediate_size)
        b.linear(x, self.fc1, self.fc1_bias, up)
        act = ws.get("act", T, self.intermediate_size)
        self.gelu(up, act)
        b.linear(act, self.fc2, self.fc2_bias, out)

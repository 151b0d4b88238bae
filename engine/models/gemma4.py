"""Gemma 4 text (Gemma4ForCausalLM): Gemma-3's layout (engine/models/gemma.py: sandwich norms,
GeGLU, the embedding scaled by sqrt(hidden), sliding layers beside full ones, the final logit
soft-cap) with

- RMSNorms that multiply by w, not 1 + w;
- per-head RMSNorm on q and k (weights) and on v (none), attention scores not scaled (1.0);
- the full-attention layers' own head size and KV heads (global_head_dim,
  num_global_key_value_heads), their values equal to their keys before the norms when
  attention_k_eq_v (no v_proj), and their proportional RoPE: the first partial_rotary_factor of
  each head's rotate-half pairs turn at frequencies theta ** (-2j / head_dim), the others not;
- layer_scalar: each layer's output stream multiplied by a scalar of its own;
- with enable_moe_block (26B-A4B), a mixture of experts beside every layer's dense MLP
  (Gemma4FeedForward): both read the stream after attention, each through its own pre-norm, each
  output post-normed, their sum post-normed again (post_feedforward_layernorm). The router
  normalizes the stream (no weight), scales it by scale / sqrt(hidden), takes the softmax top-k
  renormalized, then multiplies each chosen expert's weight by its per_expert_scale; the experts
  are GeGLU, stored stacked (experts.gate_up_proj (E, 2I, H), gate rows first; down_proj).

The per-layer settings are engine/models/family_config.py's Gemma4Settings. Every layer's KV
cache has the wider layer kind's shape; a narrower layer uses the front of that buffer reshaped
to its own (NB, BS, Hkv, D), contiguous, so the pool's blocks mean the same in every layer.

Gemma 4 as released (Gemma4ForConditionalGeneration: the text model's tensors under
model.language_model., beside vision and audio towers) is served for its text, the towers not
loaded. Per-layer input embeddings (the E2B/E4B models) and KV sharing across layers are refused
by name in ModelConfig. On CUDA the full layers' wider heads (512 in the released models) take
the masked attention kernel (pyx/attention_dispatch.py: the tuned ones stop at 256).
"""
from __future__ import annotations

import logging

import numpy as np

from engine.models.composed_attention import ComposedAttention, rms_norm_in_place
from engine.models.gemma import Gemma2ForCausalLM
from engine.models.model_config import ModelConfig
from engine.models.rotary import _cos_sin
from pyx.layers import SandwichDecoderLayer
from pyx.moe import MoE

logger = logging.getLogger("taper.models")

_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
           "model.embed_audio.")


def _language_model_only(weights: dict) -> None:
    """In place: a multimodal checkpoint's language model under the causal LM's names, its
    vision and audio towers dropped."""
    prefix, dropped = "model.language_model.", 0
    for name in list(weights):
        if name.startswith(prefix):
            weights["model." + name[len(prefix):]] = weights.pop(name)
        elif name.startswith(_TOWERS):
            del weights[name]
            dropped += 1
    if dropped:
        logger.info("not loaded: %d vision and audio tower tensors", dropped)


def _layer_dims(c: ModelConfig, i: int) -> tuple[int, int]:
    """(KV heads, head size) of layer i."""
    s = c.family
    return (s.full_kv_heads, s.full_head_dim) if s.full_layers[i] else (c.num_key_value_heads,
                                                                        c.head_dim)


def gemma4_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = Gemma2ForCausalLM.expected_shapes(c)
    H, Hq = c.hidden_size, c.num_attention_heads
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        kv_heads, D = _layer_dims(c, i)
        a = f"{p}self_attn."
        shapes.update({f"{a}q_proj.weight": (Hq * D, H), f"{a}k_proj.weight": (kv_heads * D, H),
                       f"{a}v_proj.weight": (kv_heads * D, H), f"{a}o_proj.weight": (H, Hq * D),
                       f"{a}q_norm.weight": (D,), f"{a}k_norm.weight": (D,),
                       f"{p}layer_scalar": (1,)})
        if c.family.full_layers[i] and c.family.k_eq_v:
            del shapes[f"{a}v_proj.weight"]
        if c.moe is not None:
            E, I = c.moe.num_experts, c.moe.intermediate_size
            shapes.update({f"{p}router.proj.weight": (E, H), f"{p}router.scale": (H,),
                           f"{p}router.per_expert_scale": (E,),
                           f"{p}experts.gate_up_proj": (E, 2 * I, H),
                           f"{p}experts.down_proj": (E, H, I)})
            for norm in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                         "post_feedforward_layernorm_2"):
                shapes[f"{p}{norm}.weight"] = (H,)
    return shapes


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    norm_offset = 0.0
    expected_shapes = staticmethod(gemma4_shapes)

    def __init__(self, config: ModelConfig, weights: dict, backend):
        if config.tensor_parallel is not None:
            raise ValueError(f"{config.architecture}: tensor parallel is not supported")
        _language_model_only(weights)
        s = config.family
        # proportional RoPE over the full layers' whole head (rotate-half pairs j, j + D/2)
        D = s.full_head_dim
        angles = int(s.full_rotary_factor * D // 2)
        inv_freq = np.zeros(D // 2)
        inv_freq[:angles] = 1.0 / s.full_theta ** (np.arange(0, 2 * angles, 2) / D)
        self._full_cache = backend.asarray(_cos_sin(inv_freq / s.full_rope_factor, 1.0,
                                                    config.max_model_len))
        super().__init__(config, weights, backend)

    def _attention(self, weights, p, i):
        c, s = self.config, self.config.family
        kv_heads, D = _layer_dims(c, i)
        a = f"{p}self_attn."
        k_eq_v = s.full_layers[i] and s.k_eq_v
        names = [f"{a}q_proj.weight", f"{a}k_proj.weight"] + ([] if k_eq_v else
                                                               [f"{a}v_proj.weight"])
        return Gemma4Attention(
            self.backend, self._fuse(weights, names, role="qkv"),
            self._take(weights, f"{a}o_proj.weight"),
            self._full_cache if s.full_layers[i] else self.cos_sin_cache,
            c.num_attention_heads, kv_heads, D, c.rms_norm_eps, True, 1.0,
            q_norm=self._norm(weights, f"{a}q_norm.weight"),
            k_norm=self._norm(weights, f"{a}k_norm.weight"),
            v_norm=self.backend.place_weight(np.ones(D, np.float32)), k_eq_v=k_eq_v,
            sliding_window=c.sliding_windows[i])

    def _mlp(self, weights, p, i):
        if self.config.moe is None:
            return super()._mlp(weights, p, i)
        c, m, b = self.config, self.config.moe, self.backend

        def f32(name):
            return np.asarray(weights.pop(name), dtype=np.float32)
        gate_up = weights.pop(f"{p}experts.gate_up_proj")        # (E, 2I, H), gate rows first
        down = weights.pop(f"{p}experts.down_proj")              # (E, H, I)
        router_scale = f32(f"{p}router.scale") * np.float32(c.hidden_size ** -0.5)
        experts = MoE(b, self._take(weights, f"{p}router.proj.weight"),
                      [b.place_weight(np.ascontiguousarray(w)) for w in gate_up],
                      [b.place_weight(np.ascontiguousarray(w)) for w in down], m.top_k,
                      m.normalize, fused=b.fused_moe, activation="gelu_tanh",
                      expert_scale=b.asarray(f32(f"{p}router.per_expert_scale")))
        return Gemma4FeedForward(
            b, super()._mlp(weights, p, i), experts,
            self._norm(weights, f"{p}pre_feedforward_layernorm.weight"),
            self._norm(weights, f"{p}pre_feedforward_layernorm_2.weight"),
            b.place_weight(router_scale),
            self._norm(weights, f"{p}post_feedforward_layernorm_1.weight"),
            self._norm(weights, f"{p}post_feedforward_layernorm_2.weight"), c.rms_norm_eps)

    def _layer(self, weights, p, i, attn, mlp):
        names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        if self.config.moe is not None:     # Gemma4FeedForward took it; it reads the unit norm
            names[2] = None
        ones = self.backend.place_weight(np.ones(self.config.hidden_size, np.float32))
        norms = [ones if n is None else self._norm(weights, f"{p}{n}.weight") for n in names]
        scalar = float(np.asarray(weights.pop(f"{p}layer_scalar"), dtype=np.float32)[0])
        return ScaledSandwichDecoderLayer(self.backend, attn, mlp, *norms,
                                          self.config.rms_norm_eps, i == 0, scalar=scalar)

    def kv_cache_shape(self, num_blocks, block_size):
        """The wider layer kind's (module docstring)."""
        c = self.config
        full = (c.family.full_kv_heads, c.family.full_head_dim)
        sliding = (c.num_key_value_heads, c.head_dim)
        kv_heads, D = max(full, sliding, key=lambda d: d[0] * d[1])
        return (num_blocks, block_size, kv_heads, D)


class Gemma4Attention(ComposedAttention):
    def __init__(self, *args, q_norm, k_norm, v_norm, k_eq_v: bool, sliding_window: int):
        """q_norm, k_norm, v_norm (head_dim,): per-head RMSNorm weights (v's all ones).
        k_eq_v: the fused projection has q and k only, and v is k's copy."""
        super().__init__(*args)
        self.q_norm, self.k_norm, self.v_norm = q_norm, k_norm, v_norm
        self.k_eq_v = k_eq_v
        self.sliding_window = sliding_window

    def _project(self, x, ws):
        if not self.k_eq_v:
            return super()._project(x, ws)
        xp, T, qs, kvs = self.xp, x.shape[0], self.q_size, self.kv_size
        qk = ws.get("qkv", T, qs + kvs)
        self.backend.linear(x, self.qkv_weight, None, qk)
        q, k, v = ws.get("q", T, qs), ws.get("k", T, kvs), ws.get("v", T, kvs)
        xp.copyto(q, qk[:, :qs])
        xp.copyto(k, qk[:, qs:])
        xp.copyto(v, qk[:, qs:])
        return q, k, v

    def _before_rope(self, batch, q, k, v, ws):
        b, xp, T, D = self.backend, self.xp, q.shape[0], self.head_dim
        Hq, Hkv = self.num_heads, self.num_kv_heads
        rms_norm_in_place(b, xp, q, self.q_norm, self.eps, T * Hq, D, ws, "raw_q")
        rms_norm_in_place(b, xp, k, self.k_norm, self.eps, T * Hkv, D, ws, "raw_k")
        rms_norm_in_place(b, xp, v, self.v_norm, self.eps, T * Hkv, D, ws, "raw_v")

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        NB, BS = k_cache.shape[:2]
        shape = (NB, BS, self.num_kv_heads, self.head_dim)
        size = NB * BS * self.num_kv_heads * self.head_dim
        super().forward(batch, x, out, k_cache.reshape(-1)[:size].reshape(shape),
                        v_cache.reshape(-1)[:size].reshape(shape), ws)


class ScaledSandwichDecoderLayer(SandwichDecoderLayer):
    """SandwichDecoderLayer whose output stream, residual + this layer's MLP output, is
    multiplied by `scalar` (Gemma 4's layer_scalar): both parts are, as the stream is their sum
    until the next layer's fused add."""

    def __init__(self, backend, attention, mlp, input_norm, post_attn_norm, pre_mlp_norm,
                 post_mlp_norm, eps, first, scalar: float):
        super().__init__(backend, attention, mlp, input_norm, post_attn_norm, pre_mlp_norm,
                         post_mlp_norm, eps, first)
        self.ops, self.scalar = backend, scalar

    def forward(self, batch, hidden, residual, k_cache, v_cache, ws):
        super().forward(batch, hidden, residual, k_cache, v_cache, ws)
        if self.scalar != 1.0:
            self.ops.scale(hidden, self.scalar)
            self.ops.scale(residual, self.scalar)


class Gemma4FeedForward:
    """Gemma 4's dense MLP and mixture of experts side by side (module docstring). The layer's
    pre-MLP norm has weight one, so `x` arrives as the stream after attention divided by its RMS:
    each branch's pre-norm (and the router's scale) is that times its own weight, as
    transformers' RMSNorms compute it."""

    def __init__(self, backend, mlp, experts: MoE, pre_norm, pre_norm_2, router_scale,
                 post_norm_1, post_norm_2, eps: float):
        self.backend, self.xp = backend, backend.xp
        self.mlp, self.experts = mlp, experts
        self.pre_norm, self.pre_norm_2, self.router_scale = pre_norm, pre_norm_2, router_scale
        self.post_norm_1, self.post_norm_2 = post_norm_1, post_norm_2
        self.eps = eps

    def forward(self, x, out, ws):
        """x (T, H): the stream after attention, RMS-normalized without a weight -> out (T, H)."""
        b, xp, (T, H) = self.backend, self.xp, x.shape
        branch_in = ws.get("gemma4_ffn_in", T, H)
        branch_out = ws.get("gemma4_ffn_out", T, H)
        normed = ws.get("gemma4_ffn_normed", T, H)
        xp.multiply(x, self.pre_norm, out=branch_in)
        self.mlp.forward(branch_in, branch_out, ws)
        b.rms_norm(branch_out, self.post_norm_1, self.eps, out)
        xp.multiply(x, self.router_scale, out=branch_in)
        ids, weights = self.experts.select(branch_in, ws)
        xp.multiply(x, self.pre_norm_2, out=branch_in)
        self.experts.run_experts(branch_in, ids, weights, branch_out, ws)
        b.rms_norm(branch_out, self.post_norm_2, self.eps, normed)
        out += normed

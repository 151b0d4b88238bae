"""Gemma 3's vision tower and multimodal projector over the backend's ops: patches ->
language-model embeddings (transformers' SiglipVisionModel + Gemma3MultiModalProjector).

  patch embedding: a Conv2d whose kernel equals its stride, so one matmul of each patch's
    channels x patch x patch values with the flattened kernel, plus its bias and the learned
    position embedding of the patch (no class token, no interpolation: the size is fixed);
  layers: x += attn(LayerNorm(x)) with q/k/v/out biases, bidirectional over the whole image;
    x += fc2(gelu_tanh(fc1(LayerNorm(x))));
  post LayerNorm;
  projector: the patch grid average-pooled in pool x pool squares to mm_tokens_per_image
    tokens (row-major), Gemma's RMSNorm (x (1 + w), the soft-embedding norm, with the tower's
    layer_norm_eps), then x @ mm_input_projection_weight (vision hidden, text hidden).
The tower computes in the backend's activation dtype (float32 on the CPU; bf16, f16 or f32 on
CUDA; the residual stream in it too, as the fused add-and-norm op keeps it) and returns float32
rows; engine/vision/act_arrays.py moves its arrays (CuPy has no bfloat16 kernels).
"""
from __future__ import annotations

import numpy as np

from engine.vision import act_arrays
from engine.vision.gemma3_config import Gemma3VisionConfig
from pyx.gated_delta_net import as_float32


class Gemma3VisionEncoder:
    def __init__(self, config: Gemma3VisionConfig, weights: dict, backend):
        """Takes (pops) the tower's (vision_tower.*) and the projector's (multi_modal_projector.*)
        tensors from `weights`."""
        self.config = c = config
        self.backend, self.xp = backend, backend.xp
        self.act = np.dtype(backend.act_dtype)
        self._weights = weights
        E, I, P = c.hidden_size, c.intermediate_size, c.patch_size
        p = "vision_tower.embeddings."
        conv = np.asarray(self._pop(p + "patch_embedding.weight"))
        if conv.shape != (E, c.num_channels, P, P):
            raise ValueError(f"vision patch embedding has shape {list(conv.shape)}, expected "
                             f"{[E, c.num_channels, P, P]}")
        self.patch_embed = backend.place_weight(np.ascontiguousarray(conv.reshape(E, -1)))
        self.patch_bias = self._take(p + "patch_embedding.bias", (E,))
        self.positions = self.xp.asarray(np.asarray(
            self._take_host(p + "position_embedding.weight", (c.patches_per_side ** 2, E)),
            np.float32))
        self.layers = []
        for i in range(c.num_layers):
            p = f"vision_tower.encoder.layers.{i}."
            a = p + "self_attn."
            self.layers.append(dict(
                ln1=self._take(p + "layer_norm1.weight", (E,)),
                ln1_bias=self._take(p + "layer_norm1.bias", (E,)),
                qkv=self._fuse([a + f"{n}_proj.weight" for n in "qkv"], (E, E)),
                qkv_bias=self._fuse([a + f"{n}_proj.bias" for n in "qkv"], (E,)),
                out=self._take(a + "out_proj.weight", (E, E)),
                out_bias=self._take(a + "out_proj.bias", (E,)),
                ln2=self._take(p + "layer_norm2.weight", (E,)),
                ln2_bias=self._take(p + "layer_norm2.bias", (E,)),
                fc1=self._take(p + "mlp.fc1.weight", (I, E)),
                fc1_bias=self._take(p + "mlp.fc1.bias", (I,)),
                fc2=self._take(p + "mlp.fc2.weight", (E, I)),
                fc2_bias=self._take(p + "mlp.fc2.bias", (E,))))
        self.post_ln = self._take("vision_tower.post_layernorm.weight", (E,))
        self.post_ln_bias = self._take("vision_tower.post_layernorm.bias", (E,))
        p = "multi_modal_projector."
        norm = self._take_host(p + "mm_soft_emb_norm.weight", (E,))
        self.soft_norm = backend.place_weight(np.asarray(norm, np.float32) + np.float32(1.0))
        proj = self._take_host(p + "mm_input_projection_weight", (E, c.text_hidden_size))
        self.projection = backend.place_weight(np.ascontiguousarray(np.asarray(proj).T))
        del self._weights

    def _pop(self, name: str):
        if name not in self._weights:
            raise ValueError(f"vision tower tensor {name} is missing from the checkpoint")
        return self._weights.pop(name)

    def _take_host(self, name: str, shape: tuple) -> np.ndarray:
        w = np.asarray(self._pop(name))
        if w.shape != shape:
            raise ValueError(f"tensor {name} has shape {list(w.shape)}, expected {list(shape)}")
        return w

    def _take(self, name: str, shape: tuple):
        w = self._take_host(name, shape)
        if w.ndim == 1:       # norms and biases are read in float32
            w = w.astype(np.float32)
        return self.backend.place_weight(np.ascontiguousarray(w))

    def _fuse(self, names: list[str], shape: tuple):
        parts = [self._take_host(n, shape) for n in names]
        parts = [w.astype(np.float32) if w.ndim == 1 else w for w in parts]
        return self.backend.place_weight(np.ascontiguousarray(np.concatenate(parts)))

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]):
        """One image's patches (patches, channels x patch x patch) float32 -> its language-model
        embeddings (mm_tokens_per_image, text hidden), on the backend."""
        c, b, xp = self.config, self.backend, self.xp
        N, E, I, H, D = (c.patches_per_side ** 2, c.hidden_size, c.intermediate_size,
                         c.num_heads, c.head_dim)
        if pixel_values.shape != (N, c.num_channels * c.patch_size ** 2):
            raise ValueError(f"pixel values of shape {list(pixel_values.shape)}; the tower takes "
                             f"{N} patches of {c.num_channels * c.patch_size ** 2} values")
        act_dt = self.act
        embedded = xp.empty((N, E), np.float32)      # the position embedding added in float32
        b.linear(b.asarray(np.ascontiguousarray(pixel_values).astype(act_dt)), self.patch_embed,
                 self.patch_bias, embedded)
        embedded += self.positions
        x = act_arrays.rounded(xp, embedded, act_dt)   # the residual stream
        h = xp.empty((N, E), act_dt)
        qkv = xp.empty((N, 3 * E), act_dt)
        q, k, v = (xp.empty((N, E), act_dt) for _ in range(3))
        attn = xp.empty((N, E), act_dt)
        out = xp.empty((N, E), act_dt)
        up = xp.empty((N, 2 * I), act_dt)
        # gelu_tanh(g) * 1: the GeGLU op as a plain tanh GELU
        act_arrays.copy(xp, up[:, I:], act_arrays.rounded(xp, xp.ones((N, I), np.float32), act_dt))
        gate = xp.empty((N, I), act_dt)
        act = xp.empty((N, I), act_dt)
        whole = b.asarray(np.array([0, N], np.int32))
        eps = c.layer_norm_eps
        b.layer_norm(x, self.layers[0]["ln1"], self.layers[0]["ln1_bias"], eps, h)
        for i, layer in enumerate(self.layers):
            b.linear(h, layer["qkv"], layer["qkv_bias"], qkv)
            act_arrays.copy(xp, q, qkv[:, :E])
            act_arrays.copy(xp, k, qkv[:, E:2 * E])
            act_arrays.copy(xp, v, qkv[:, 2 * E:])
            b.encoder_attention(attn.reshape(N, H, D), q.reshape(N, H, D), k.reshape(N, H, D),
                                v.reshape(N, H, D), whole, D ** -0.5)
            b.linear(attn, layer["out"], layer["out_bias"], out)
            # x += out; out = LayerNorm2(x)
            b.fused_add_layer_norm(out, x, layer["ln2"], layer["ln2_bias"], eps)
            b.linear(out, layer["fc1"], layer["fc1_bias"], gate)
            act_arrays.copy(xp, up[:, :I], gate)
            b.gelu_tanh_and_mul(up, act)
            b.linear(act, layer["fc2"], layer["fc2_bias"], h)
            # x += the MLP's output; h = the next layer's LayerNorm1 (the post LayerNorm last)
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            b.fused_add_layer_norm(h, x, nxt["ln1"] if nxt else self.post_ln,
                                   nxt["ln1_bias"] if nxt else self.post_ln_bias, eps)
        side, k = c.tokens_per_side, c.pool
        pooled = act_arrays.rounded(xp, xp.ascontiguousarray(
            as_float32(h, xp).reshape(side, k, side, k, E).mean(
                axis=(1, 3), dtype=np.float32).reshape(side * side, E)), act_dt)
        normed = xp.empty_like(pooled)
        b.rms_norm(pooled, self.soft_norm, eps, normed)
        embeds = xp.empty((side * side, c.text_hidden_size), np.float32)   # linear writes f32
        b.linear(normed, self.projection, None, embeds)
        return embeds

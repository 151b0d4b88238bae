"""Mistral 3's vision side over the backend's ops: Pixtral's tower and Mistral 3's projector,
patches -> the language model's embeddings for an image's run of tokens.

The graph (transformers' PixtralVisionModel and Mistral3MultiModalProjector):
  patch embedding: a Conv2d whose kernel equals its stride, so one matmul of each patch's
    channels x patch x patch values with the flattened kernel; then RMSNorm (ln_pre);
  2D rotary over the patch grid (axial): frequencies 1 / theta^(2i / head_dim), the even ones
    turned by the patch's row over the first quarter of the head, the odd ones by its column
    over the second, halves rotated as in rotate_half;
  layers: x += attn(rms_norm(x)), x += gated MLP (silu or gelu) (rms_norm(x)), no biases;
    attention bidirectional over the whole image (one image per call: transformers' block
    diagonal mask over a batch is one block per image), no final norm;
  projector: RMSNorm (the language model's eps), each merge x merge square of patches
    concatenated (channel-major, as torch's unfold) and projected back to the tower's width
    (patch merger), Linear, GELU (erf), Linear.
The output holds a row for each token of the image's run in the prompt: the rows of merged
patches, each followed by a zero row where the prompt has its [IMG_BREAK] (or [IMG_END]); the
model writes only the [IMG] rows (engine/models/mistral3.py).
The tower computes in the backend's activation dtype (float32 on the CPU; bf16, f16 or f32 on
CUDA) and returns float32 rows; engine/vision/act_arrays.py moves its arrays (CuPy has no
bfloat16 kernels).
"""
from __future__ import annotations

import numpy as np

from engine.vision import act_arrays
from engine.vision.pixtral_config import PixtralVisionConfig
from pyx.gated_delta_net import as_float32, store

NORM_EPS = 1e-5      # the tower's RMSNorms (fixed in transformers' modeling code)


class PixtralVisionEncoder:
    def __init__(self, config: PixtralVisionConfig, weights: dict, backend):
        """Takes (pops) the tower's (vision_tower.*) and projector's (multi_modal_projector.*)
        tensors from `weights`."""
        self.config = c = config
        self.backend, self.xp = backend, backend.xp
        self.act = np.dtype(backend.act_dtype)
        self._weights = weights
        E, I, T, m = c.hidden_size, c.intermediate_size, c.text_hidden_size, c.spatial_merge_size
        conv = np.asarray(self._pop("vision_tower.patch_conv.weight"))
        if conv.shape != (E, c.in_channels, c.patch_size, c.patch_size):
            raise ValueError(f"vision patch embedding has shape {list(conv.shape)}, expected "
                             f"{[E, c.in_channels, c.patch_size, c.patch_size]}")
        self.patch_embed = backend.place_weight(np.ascontiguousarray(conv.reshape(E, -1)))
        self.ln_pre = self._take("vision_tower.ln_pre.weight", (E,))
        self.layers = []
        for i in range(c.num_layers):
            p = f"vision_tower.transformer.layers.{i}."
            self.layers.append(dict(
                attention_norm=self._take(p + "attention_norm.weight", (E,)),
                ffn_norm=self._take(p + "ffn_norm.weight", (E,)),
                qkv=self._fuse([p + f"attention.{n}_proj.weight" for n in "qkv"], (E, E)),
                o=self._take(p + "attention.o_proj.weight", (E, E)),
                gate_up=self._fuse([p + "feed_forward.gate_proj.weight",
                                    p + "feed_forward.up_proj.weight"], (I, E)),
                down=self._take(p + "feed_forward.down_proj.weight", (E, I))))
        q = "multi_modal_projector."
        self.norm = self._take(q + "norm.weight", (E,))
        merging = np.asarray(self._pop(q + "patch_merger.merging_layer.weight"))
        if merging.shape != (E, E * m * m):
            raise ValueError(f"tensor {q}patch_merger.merging_layer.weight has shape "
                             f"{list(merging.shape)}, expected {[E, E * m * m]}")
        # unfold's column order is (channel, row in square, column in square); the rows are
        # gathered here as (row in square, column in square, channel)
        self.merging = backend.place_weight(np.ascontiguousarray(
            merging.reshape(E, E, m, m).transpose(0, 2, 3, 1).reshape(E, m * m * E)))
        self.linear_1 = self._take(q + "linear_1.weight", (T, E))
        self.linear_2 = self._take(q + "linear_2.weight", (T, T))
        self.bias_1 = self._take(q + "linear_1.bias", (T,)) if c.projector_bias else None
        self.bias_2 = self._take(q + "linear_2.bias", (T,)) if c.projector_bias else None
        D = c.head_dim
        inv_freq = 1.0 / c.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
        self.freq_rows, self.freq_cols = inv_freq[0::2], inv_freq[1::2]
        del self._weights

    def _pop(self, name: str):
        if name not in self._weights:
            raise ValueError(f"vision tensor {name} is missing from the checkpoint")
        return self._weights.pop(name)

    def _take(self, name: str, shape: tuple):
        w = np.asarray(self._pop(name))
        if w.shape != shape:
            raise ValueError(f"tensor {name} has shape {list(w.shape)}, expected {list(shape)}")
        if w.ndim == 1:       # norms and biases are read in float32
            w = w.astype(np.float32)
        return self.backend.place_weight(np.ascontiguousarray(w))

    def _fuse(self, names: list[str], shape: tuple):
        parts = []
        for n in names:
            w = np.asarray(self._pop(n))
            if w.shape != shape:
                raise ValueError(f"tensor {n} has shape {list(w.shape)}, expected "
                                 f"{list(shape)}")
            parts.append(w)
        return self.backend.place_weight(np.ascontiguousarray(np.concatenate(parts)))

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]):
        """One image's patches (rows x columns, patch_dim) float32 -> its run's embeddings
        (rows / merge x (columns / merge + 1), text hidden size), on the backend."""
        c, b, xp = self.config, self.backend, self.xp
        _, gh, gw = (int(g) for g in grid_thw)
        N, E, I, m = gh * gw, c.hidden_size, c.intermediate_size, c.spatial_merge_size
        if pixel_values.shape != (N, c.patch_dim) or gh % m or gw % m:
            raise ValueError(f"pixel values of shape {list(pixel_values.shape)} for a grid of "
                             f"{gh}x{gw} patches of {c.patch_dim} values (sides multiples of "
                             f"{m})")
        rows, cols = np.divmod(np.arange(N), gw)
        angles = np.concatenate([rows[:, None] * self.freq_rows, cols[:, None] * self.freq_cols],
                                1)
        rope = b.asarray(np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32))
        positions = b.asarray(np.arange(N, dtype=np.int32))
        cu = b.asarray(np.array([0, N], np.int32))

        act_dt = self.act
        embedded = xp.empty((N, E), act_dt)
        b.linear(b.asarray(np.ascontiguousarray(pixel_values).astype(act_dt)), self.patch_embed,
                 None, embedded)
        residual = xp.empty((N, E), act_dt)
        b.rms_norm(embedded, self.ln_pre, NORM_EPS, residual)
        hidden = xp.empty((N, E), act_dt)
        qkv = xp.empty((N, 3 * E), act_dt)
        q, k, v = (xp.empty((N, E), act_dt) for _ in range(3))
        attn = xp.empty((N, E), act_dt)
        attn_out = xp.empty((N, E), act_dt)
        gate_up = xp.empty((N, 2 * I), act_dt)
        act = xp.empty((N, I), act_dt)
        gate = xp.empty((N, I), act_dt) if c.hidden_act != "silu" else None
        D, H = c.head_dim, c.num_heads
        for i, layer in enumerate(self.layers):
            if i == 0:
                b.rms_norm(residual, layer["attention_norm"], NORM_EPS, hidden)
            else:
                b.fused_add_rms_norm(hidden, residual, layer["attention_norm"], NORM_EPS)
            b.linear(hidden, layer["qkv"], None, qkv)
            act_arrays.copy(xp, q, qkv[:, :E])
            act_arrays.copy(xp, k, qkv[:, E:2 * E])
            act_arrays.copy(xp, v, qkv[:, 2 * E:])
            b.rotary_embedding(positions, q, k, rope, D, True)
            b.encoder_attention(attn.reshape(N, H, D), q.reshape(N, H, D), k.reshape(N, H, D),
                                v.reshape(N, H, D), cu, D ** -0.5)
            b.linear(attn, layer["o"], None, attn_out)
            b.fused_add_rms_norm(attn_out, residual, layer["ffn_norm"], NORM_EPS)
            b.linear(attn_out, layer["gate_up"], None, gate_up)
            if c.hidden_act == "silu":
                b.silu_and_mul(gate_up, act)
            else:
                # no fused erf-GELU-and-mul op: GELU, then the product in float32
                act_arrays.copy(xp, gate, gate_up[:, :I])
                b.gelu(gate, act)
                up = as_float32(act_arrays.contiguous(xp, gate_up[:, I:]), xp)
                store(act, as_float32(act, xp) * up, xp)
            b.linear(act, layer["down"], None, hidden)
        # the last layer's output, through the projector's norm
        b.fused_add_rms_norm(hidden, residual, self.norm, c.projector_eps)
        R, C = gh // m, gw // m
        squares = act_arrays.contiguous(
            xp, hidden.reshape(R, m, C, m, E).transpose(0, 2, 1, 3, 4)).reshape(R * C, m * m * E)
        merged = xp.empty((R * C, E), act_dt)
        b.linear(squares, self.merging, None, merged)
        T = c.text_hidden_size
        x1 = xp.empty((R * C, T), act_dt)
        b.linear(merged, self.linear_1, self.bias_1, x1)
        g = xp.empty_like(x1)
        b.gelu(x1, g)
        features = xp.empty((R * C, T), np.float32)     # linear writes float32 too
        b.linear(g, self.linear_2, self.bias_2, features)
        out = xp.zeros((R, C + 1, T), np.float32)
        out[:, :C] = features.reshape(R, C, T)
        return out.reshape(R * (C + 1), T)

"""Qwen3-VL's vision tower over the backend's ops: patches -> language-model embeddings and the
DeepStack features.

The graph (transformers' Qwen3VLVisionModel, dense and MoE alike):
  patch embedding: the Conv3d (with a bias) as one matmul per patch (engine/vision/tower.py);
  learned position embeddings: a square grid of num_position_embeddings rows resampled to the
    image's patch grid bilinearly with aligned corners (each patch the weighted sum of four
    rows, weights in float32 as get_vision_interpolation_indices_and_weights computes them),
    added to the patch embeddings;
  2D rotary as Qwen2.5-VL's (the patch's row, then its column);
  blocks: x += attn(LayerNorm(x)), x += fc2(gelu(fc1(LayerNorm(x)))) (biases everywhere, tanh
    GELU); attention over each frame's patches (no windows);
  DeepStack: the output of each block in deepstack_visual_indexes through a merger of its own
    (merge group's rows concatenated, LayerNorm over them, Linear, exact GELU, Linear);
  merger: LayerNorm per patch, merge group's rows concatenated, Linear, exact GELU, Linear.
encode returns the merger's output and the DeepStack features side by side, (tokens,
(1 + len(deepstack_visual_indexes)) * out_hidden_size): one array per image, so the encoder
cache and a step's image rows carry them together; the model (engine/models/qwen3_vl.py) adds
feature j to the image rows after language-model layer j.
Residuals follow the decoder layers' convention (pyx/layers.pyx): `residual` holds the running
sum, the fused add-and-norm op adds the block's output into it, so after the add that folds in
block i's MLP output (the next block's first norm, or the merger's) `residual` is block i's
output, which is what a DeepStack merger reads.
"""
from __future__ import annotations

import numpy as np

from engine.vision import act_arrays
from engine.vision.config import VisionConfig
from engine.vision.tower import VisionTower, vision_position_ids

NORM_EPS = 1e-6      # the tower's LayerNorms (fixed in transformers' modeling code)
# Patch rows per MLP pass: its (rows, 2 x intermediate) buffers stay small for large images.
MLP_ROWS = 4096


def position_interpolation(grid_thw, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows (N, 4) int64 into the side x side position grid, their weights (N, 4) float32):
    bilinear with aligned corners, patches in merge-group order, as transformers'
    get_vision_interpolation_indices_and_weights (mode bilinear, align_corners True)."""
    indices, weights = [], []
    f32 = np.float32
    for t, h, w in grid_thw:
        pos = vision_position_ids([(1, h, w)], merge)
        taps, tap_weights = [], []
        for coord, size in ((pos[:, 0], h), (pos[:, 1], w)):
            src = coord.astype(f32) * f32(side - 1) / f32(max(size - 1, 1))
            floor = np.floor(src)
            offsets = np.arange(2)
            taps.append(np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1))
            distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(f32))
            tap_weights.append(np.maximum(f32(1) - distance, f32(0)))
        (ht, wt), (hw, ww) = taps, tap_weights
        idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
        wgt = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        indices.append(np.tile(idx, (t, 1)))
        weights.append(np.tile(wgt, (t, 1)))
    return np.concatenate(indices), np.concatenate(weights).astype(f32)


class Qwen3VisionEncoder(VisionTower):
    def __init__(self, config: VisionConfig, weights: dict, backend, prefix: str = "visual."):
        """Takes (pops) the tower's tensors, named `prefix`..., from `weights`."""
        super().__init__(config, weights, backend, prefix)
        c = config
        E, I, m = c.hidden_size, c.intermediate_size, c.spatial_merge_size
        self.patch_embed = self._patch_embedding()
        self.patch_embed_bias = self._take("patch_embed.proj.bias", (E,))
        P = c.num_position_embeddings
        self.side = int(P ** 0.5)
        table = np.asarray(self._pop("pos_embed.weight"))
        if table.shape != (P, E):
            raise ValueError(f"tensor {prefix}pos_embed.weight has shape {list(table.shape)}, "
                             f"expected {[P, E]}")
        # gathered and summed by the array library, not matmul'd: kept as plain float32
        self.pos_embed = backend.asarray(np.ascontiguousarray(table, np.float32))
        self.blocks = []
        for i in range(c.depth):
            p = f"blocks.{i}."
            self.blocks.append(dict(
                norm1=self._take(p + "norm1.weight", (E,)),
                norm1_bias=self._take(p + "norm1.bias", (E,)),
                norm2=self._take(p + "norm2.weight", (E,)),
                norm2_bias=self._take(p + "norm2.bias", (E,)),
                qkv=self._take(p + "attn.qkv.weight", (3 * E, E)),
                qkv_bias=self._take(p + "attn.qkv.bias", (3 * E,)),
                proj=self._take(p + "attn.proj.weight", (E, E)),
                proj_bias=self._take(p + "attn.proj.bias", (E,)),
                fc1=self._take(p + "mlp.linear_fc1.weight", (I, E)),
                fc1_bias=self._take(p + "mlp.linear_fc1.bias", (I,)),
                fc2=self._take(p + "mlp.linear_fc2.weight", (E, I)),
                fc2_bias=self._take(p + "mlp.linear_fc2.bias", (E,))))
        self.merger = self._merger("merger.", E)
        self.deepstack = {layer: self._merger(f"deepstack_merger_list.{j}.", E * m * m)
                          for j, layer in enumerate(c.deepstack_visual_indexes)}
        del self._weights

    def _merger(self, p: str, norm_size: int) -> dict:
        """A patch merger's weights; its LayerNorm over one patch (norm_size = hidden) or over
        the merge group's concatenated rows (the DeepStack mergers)."""
        c = self.config
        M = c.hidden_size * c.spatial_merge_size ** 2
        return dict(norm=self._take(p + "norm.weight", (norm_size,)),
                    norm_bias=self._take(p + "norm.bias", (norm_size,)),
                    fc1=self._take(p + "linear_fc1.weight", (M, M)),
                    fc1_bias=self._take(p + "linear_fc1.bias", (M,)),
                    fc2=self._take(p + "linear_fc2.weight", (c.out_hidden_size, M)),
                    fc2_bias=self._take(p + "linear_fc2.bias", (c.out_hidden_size,)))

    def _merge(self, merger: dict, grouped, out) -> None:
        """out = fc2(gelu(fc1(grouped))): grouped (tokens, hidden * merge^2), normalised."""
        b, xp = self.backend, self.xp
        fc1 = xp.empty_like(grouped)
        b.linear(grouped, merger["fc1"], merger["fc1_bias"], fc1)
        act = xp.empty_like(fc1)
        b.gelu(fc1, act)
        b.linear(act, merger["fc2"], merger["fc2_bias"], out)

    def _mlp(self, blk: dict, x, bufs: dict, out) -> None:
        """out = fc2(act(fc1(x))), MLP_ROWS rows at a time. The tanh GELU goes through the gated
        op with a gate of ones (gelu_tanh(a) * 1 is gelu_tanh(a) exactly): the op table has no
        ungated one."""
        b, xp = self.backend, self.xp
        I = self.config.intermediate_size
        for a in range(0, x.shape[0], MLP_ROWS):
            rows = slice(a, min(a + MLP_ROWS, x.shape[0]))
            n = rows.stop - a
            fc1, act = bufs["fc1"][:n], bufs["act"][:n]
            b.linear(x[rows], blk["fc1"], blk["fc1_bias"], fc1)
            if self.config.hidden_act == "gelu":
                b.gelu(fc1, act)
            else:
                gated = bufs["gated"][:n]
                act_arrays.copy(xp, gated[:, :I], fc1)
                b.gelu_tanh_and_mul(gated, act)
            b.linear(act, blk["fc2"], blk["fc2_bias"], out[rows])

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]):
        """One image's patches (t*h*w, patch_dim) float32 -> (t*h*w / merge^2,
        (1 + DeepStack features) * out_hidden_size) on the backend: its language-model
        embeddings, then each DeepStack feature (module docstring)."""
        c, b, xp = self.config, self.backend, self.xp
        grid = tuple(int(g) for g in grid_thw)
        N, E, I, m = int(np.prod(grid)), c.hidden_size, c.intermediate_size, c.spatial_merge_size
        unit = m * m
        if pixel_values.shape != (N, c.patch_dim):
            raise ValueError(f"pixel values of shape {list(pixel_values.shape)} for a grid of "
                             f"{list(grid)} patches of {c.patch_dim} values")
        rope = self.rotary_table(vision_position_ids([grid], m))
        positions = b.asarray(np.arange(N, dtype=np.int32))
        t, h, w = grid
        cu_frames = b.asarray(np.arange(t + 1, dtype=np.int32) * (h * w))
        rows, weights = position_interpolation([grid], self.side, m)

        # patch embeddings and position rows summed in float32, then rounded to the activations
        embedded = xp.empty((N, E), np.float32)
        b.linear(self._patches(pixel_values), self.patch_embed, self.patch_embed_bias, embedded)
        # the four taps' weighted rows summed one tap at a time: an (N, 4, hidden) gather would
        # hold four copies of the image's activations
        rows, weights = b.asarray(rows), b.asarray(weights)
        pos = self.pos_embed[rows[:, 0]] * weights[:, :1]
        for tap in range(1, 4):
            pos += self.pos_embed[rows[:, tap]] * weights[:, tap:tap + 1]
        embedded += pos
        del pos
        residual = act_arrays.rounded(xp, embedded, self.act)
        hidden = xp.empty((N, E), self.act)
        attn_out = xp.empty((N, E), self.act)
        bufs = self._attention_buffers(N)
        R = min(N, MLP_ROWS)
        mlp_bufs = dict(fc1=xp.empty((R, I), self.act), act=xp.empty((R, I), self.act))
        if c.hidden_act != "gelu":     # (made on the host: CuPy cannot fill bfloat16)
            mlp_bufs["gated"] = b.asarray(np.ones((R, 2 * I), self.act))
        out = xp.empty((N // unit, (1 + len(self.deepstack)) * c.out_hidden_size), np.float32)
        features = {layer: out[:, (j + 1) * c.out_hidden_size:(j + 2) * c.out_hidden_size]
                    for j, layer in enumerate(c.deepstack_visual_indexes)}

        def deepstack(layer: int):
            """Block `layer`'s output, now in `residual`, through its DeepStack merger."""
            if layer not in self.deepstack:
                return
            merger = self.deepstack[layer]
            grouped = xp.empty((N // unit, unit * E), self.act)
            b.layer_norm(residual.reshape(N // unit, unit * E), merger["norm"],
                         merger["norm_bias"], NORM_EPS, grouped)
            feature = xp.empty((N // unit, c.out_hidden_size), np.float32)
            self._merge(merger, grouped, feature)
            xp.copyto(features[layer], feature)

        for i, blk in enumerate(self.blocks):
            if i == 0:
                b.layer_norm(residual, blk["norm1"], blk["norm1_bias"], NORM_EPS, hidden)
            else:
                b.fused_add_layer_norm(hidden, residual, blk["norm1"], blk["norm1_bias"],
                                       NORM_EPS)
                deepstack(i - 1)
            self._attention(blk, hidden, rope, positions, cu_frames, bufs, attn_out)
            b.fused_add_layer_norm(attn_out, residual, blk["norm2"], blk["norm2_bias"], NORM_EPS)
            self._mlp(blk, attn_out, mlp_bufs, hidden)
        b.fused_add_layer_norm(hidden, residual, self.merger["norm"], self.merger["norm_bias"],
                               NORM_EPS)
        deepstack(c.depth - 1)
        merged = xp.empty((N // unit, c.out_hidden_size), np.float32)
        self._merge(self.merger, hidden.reshape(N // unit, unit * E), merged)
        xp.copyto(out[:, :c.out_hidden_size], merged)
        return out

"""Qwen2.5-VL's vision tower over the backend's ops: patches -> language-model embeddings.

The graph (transformers' Qwen2_5_VisionTransformerPretrainedModel):
  patch embedding: a Conv3d whose kernel equals its stride, so one matmul of each patch's
    channels x temporal x patch x patch values with the flattened kernel;
  rows reordered into windows of (window_size / patch / merge)^2 merge groups (a merge group is
    merge x merge patches, contiguous since the processor's patch order);
  2D rotary: each head's first half rotates by the patch's row, the second by its column
    (frequencies over head_dim / 2), halves rotated as in rotate_half;
  blocks: x += attn(rms_norm(x)), x += SwiGLU MLP (biases everywhere)(rms_norm(x)); attention is
    bidirectional within a window, or within the whole image in the fullatt_block_indexes blocks;
  merger: RMSNorm, each merge group's rows concatenated, Linear, GELU (erf), Linear; rows
    returned to the image's order.
Residuals follow the decoder layers' convention (pyx/layers.pyx): `residual` holds the running
sum, the fused add-and-norm op adds the block's output into it.
"""
from __future__ import annotations

import numpy as np

from engine.vision.config import VisionConfig
from engine.vision.tower import VisionTower, vision_position_ids

NORM_EPS = 1e-6      # the tower's RMSNorms (fixed in transformers' modeling code)


def window_index(grid_thw, merge: int, window_size: int, patch: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(merge groups in window order (N / merge^2,) int64, window boundaries in patch rows
    (W+1,) int32), as transformers' get_vision_window_index."""
    side = window_size // merge // patch
    unit = merge * merge
    indexes, cu, base = [], [0], 0
    for t, h, w in grid_thw:
        lh, lw = h // merge, w // merge
        pad_h, pad_w = side - lh % side, side - lw % side
        nh, nw = (lh + pad_h) // side, (lw + pad_w) // side
        padded = np.full((t, lh + pad_h, lw + pad_w), -1, np.int64)
        padded[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw)
        padded = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(
            t, nh * nw, side * side)
        seqlens = (padded >= 0).sum(axis=2).reshape(-1)
        flat = padded.reshape(-1)
        indexes.append(flat[flat >= 0] + base)
        cu.extend((np.cumsum(seqlens) * unit + cu[-1]).tolist())
        base += t * lh * lw
    cu = np.array(cu, np.int64)
    keep = np.concatenate([[True], cu[1:] != cu[:-1]])
    return np.concatenate(indexes), cu[keep].astype(np.int32)


class Qwen25VisionEncoder(VisionTower):
    def __init__(self, config: VisionConfig, weights: dict, backend, prefix: str = "visual."):
        """Takes (pops) the tower's tensors, named `prefix`..., from `weights`."""
        super().__init__(config, weights, backend, prefix)
        c = config
        E, I = c.hidden_size, c.intermediate_size
        self.patch_embed = self._patch_embedding()
        self.blocks = []
        for i in range(c.depth):
            p = f"blocks.{i}."
            self.blocks.append(dict(
                norm1=self._take(p + "norm1.weight", (E,)),
                norm2=self._take(p + "norm2.weight", (E,)),
                qkv=self._take(p + "attn.qkv.weight", (3 * E, E)),
                qkv_bias=self._take(p + "attn.qkv.bias", (3 * E,)),
                proj=self._take(p + "attn.proj.weight", (E, E)),
                proj_bias=self._take(p + "attn.proj.bias", (E,)),
                gate_up=self._fuse([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                   (I, E)),
                gate_up_bias=self._fuse([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"],
                                        (I,)),
                down=self._take(p + "mlp.down_proj.weight", (E, I)),
                down_bias=self._take(p + "mlp.down_proj.bias", (E,)),
                full=i in c.fullatt_block_indexes))
        M = E * c.spatial_merge_size ** 2
        self.ln_q = self._take("merger.ln_q.weight", (E,))
        self.fc1 = self._take("merger.mlp.0.weight", (M, M))
        self.fc1_bias = self._take("merger.mlp.0.bias", (M,))
        self.fc2 = self._take("merger.mlp.2.weight", (c.out_hidden_size, M))
        self.fc2_bias = self._take("merger.mlp.2.bias", (c.out_hidden_size,))
        del self._weights

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]):
        """One image's patches (t*h*w, patch_dim) float32 -> its language-model embeddings
        (t*h*w / merge^2, out_hidden_size), on the backend."""
        c, b, xp = self.config, self.backend, self.xp
        grids = [tuple(int(g) for g in grid_thw)]
        N, E, m = int(np.prod(grids[0])), c.hidden_size, c.spatial_merge_size
        unit = m * m
        if pixel_values.shape != (N, c.patch_dim):
            raise ValueError(f"pixel values of shape {list(pixel_values.shape)} for a grid of "
                             f"{list(grids[0])} patches of {c.patch_dim} values")
        order, cu_window = window_index(grids, m, c.window_size, c.patch_size)
        cu_full = np.array([0, N], np.int32)
        # rows in window order, and their rotary angles with them
        rows = (order[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
        rope = self.rotary_table(vision_position_ids(grids, m)[rows])
        positions = b.asarray(np.arange(N, dtype=np.int32))
        cu_window, cu_full = b.asarray(cu_window), b.asarray(cu_full)

        embedded = xp.empty((N, E), self.act)
        b.linear(self._patches(pixel_values[rows]), self.patch_embed, None, embedded)
        residual = embedded
        hidden = xp.empty((N, E), self.act)
        bufs = self._attention_buffers(N)
        attn_out = xp.empty((N, E), self.act)
        gate_up = xp.empty((N, 2 * c.intermediate_size), self.act)
        act = xp.empty((N, c.intermediate_size), self.act)
        for i, blk in enumerate(self.blocks):
            if i == 0:
                b.rms_norm(residual, blk["norm1"], NORM_EPS, hidden)
            else:
                b.fused_add_rms_norm(hidden, residual, blk["norm1"], NORM_EPS)
            self._attention(blk, hidden, rope, positions, cu_full if blk["full"] else cu_window,
                            bufs, attn_out)
            b.fused_add_rms_norm(attn_out, residual, blk["norm2"], NORM_EPS)
            b.linear(attn_out, blk["gate_up"], blk["gate_up_bias"], gate_up)
            b.silu_and_mul(gate_up, act)
            b.linear(act, blk["down"], blk["down_bias"], hidden)
        b.fused_add_rms_norm(hidden, residual, self.ln_q, NORM_EPS)
        grouped = hidden.reshape(N // unit, unit * E)
        fc1 = xp.empty_like(grouped)
        b.linear(grouped, self.fc1, self.fc1_bias, fc1)
        gelu = xp.empty_like(fc1)
        b.gelu(fc1, gelu)
        out = xp.empty((N // unit, c.out_hidden_size), np.float32)   # linear writes float32 too
        b.linear(gelu, self.fc2, self.fc2_bias, out)
        return out[b.asarray(np.argsort(order))]

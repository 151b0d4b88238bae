"""What the Qwen vision towers share (Qwen2.5-VL's engine/vision/qwen2_5_vl_encoder.py, Qwen3-VL's
engine/vision/qwen3_vl_encoder.py): their tensors taken from the checkpoint with the shapes
checked, each patch's (row, column) in the processor's patch order, the 2D rotary table those
positions give, and the attention block (fused biased qkv, rotary, attention within segments,
output projection).

The towers compute in the backend's activation dtype (`act`: float32 on the CPU, the CUDA
backend's bf16, f16 or f32) and return float32 embeddings; engine/vision/act_arrays.py moves
their arrays, as CuPy has no bfloat16 kernels."""
from __future__ import annotations

import numpy as np

from engine.vision import act_arrays


def vision_position_ids(grid_thw, merge: int) -> np.ndarray:
    """(N, 2) int64: each patch's (row, column), patches in merge-group order."""
    out = []
    for t, h, w in grid_thw:
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], axis=1), (t, 1)))
    return np.concatenate(out)


class VisionTower:
    """A vision tower's weights on the backend, taken (popped) from the checkpoint's tensors
    named `prefix`...; subclasses build their graph from them in __init__ and run it in
    encode(pixel_values, grid_thw)."""

    def __init__(self, config, weights: dict, backend, prefix: str):
        self.config = c = config
        self.backend, self.xp = backend, backend.xp
        self.act = np.dtype(backend.act_dtype)
        self.prefix = prefix
        self._weights = weights
        spatial = c.head_dim // 2
        # the 2D rotary: head_dim / 4 frequencies each for the patch's row and its column
        self.inv_freq = 1.0 / c.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float64) / spatial)

    def _pop(self, name: str):
        key = self.prefix + name
        if key not in self._weights:
            raise ValueError(f"vision tower tensor {key} is missing from the checkpoint")
        return self._weights.pop(key)

    def _take(self, name: str, shape: tuple):
        w = np.asarray(self._pop(name))
        if w.shape != shape:
            raise ValueError(f"tensor {self.prefix}{name} has shape {list(w.shape)}, expected "
                             f"{list(shape)}")
        if w.ndim == 1:       # norms and biases are read in float32
            w = w.astype(np.float32)
        return self.backend.place_weight(np.ascontiguousarray(w))

    def _fuse(self, names: list[str], shape: tuple):
        parts = []
        for n in names:
            w = np.asarray(self._pop(n))
            if w.shape != shape:
                raise ValueError(f"tensor {self.prefix}{n} has shape {list(w.shape)}, expected "
                                 f"{list(shape)}")
            parts.append(w.astype(np.float32) if w.ndim == 1 else w)
        return self.backend.place_weight(np.ascontiguousarray(np.concatenate(parts)))

    def _patch_embedding(self):
        """The Conv3d whose kernel equals its stride, as one (hidden, patch_dim) matrix."""
        c = self.config
        E = c.hidden_size
        conv = np.asarray(self._pop("patch_embed.proj.weight"))
        if conv.shape != (E, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size):
            expected = [E, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size]
            raise ValueError(f"vision patch embedding has shape {list(conv.shape)}, expected "
                             f"{expected}")
        return self.backend.place_weight(np.ascontiguousarray(conv.reshape(E, -1)))

    def rotary_table(self, positions: np.ndarray):
        """(N, head_dim) float32 on the backend, cos then sin of the angles (row x the
        frequencies, column x the frequencies): rotary_embedding's cache, one row per patch."""
        angles = np.concatenate([positions[:, :1] * self.inv_freq,
                                 positions[:, 1:] * self.inv_freq], 1)
        return self.backend.asarray(
            np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32))

    def _attention_buffers(self, N: int) -> dict:
        E, xp = self.config.hidden_size, self.xp
        return dict(qkv=xp.empty((N, 3 * E), self.act),
                    **{n: xp.empty((N, E), self.act) for n in ("q", "k", "v", "attn")})

    def _patches(self, pixel_values):
        """A numpy (N, patch_dim) array on the backend in the activation dtype."""
        return self.backend.asarray(np.ascontiguousarray(pixel_values).astype(self.act))

    def _attention(self, blk: dict, x, rope, positions, cu_seqlens, bufs: dict, out) -> None:
        """out = proj(attention(q, k, v)) of x (N, hidden): q, k, v from the block's fused qkv
        (biased), q and k rotated by the rows of `rope`, every row attending to the rows of its
        segment of cu_seqlens."""
        c, b, xp = self.config, self.backend, self.xp
        N, E, D, H = x.shape[0], c.hidden_size, c.head_dim, c.num_heads
        qkv, q, k, v, attn = (bufs[n] for n in ("qkv", "q", "k", "v", "attn"))
        b.linear(x, blk["qkv"], blk["qkv_bias"], qkv)
        act_arrays.copy(xp, q, qkv[:, :E])
        act_arrays.copy(xp, k, qkv[:, E:2 * E])
        act_arrays.copy(xp, v, qkv[:, 2 * E:])
        b.rotary_embedding(positions, q, k, rope, D, True)
        b.encoder_attention(attn.reshape(N, H, D), q.reshape(N, H, D), k.reshape(N, H, D),
                            v.reshape(N, H, D), cu_seqlens, D ** -0.5)
        b.linear(attn, blk["proj"], blk["proj_bias"], out)

    def num_tokens(self, grid_thw) -> int:
        return int(np.prod(grid_thw)) // self.config.spatial_merge_size ** 2

"""FP8 (OCP e4m3) weights as the model graph sees them.

An `Fp8Weight` stands where a float (N, K) matrix would: it has `.shape`, and the CPU backend's
`linear` runs pyx/fp8_kernels.c on its 1-byte codes with the block scales applied inside the
kernel (activations stay f32). One layout covers every FP8 checkpoint
flavour: codes (N, K) and one f32 scale per (bn x bk) block --
  block-wise (quant_method fp8 with weight_block_size, DeepSeek-V3 / Qwen3-FP8): bn x bk = 128 x 128,
  per-channel (compressed-tensors strategy "channel"): bn = 1, bk = K,
  per-tensor (strategy "tensor", quant_method fp8 without blocks): stored per channel, so that
  q/k/v or gate/up with different scales fuse by stacking rows.
The raw tensors stay as they are (codes are the checkpoint's F8_E4M3 bytes, scales its numbers) for
the GPU issue's CUTLASS path; `kind` says which flavour they came from.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(slots=True)
class Fp8Weight:
    weight: np.ndarray                  # (N, K) uint8: e4m3 codes
    scale: np.ndarray                   # (N // bn, ceil(K / bk)) float32: value = decode(code) * scale
    block: tuple[int, int]              # (bn, bk)
    kind: str = "block"                 # "block" | "channel" (per-tensor scales are stored per channel)
    input_scale: np.ndarray | None = None  # static activation scales, one per fused part (not used on CPU)

    def __post_init__(self):
        if self.weight.dtype.name == "float8_e4m3fn":
            self.weight = self.weight.view(np.uint8)
        if self.weight.dtype != np.uint8 or self.weight.ndim != 2:
            raise ValueError(f"FP8 weight codes must be a uint8 or float8_e4m3fn matrix, got "
                             f"{self.weight.dtype} {self.weight.shape}")
        self.weight = np.ascontiguousarray(self.weight)
        self.scale = np.ascontiguousarray(self.scale, dtype=np.float32)
        n, k = self.weight.shape
        bn, bk = self.block
        if n % bn or self.scale.shape != (n // bn, -(-k // bk)):
            raise ValueError(f"FP8 weight {self.weight.shape} with block {self.block} needs scales "
                             f"{(n // bn, -(-k // bk))}, got {self.scale.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @classmethod
    def concat(cls, weights: list["Fp8Weight"]) -> "Fp8Weight":
        """Stack along N (q/k/v, gate/up): codes and scale rows stack as they are, since every
        part's N is a multiple of its row block."""
        first = weights[0]
        for w in weights[1:]:
            if w.block != first.block or w.shape[1] != first.shape[1] or w.kind != first.kind:
                raise ValueError("FP8 weights to fuse need the same K, block and kind: "
                                 + ", ".join(f"{w.shape} {w.block} {w.kind}" for w in weights))
        inputs = [w.input_scale for w in weights]
        input_scale = (None if any(s is None for s in inputs)
                       else np.concatenate([np.ravel(s) for s in inputs]).astype(np.float32))
        return cls(np.concatenate([w.weight for w in weights]),
                   np.concatenate([w.scale for w in weights]), first.block, first.kind, input_scale)

    def dequantize(self) -> np.ndarray:
        """(N, K) float32 (tests, debugging)."""
        bn, bk = self.block
        n, k = self.shape
        s = np.repeat(np.repeat(self.scale, bn, 0), bk, 1)[:n, :k]
        return (self.weight.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).astype(np.float32)

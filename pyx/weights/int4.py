"""Weights kept as packed 4-bit codes (GPTQ, AWQ, compressed-tensors W4A16), as the model graph
sees them.

An `Int4Weight` stands where a float (N, K) matrix would: it has `.shape`, the CPU backend's
`linear` computes on its parts (pyx/cpu_int4.py) and the CUDA backend repacks it to the Marlin
layout (pyx/weights/marlin.py). It is a stack of parts along N in the canonical layout of
pyx/int4_kernels.h (codes (n, K/2) uint8, scales and zeros (n, K/G) float32), one group size per
part: fusing q/k/v or gate/up can meet layers quantized with different group sizes. `sources`
keeps every checkpoint layer's own tensors, untouched and in N order, for the GPU issue's Marlin
repacking.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyx.int4 import int4_dequantize


@dataclass(slots=True)
class Int4Part:
    qs: np.ndarray          # (n, K/2) uint8, nibble order of pyx/int4_kernels.h
    scales: np.ndarray      # (n, K/G) float32
    zeros: np.ndarray       # (n, K/G) float32
    group_size: int         # G (K for per-channel)

    @classmethod
    def from_codes(cls, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
                   group_size: int) -> "Int4Part":
        """codes (n, K) in 0..15 -> the packed layout: in each run of 32, byte j holds code j
        (low nibble) and code 16 + j (high nibble)."""
        n, k = codes.shape
        blocks = np.asarray(codes, np.uint8).reshape(n, k // 32, 2, 16)
        qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)
        return cls(np.ascontiguousarray(qs), np.ascontiguousarray(scales, np.float32),
                   np.ascontiguousarray(zeros, np.float32), int(group_size))

    @classmethod
    def from_words(cls, words: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
                   group_size: int) -> "Int4Part":
        """words (n, K/8) int32 with codes along K (code 8w + i in bits 4i..4i+3 of word w: GPTQ's
        qweight transposed, compressed-tensors' weight_packed) -> the packed layout, byte-wise
        without unpacking. As little-endian bytes, a run of 32 codes is 8 bytes A holding codes
        0..15 and 8 bytes B holding 16..31, byte m of each holding codes 2m (low) and 2m + 1
        (high); packed byte 2m is then (A[m] & 15) | B[m] << 4 and byte 2m + 1 is
        A[m] >> 4 | (B[m] & 0xF0)."""
        n = words.shape[0]
        b = np.ascontiguousarray(words).view(np.uint8).reshape(n, -1, 2, 8)
        lo, hi = b[:, :, 0], b[:, :, 1]
        qs = np.empty((n, b.shape[1], 8, 2), np.uint8)
        np.bitwise_or(lo & 15, hi << 4, out=qs[..., 0])
        np.bitwise_or(lo >> 4, hi & 0xF0, out=qs[..., 1])
        return cls(qs.reshape(n, -1), np.ascontiguousarray(scales, np.float32),
                   np.ascontiguousarray(zeros, np.float32), int(group_size))

    @property
    def rows(self) -> int:
        return self.qs.shape[0]

    def codes(self) -> np.ndarray:
        """(n, K) uint8 codes back from the packed bytes."""
        n, half = self.qs.shape
        b = self.qs.reshape(n, half // 16, 1, 16)
        return np.concatenate([b & 15, b >> 4], axis=2).reshape(n, 2 * half)


@dataclass(slots=True)
class Int4Source:
    """One checkpoint layer as stored, for the GPU repack."""
    name: str                       # e.g. model.layers.0.self_attn.q_proj
    format: str                     # "gptq" (v1), "gptq_v2", "awq" (GEMM), "pack-quantized"
    tensors: dict                   # its tensors by suffix (qweight, qzeros, scales, g_idx, ...)
    group_size: int                 # G (K for per-channel)
    symmetric: bool
    shape: tuple[int, int]          # (N, K)


@dataclass(slots=True)
class Int4Weight:
    parts: list[Int4Part]
    k: int
    sources: list[Int4Source] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.rows for p in self.parts), self.k

    @property
    def nbytes(self) -> int:
        return sum(p.qs.nbytes + p.scales.nbytes + p.zeros.nbytes for p in self.parts)

    @staticmethod
    def concat(weights: list["Int4Weight"]) -> "Int4Weight":
        """Stack along N; neighbouring parts with one group size merge into one."""
        k = weights[0].k
        if any(w.k != k for w in weights):
            raise ValueError("int4 weights to fuse must have the same row length")
        runs: list[list[Int4Part]] = []
        for w in weights:
            for p in w.parts:
                if runs and runs[-1][0].group_size == p.group_size:
                    runs[-1].append(p)
                else:
                    runs.append([p])
        parts = [r[0] if len(r) == 1 else
                 Int4Part(np.concatenate([p.qs for p in r]), np.concatenate([p.scales for p in r]),
                          np.concatenate([p.zeros for p in r]), r[0].group_size)
                 for r in runs]
        return Int4Weight(parts, k, [s for w in weights for s in w.sources])

    def dequantize(self, isa: str = "scalar", num_threads: int = 1) -> np.ndarray:
        """(N, K) float32; isa "scalar" is the kernels' reference."""
        return np.concatenate([int4_dequantize(isa, p.qs, p.scales, p.zeros, p.group_size,
                                               num_threads=num_threads) for p in self.parts])

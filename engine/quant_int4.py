"""Weights kept as packed 4-bit codes (GPTQ, AWQ, compressed-tensors W4A16), as the model graph
sees them.

An `Int4Weight` stands where a float (N, K) matrix would: it has `.shape`, and the CPU backend's
`linear` calls its `cpu_linear`. It is a stack of parts along N in the canonical layout of
pyx/int4_kernels.h (codes (n, K/2) uint8, scales and zeros (n, K/G) float32), one group size per
part: fusing q/k/v or gate/up can meet layers quantized with different group sizes. `sources`
keeps every checkpoint layer's own tensors, untouched and in N order, for the GPU issue's Marlin
repacking.

Up to GEMV_MAX_T token rows the int4 kernel decodes codes in registers and feeds them to the
tokens at once (decode reads a quarter of the bytes of bf16). Beyond that, long prefills, each
panel of rows is dequantized to float32 once and goes through the backend's dense GEMM, whose
cache blocking beats re-decoding the codes for every 4 tokens.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

# Token rows up to which the int4 kernel beats dequantize + dense GEMM, per ISA. Measured on one
# core (4864x896, 896x4864, 4096x4096, group 128): AVX2 breaks even at 16 and is 1.5x slower at
# 64; AVX-512 breaks even between 64 and 128 (its table lookup decodes 32 codes in 4 ops).
GEMV_MAX_T = {"scalar": 16, "avx2": 16, "avx512": 64}
# Rows per dequantized panel on the GEMM path: at most this many bytes of float32.
PANEL_BYTES = 8 << 20

_scratch = threading.local()


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
        from pyx.int4 import int4_dequantize
        return np.concatenate([int4_dequantize(isa, p.qs, p.scales, p.zeros, p.group_size,
                                               num_threads=num_threads) for p in self.parts])

    def marlin(self):
        """The same weight in the Marlin layout the CUDA backend's W4A16 GEMM reads
        (engine/marlin.py)."""
        from engine.marlin import repack_int4
        return repack_int4(self)

    def cpu_linear(self, backend, x, bias, out) -> None:
        """out = x @ W.T (+ bias) for the CPU backend's `linear`."""
        n, k = self.shape
        if not (isinstance(x, np.ndarray) and isinstance(out, np.ndarray) and x.ndim == 2
                and out.ndim == 2 and x.shape[1] == k and out.shape == (x.shape[0], n)):
            raise ValueError(f"linear: int4 weight {self.shape} does not map x "
                             f"{getattr(x, 'shape', x)} to out {getattr(out, 'shape', out)}")
        # Batch-invariant mode: the dense GEMM for every T (the int4 dot-product kernel of small
        # T sums in another order, so a row's bits would depend on T).
        invariant = getattr(backend, "batch_invariant", False)
        if x.shape[0] > GEMV_MAX_T.get(backend.isa, 16) or invariant:
            return self._dequant_gemm(backend, x, bias, out)
        from pyx.int4 import int4_linear
        col = 0
        for p in self.parts:
            b = None if bias is None else bias[col:col + p.rows]
            int4_linear(backend.isa, x, p.qs, p.scales, p.zeros, p.group_size, b, out, col,
                        backend.num_threads)
            col += p.rows

    def _dequant_gemm(self, backend, x, bias, out) -> None:
        """Panels of rows dequantized to float32 (per-thread scratch), each through the backend's
        dense linear; a panel that is not all of out lands in a temporary and is copied in."""
        from pyx.int4 import int4_dequantize
        T, (N, K) = x.shape[0], self.shape
        step = max(32, PANEL_BYTES // (4 * K) // 32 * 32)
        col = 0
        for p in self.parts:
            for r0 in range(0, p.rows, step):
                r1 = min(p.rows, r0 + step)
                w = _buffer("w", (r1 - r0, K))
                int4_dequantize(backend.isa, p.qs[r0:r1], p.scales[r0:r1], p.zeros[r0:r1],
                                p.group_size, w, backend.num_threads)
                b = None if bias is None else bias[col:col + r1 - r0]
                if r1 - r0 == N:
                    backend.linear(x, w, b, out)
                else:
                    tmp = _buffer("out", (T, r1 - r0))
                    backend.linear(x, w, b, tmp)
                    out[:, col:col + r1 - r0] = tmp
                col += r1 - r0


def _buffer(name: str, shape: tuple[int, int]) -> np.ndarray:
    """A float32 scratch array of `shape`, reused by this thread across calls."""
    size = shape[0] * shape[1]
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, np.float32)
        setattr(_scratch, name, buf)
    return buf[:size].reshape(shape)

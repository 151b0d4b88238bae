"""The CPU backend's `linear` on an Int4Weight (pyx/weights/int4.py): which kernel of pyx/int4.pyx
runs, part by part (each part one group size, writing its column slice of out).

Up to GEMV_MAX_T token rows the int4 kernel decodes codes in registers and feeds them to the
tokens at once (decode reads a quarter of the bytes of bf16). Beyond that, long prefills, each
panel of rows is dequantized to float32 once and goes through the backend's dense GEMM, whose
cache blocking beats re-decoding the codes for every 4 tokens. In batch-invariant mode every T
takes the panels (the int4 dot-product kernel of small T sums in another order, so a row's bits
would depend on T).
"""
from __future__ import annotations

import threading

import numpy as np

from pyx.int4 import int4_dequantize, int4_linear

# Token rows up to which the int4 kernel beats dequantize + dense GEMM, per ISA. Measured on one
# core (4864x896, 896x4864, 4096x4096, group 128): AVX2 breaks even at 16 and is 1.5x slower at
# 64; AVX-512 breaks even between 64 and 128 (its table lookup decodes 32 codes in 4 ops).
GEMV_MAX_T = {"scalar": 16, "avx2": 16, "avx512": 64}
# Rows per dequantized panel on the GEMM path: at most this many bytes of float32.
PANEL_BYTES = 8 << 20

_scratch = threading.local()


def linear(backend, weight, x, bias, out) -> None:
    """out = x @ W.T (+ bias) for CpuBackend.linear; `backend` gives the ISA, the threads, the
    batch-invariant switch and the dense GEMM of the panel path."""
    n, k = weight.shape
    if not (isinstance(x, np.ndarray) and isinstance(out, np.ndarray) and x.ndim == 2
            and out.ndim == 2 and x.shape[1] == k and out.shape == (x.shape[0], n)):
        raise ValueError(f"linear: int4 weight {weight.shape} does not map x "
                         f"{getattr(x, 'shape', x)} to out {getattr(out, 'shape', out)}")
    if x.shape[0] > GEMV_MAX_T.get(backend.isa, 16) or backend.batch_invariant:
        return _dequant_gemm(backend, weight, x, bias, out)
    col = 0
    for p in weight.parts:
        b = None if bias is None else bias[col:col + p.rows]
        int4_linear(backend.isa, x, p.qs, p.scales, p.zeros, p.group_size, b, out, col,
                    backend.num_threads)
        col += p.rows


def _dequant_gemm(backend, weight, x, bias, out) -> None:
    """Panels of rows dequantized to float32 (per-thread scratch), each through the backend's
    dense linear; a panel that is not all of out lands in a temporary and is copied in."""
    T, (N, K) = x.shape[0], weight.shape
    step = max(32, PANEL_BYTES // (4 * K) // 32 * 32)
    col = 0
    for p in weight.parts:
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

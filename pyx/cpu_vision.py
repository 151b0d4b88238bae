"""The CPU backend's ops for vision encoders, in NumPy: exact (erf) GELU and bidirectional
attention over packed segments (a ViT's windows or whole images). Encoder work is a few large
matrix products per image, which NumPy's BLAS does well; nothing here is on the decode path.
"""
from __future__ import annotations

import numpy as np

# Rows of queries per attention chunk: bounds the (heads, rows, keys) score block.
_SCORE_BLOCK_ELEMS = 1 << 24


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc in float64 with fractional error under 1.2e-7 everywhere (Numerical Recipes'
    Chebyshev fit, erfcc): float32's rounding is 6e-8."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    ans = t * np.exp(-z * z + poly)
    return np.where(x >= 0, ans, 2.0 - ans)


def gelu(x: np.ndarray, out: np.ndarray) -> None:
    """out = x * Phi(x) = 0.5 * x * erfc(-x / sqrt(2)) (torch.nn.GELU()), in float64."""
    x64 = x.astype(np.float64)
    out[...] = 0.5 * x64 * _erfc(-x64 * 0.7071067811865476)


def encoder_attention(out, q, k, v, cu_seqlens, scale: float) -> None:
    """For each segment s, rows [cu_seqlens[s], cu_seqlens[s+1]) attend to all rows of their
    segment: softmax(scale * q k^T) v per head, in float32. Segments of one length go through
    batched matrix products together; long ones in blocks of query rows."""
    N, Hh, D = q.shape
    starts = cu_seqlens[:-1].astype(np.int64)
    lengths = np.diff(cu_seqlens).astype(np.int64)
    for length in np.unique(lengths):
        if length == 0:
            continue
        L = int(length)
        seg = starts[lengths == length]
        rows = seg[:, None] + np.arange(L)[None, :]                 # (S, L)
        qs = q[rows].transpose(0, 2, 1, 3)                           # (S, Hh, L, D)
        ks = k[rows].transpose(0, 2, 3, 1)                           # (S, Hh, D, L)
        vs = v[rows].transpose(0, 2, 1, 3)                           # (S, Hh, L, D)
        step = max(1, _SCORE_BLOCK_ELEMS // max(1, len(seg) * Hh * L))
        for a in range(0, L, step):
            scores = np.matmul(qs[:, :, a:a + step], ks) * np.float32(scale)
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            o = np.matmul(scores, vs)                                # (S, Hh, l, D)
            out[rows[:, a:a + step]] = o.transpose(0, 2, 1, 3)

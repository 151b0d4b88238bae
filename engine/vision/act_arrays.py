"""The vision code's array moves in the backend's activation dtype, the same on both backends.

The towers run in the backend's activation dtype (float32 on the CPU; bf16, f16 or f32 on
CUDA, where every op takes activations in that dtype) and return float32 embeddings (the
`linear` op writes float32 on both). CuPy keeps ml_dtypes' bfloat16 bits but has no kernels
for them: no copy, gather, scatter or cast. So copies and row moves go through an unsigned
integer view of the same width, and the rounding of float32 to bfloat16 through its bits
(pyx/gated_delta_net.py's store, to nearest even as torch rounds). On float32 arrays each of
these is exactly the plain NumPy statement it replaces.
"""
from __future__ import annotations

import numpy as np

from pyx.gated_delta_net import as_float32, store


def bits(a):
    """a viewed as unsigned integers of its element's width (no copy)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def copy(xp, dst, src) -> None:
    """dst[...] = src, arrays of one dtype (either may be a strided view)."""
    if dst.dtype != src.dtype:
        raise ValueError(f"copy: {src.dtype} into {dst.dtype}")
    xp.copyto(bits(dst), bits(src))


def contiguous(xp, a):
    """A C-contiguous copy of `a` (any strides), in its dtype."""
    return xp.ascontiguousarray(bits(a)).view(a.dtype)


def rounded(xp, x, dtype):
    """x (float32) as a new array of `dtype`, or x itself where it is that dtype already."""
    if x.dtype == dtype:
        return x
    out = xp.empty(x.shape, dtype)
    store(out, x, xp)
    return out


def set_rows(xp, dst, rows, values) -> None:
    """dst[rows] = values (float32, (len(rows), dst.shape[1])), rounded to dst's dtype."""
    bits(dst)[rows] = bits(rounded(xp, xp.ascontiguousarray(values), dst.dtype))


def add_rows(xp, dst, rows, values) -> None:
    """dst[rows] += values (float32), summed in float32 and rounded to dst's dtype."""
    current = as_float32(bits(dst)[rows].view(dst.dtype), xp)
    set_rows(xp, dst, rows, current + values)

"""MXFP4 dequantization: the Cython side of pyx/mxfp4_kernels.c, which
engine/loader/quant_mxfp4.py calls for each packed expert tensor of a GPT-OSS checkpoint.
Validates dtypes and shapes (ValueError naming the tensor), then runs the C kernel with the GIL
released."""
import ml_dtypes
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t

cnp.import_array()


cdef extern from "mxfp4_kernels.h" nogil:
    int TAPER_OK, TAPER_F32, TAPER_BF16, TAPER_F16
    int taper_mxfp4_dequantize(const uint8_t* blocks, const uint8_t* scales, int64_t E,
                               int64_t R, int64_t G, int out_dtype, void* out, int nthreads)


BLOCK = 32      # values per scale; 16 bytes a block
_DTYPES = {np.dtype(np.float32): TAPER_F32, np.dtype(ml_dtypes.bfloat16): TAPER_BF16,
           np.dtype(np.float16): TAPER_F16}


def dequantize(blocks, scales, dtype, str name="tensor", int num_threads=1):
    """blocks (E, R, G, 16) uint8 and scales (E, R, G) uint8 -> (E, 32 G, R) in dtype (float32,
    bfloat16 or float16)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8 (U8), got "
                         f"{blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[3] != BLOCK // 2:
        raise ValueError(f"{name}_blocks: shape {blocks.shape}; MXFP4 expert blocks are "
                         f"(experts, rows, blocks, {BLOCK // 2}): {BLOCK} FP4 values in "
                         f"{BLOCK // 2} bytes")
    if scales.shape != blocks.shape[:3]:
        raise ValueError(f"{name}_scales: shape {scales.shape}, but its blocks "
                         f"{blocks.shape} need one scale per block: {blocks.shape[:3]}")
    code = _DTYPES.get(np.dtype(dtype))
    if code is None:
        raise ValueError(f"{name}: MXFP4 dequantizes to float32, bfloat16 or float16, "
                         f"not {np.dtype(dtype)}")
    if num_threads < 1:
        raise ValueError(f"{name}: num_threads must be >= 1, got {num_threads}")
    cdef cnp.ndarray b = np.ascontiguousarray(blocks), s = np.ascontiguousarray(scales)
    cdef int64_t E = b.shape[0], R = b.shape[1], G = b.shape[2]
    cdef cnp.ndarray out = np.empty((E, G * BLOCK, R), dtype=dtype)
    cdef const uint8_t* bp = <const uint8_t*>cnp.PyArray_DATA(b)
    cdef const uint8_t* sp = <const uint8_t*>cnp.PyArray_DATA(s)
    cdef void* op = cnp.PyArray_DATA(out)
    cdef int dt = code, nt = num_threads, st
    with nogil:
        st = taper_mxfp4_dequantize(bp, sp, E, R, G, dt, op, nt)
    if st != TAPER_OK:
        raise RuntimeError(f"{name}: MXFP4 dequantization failed with status {st}")
    return out

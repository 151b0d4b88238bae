"""W4A16 linear and dequantization on the canonical packed int4 layout (pyx/int4_kernels.h):
codes (N, K/2) uint8, scales and zeros (N, K/G) float32. pyx/weights/int4.py holds that layout
(engine/loader/ builds it from GPTQ, AWQ and compressed-tensors checkpoints) and pyx/cpu_int4.py
calls these for the CPU backend's `linear`.

Every function validates dtypes, shapes and contiguity here (ValueError naming the arrays), calls
one C kernel inside `with nogil:` and turns a nonzero status into an exception.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t

from pyx.backend cimport describe_arrays as _desc, fail as _fail

cnp.import_array()


# ---- C kernels

cdef extern from "cpu_kernels.h" nogil:
    int TAPER_OK, TAPER_ERR_ARG, TAPER_ERR_ISA, TAPER_ERR_NOMEM
    int TAPER_ISA_SCALAR, TAPER_ISA_AVX2, TAPER_ISA_AVX512

cdef extern from "int4_kernels.h" nogil:
    int taper_int4_linear(int isa, const float* x, const uint8_t* qs, const float* scales,
                          const float* zeros, const float* bias, float* out, int64_t T,
                          int64_t K, int64_t N, int64_t G, int64_t ldo, int nthreads)
    int taper_int4_dequantize(int isa, const uint8_t* qs, const float* scales,
                              const float* zeros, float* out, int64_t N, int64_t K, int64_t G,
                              int nthreads)


# ---- validation helpers

ISA_NAMES = {"scalar": TAPER_ISA_SCALAR, "avx2": TAPER_ISA_AVX2, "avx512": TAPER_ISA_AVX512}
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)


cdef _check(str op, dict arrays, str name, object dtype, int ndim, bint writable=False):
    a = arrays[name]
    if not isinstance(a, np.ndarray):
        _fail(op, f"{name} must be a numpy array, got {type(a).__name__}", arrays)
    if a.ndim != ndim or a.dtype != dtype or not a.flags.c_contiguous:
        _fail(op, f"{name} must be a C-contiguous {ndim}-D {dtype} array", arrays)
    if writable and not a.flags.writeable:
        _fail(op, f"{name} must be writable", arrays)


cdef int _isa(str op, str isa) except -1:
    if isa not in ISA_NAMES:
        raise ValueError(f"{op}: unknown isa {isa!r}, expected one of {list(ISA_NAMES)}")
    return ISA_NAMES[isa]


cdef _check_packed(str op, dict arrays, int64_t group_size):
    """qs (N, K/2) uint8, scales and zeros (N, K/G) f32; K and G multiples of 32, G divides K."""
    _check(op, arrays, "qs", _U8, 2)
    _check(op, arrays, "scales", _F32, 2)
    _check(op, arrays, "zeros", _F32, 2)
    qs, scales, zeros = arrays["qs"], arrays["scales"], arrays["zeros"]
    cdef int64_t N = qs.shape[0], K = 2 * qs.shape[1]
    if group_size <= 0 or K % 32 or group_size % 32 or K % group_size:
        _fail(op, f"row length {K} and group size {group_size} must be multiples of 32, "
                  "the group size dividing the row length", arrays)
    if scales.shape != (N, K // group_size) or zeros.shape != scales.shape:
        _fail(op, f"scales and zeros must be (N, K/G) = ({N}, {K // group_size})", arrays)


cdef _status(int st, str op, dict arrays):
    if st == TAPER_OK:
        return
    if st == TAPER_ERR_ARG:
        raise ValueError(f"{op}: bad shape arguments [{_desc(arrays)}]")
    if st == TAPER_ERR_ISA:
        raise RuntimeError(f"{op}: ISA path not supported by this CPU [{_desc(arrays)}]")
    if st == TAPER_ERR_NOMEM:
        raise MemoryError(f"{op}: scratch allocation failed [{_desc(arrays)}]")
    raise RuntimeError(f"{op}: kernel failed with status {st} [{_desc(arrays)}]")


cdef inline void* _ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


# ---- wrappers

def int4_linear(str isa, x, qs, scales, zeros, int64_t group_size, bias, out, int64_t col,
                int num_threads):
    """out[:, col:col + N] = x @ W.T (+ bias), W the packed (N, K) weight; x (T, K) and out
    (T, ldo) float32, bias (N,) float32 or None."""
    op = "int4_linear"
    arrays = {"x": x, "qs": qs, "scales": scales, "zeros": zeros, "out": out}
    cdef int code = _isa(op, isa)
    _check_packed(op, arrays, group_size)
    _check(op, arrays, "x", _F32, 2)
    _check(op, arrays, "out", _F32, 2, True)
    cdef int64_t T = x.shape[0], K = x.shape[1], N = qs.shape[0], ldo = out.shape[1]
    if 2 * qs.shape[1] != K:
        _fail(op, "qs must be (N, K/2) with K = x.shape[1]", arrays)
    if out.shape[0] != T or col < 0 or col + N > ldo:
        _fail(op, f"out must be (T, >= {col} + N) to take columns [{col}, {col + N})", arrays)
    cdef const float* bp = NULL
    if bias is not None:
        arrays["bias"] = bias
        _check(op, arrays, "bias", _F32, 1)
        if bias.shape[0] != N:
            _fail(op, "bias must be (N,)", arrays)
        bp = <const float*>_ptr(bias)
    if num_threads < 1:
        raise ValueError(f"{op}: num_threads must be >= 1, got {num_threads}")
    cdef const float* xp = <const float*>_ptr(x)
    cdef const uint8_t* qp = <const uint8_t*>_ptr(qs)
    cdef const float* sp = <const float*>_ptr(scales)
    cdef const float* zp = <const float*>_ptr(zeros)
    cdef float* op_ = <float*>_ptr(out) + col
    cdef int st
    with nogil:
        st = taper_int4_linear(code, xp, qp, sp, zp, bp, op_, T, K, N, group_size, ldo,
                               num_threads)
    _status(st, op, arrays)


def int4_dequantize(str isa, qs, scales, zeros, int64_t group_size, out=None,
                    int num_threads=1):
    """The packed weight as float32 (N, K), into `out` when given; isa "scalar" is the
    reference."""
    op = "int4_dequantize"
    arrays = {"qs": qs, "scales": scales, "zeros": zeros}
    cdef int code = _isa(op, isa)
    _check_packed(op, arrays, group_size)
    cdef int64_t N = qs.shape[0], K = 2 * qs.shape[1]
    if out is None:
        out = np.empty((N, K), np.float32)
    arrays["out"] = out
    _check(op, arrays, "out", _F32, 2, True)
    if out.shape != (N, K):
        _fail(op, f"out must be (N, K) = ({N}, {K})", arrays)
    if num_threads < 1:
        raise ValueError(f"{op}: num_threads must be >= 1, got {num_threads}")
    cdef const uint8_t* qp = <const uint8_t*>_ptr(qs)
    cdef const float* sp = <const float*>_ptr(scales)
    cdef const float* zp = <const float*>_ptr(zeros)
    cdef float* dp = <float*>_ptr(out)
    cdef int st
    with nogil:
        st = taper_int4_dequantize(code, qp, sp, zp, dp, N, K, group_size, num_threads)
    _status(st, op, arrays)
    return out

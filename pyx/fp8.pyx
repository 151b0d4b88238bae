"""FP8 (OCP e4m3) weight kernels: the Cython side of pyx/fp8_kernels.c.

`fp8_linear` is what the CPU backend's `linear` calls on a pyx.weights.fp8.Fp8Weight;
`decode` / `encode` expose the kernels' e4m3 conversions for tests. Every entry validates dtypes,
shapes and contiguity (ValueError naming the op and the shapes), then calls one C function inside
`with nogil:` and turns a nonzero status into an exception.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t

from pyx.backend cimport describe_arrays as _desc

cnp.import_array()


cdef extern from "fp8_kernels.h" nogil:
    int TAPER_OK, TAPER_ERR_ARG, TAPER_ERR_ISA, TAPER_ERR_NOMEM
    int TAPER_ISA_SCALAR, TAPER_ISA_AVX2, TAPER_ISA_AVX512
    int taper_fp8_isa_supported(int isa)
    int taper_fp8_linear(int isa, const float* x, const uint8_t* w, const float* scale,
                         int64_t bn, int64_t bk, const float* bias, float* out, int64_t T,
                         int64_t K, int64_t N, int batch_invariant, int nthreads)
    int taper_fp8_decode(int isa, const uint8_t* src, float* dst, int64_t n)
    void taper_fp8_encode(const float* src, uint8_t* dst, int64_t n)


ISA_NAMES = {"scalar": TAPER_ISA_SCALAR, "avx2": TAPER_ISA_AVX2, "avx512": TAPER_ISA_AVX512}
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)


cdef inline void* _ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef int _isa(str op, isa) except -1:
    if isa not in ISA_NAMES:
        raise ValueError(f"{op}: unknown isa {isa!r}, expected one of {list(ISA_NAMES)}")
    if not taper_fp8_isa_supported(ISA_NAMES[isa]):
        raise RuntimeError(f"{op}: isa {isa!r} is not supported by this CPU")
    return ISA_NAMES[isa]


cdef _check(str op, dict arrays, str name, object dtype, int ndim, bint writable=False):
    a = arrays[name]
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{op}: {name} must be a numpy array, got {type(a).__name__} "
                         f"[{_desc(arrays)}]")
    if a.ndim != ndim or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be a C-contiguous {ndim}-D {dtype} array "
                         f"[{_desc(arrays)}]")
    if writable and not a.flags.writeable:
        raise ValueError(f"{op}: {name} must be writable [{_desc(arrays)}]")


cdef _status(int st, str op, dict arrays):
    if st == TAPER_OK:
        return
    if st == TAPER_ERR_NOMEM:
        raise MemoryError(f"{op}: scratch allocation failed [{_desc(arrays)}]")
    if st == TAPER_ERR_ISA:
        raise RuntimeError(f"{op}: ISA path not supported by this CPU [{_desc(arrays)}]")
    raise RuntimeError(f"{op}: kernel failed with status {st} [{_desc(arrays)}]")


def isa_supported(str isa):
    """Whether this CPU can run the given fp8 kernel path ("scalar", "avx2", "avx512")."""
    return isa in ISA_NAMES and bool(taper_fp8_isa_supported(ISA_NAMES[isa]))


def fp8_linear(isa, x, weight, scale, block, bias, out, int num_threads=1,
               bint batch_invariant=False):
    """out = x @ (decode(weight) * block scales).T (+ bias).
    x (T, K) f32; weight (N, K) uint8 e4m3 codes; scale (N / bn, ceil(K / bk)) f32 with
    block = (bn, bk), N % bn == 0; bias (N,) f32 or None; out (T, N) f32.
    batch_invariant: the packed GEMM for every T, so a row's bits do not depend on T."""
    op = "fp8_linear"
    arrays = {"x": x, "weight": weight, "scale": scale, "bias": bias, "out": out}
    cdef int isa_ = _isa(op, isa)
    _check(op, arrays, "x", _F32, 2)
    _check(op, arrays, "weight", _U8, 2)
    _check(op, arrays, "scale", _F32, 2)
    _check(op, arrays, "out", _F32, 2, True)
    cdef int64_t T = x.shape[0], K = x.shape[1], N = weight.shape[0]
    cdef int64_t bn = block[0], bk = block[1]
    if weight.shape[1] != K:
        raise ValueError(f"{op}: weight must be (N, K) with K = x.shape[1] [{_desc(arrays)}]")
    if out.shape[0] != T or out.shape[1] != N:
        raise ValueError(f"{op}: out must be (T, N) [{_desc(arrays)}]")
    if bn < 1 or bk < 1 or N % bn:
        raise ValueError(f"{op}: block {tuple(block)} must be positive with N % bn == 0 "
                         f"[{_desc(arrays)}]")
    if scale.shape[0] != N // bn or scale.shape[1] != (K + bk - 1) // bk:
        raise ValueError(f"{op}: scale must be (N / bn, ceil(K / bk)) for block {tuple(block)} "
                         f"[{_desc(arrays)}]")
    cdef const float* bp = NULL
    if bias is not None:
        _check(op, arrays, "bias", _F32, 1)
        if bias.shape[0] != N:
            raise ValueError(f"{op}: bias must be (N,) [{_desc(arrays)}]")
        bp = <const float*>_ptr(bias)
    if num_threads < 1:
        raise ValueError(f"{op}: num_threads must be >= 1, got {num_threads}")
    cdef const float* xp = <const float*>_ptr(x)
    cdef const uint8_t* wp = <const uint8_t*>_ptr(weight)
    cdef const float* sp = <const float*>_ptr(scale)
    cdef float* outp = <float*>_ptr(out)
    cdef int nt = num_threads, st, inv = batch_invariant
    with nogil:
        st = taper_fp8_linear(isa_, xp, wp, sp, bn, bk, bp, outp, T, K, N, inv, nt)
    _status(st, op, arrays)


def decode(codes, isa="scalar"):
    """uint8 e4m3 codes (any shape) -> float32, through the given ISA path's decoder."""
    cdef int isa_ = _isa("decode", isa)
    cdef cnp.ndarray src = np.ascontiguousarray(codes, dtype=np.uint8)
    cdef cnp.ndarray dst = np.empty(np.shape(codes), np.float32)
    cdef int64_t n = src.size
    cdef const uint8_t* sp = <const uint8_t*>_ptr(src)
    cdef float* dp = <float*>_ptr(dst)
    cdef int st
    with nogil:
        st = taper_fp8_decode(isa_, sp, dp, n)
    _status(st, "decode", {"codes": src})
    return dst


def encode(x):
    """float32 (any shape) -> uint8 e4m3 codes: round to nearest even, saturate to +-448."""
    cdef cnp.ndarray src = np.ascontiguousarray(x, dtype=np.float32)
    cdef cnp.ndarray dst = np.empty(np.shape(x), np.uint8)
    cdef int64_t n = src.size
    cdef const float* sp = <const float*>_ptr(src)
    cdef uint8_t* dp = <uint8_t*>_ptr(dst)
    with nogil:
        taper_fp8_encode(sp, dp, n)
    return dst

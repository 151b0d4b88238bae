"""CPU backend: the op table of pyx/backend.pyx on NumPy arrays, backed by pyx/cpu_kernels.c.

Every op validates dtypes, shapes and contiguity here (ValueError naming the op and the shapes),
then calls one C kernel inside `with nogil:` and turns a nonzero status into an exception.
The two sampling ops on logits, `apply_penalties` and `filter_logits`, are NumPy code in
pyx/cpu_sampling.py (sparse, data-dependent work that NumPy's sorts and partitions do well).
`linear` has three ISA paths (scalar, avx2, avx512) picked at construction: the `isa` argument,
else the KernelConfig's cpu_isa, whose default (auto) is the best the CPU supports. Besides float
matrices `linear` takes the packed formats of pyx/weights/, recognised with isinstance: ggml
blocks (pyx/quant_kernels.c, whose host functions quantize_weight / dequantize_weight are here
too), FP8 codes (pyx/fp8.pyx) and int4 codes (pyx/cpu_int4.py over pyx/int4.pyx).
"""
import math

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from pyx.backend cimport Backend, describe_arrays as _desc, fail as _fail
from pyx import cpu_int4, cpu_moe, cpu_sampling, cpu_threads, cpu_vision
from pyx.attention_dispatch import check_masks
from pyx.chunked_attention import chunked_batch
from pyx.fp8 import fp8_linear
from pyx.moe import StackedExperts
from pyx.weights.fp8 import Fp8Weight
from pyx.weights.ggml import QuantizedWeight
from pyx.weights.int4 import Int4Weight

cnp.import_array()


# ---- C kernels (pyx/cpu_kernels.h)

cdef extern from "cpu_kernels.h" nogil:
    int TAPER_OK, TAPER_ERR_ARG, TAPER_ERR_ISA, TAPER_ERR_NOMEM
    int TAPER_F32, TAPER_BF16, TAPER_F16
    int TAPER_ISA_SCALAR, TAPER_ISA_AVX2, TAPER_ISA_AVX512
    int taper_cpu_isa_supported(int isa)
    int taper_cpu_best_isa()
    int taper_cpu_max_threads()
    int taper_embedding(const int32_t* token_ids, const void* table, int dtype, int64_t T,
                        int64_t V, int64_t H, float* out, int nthreads)
    int taper_linear_ex(int isa, const float* x, const void* weight, int dtype, const float* bias,
                        float* out, int64_t T, int64_t K, int64_t N, int batch_invariant,
                        int nthreads)
    int TAPER_PREFETCH_AUTO, TAPER_PREFETCH_L1, TAPER_PREFETCH_L2
    int taper_linear_pf(int isa, const float* x, const void* weight, int dtype, const float* bias,
                        float* out, int64_t T, int64_t K, int64_t N, int batch_invariant,
                        int prefetch, int nthreads)
    int taper_rms_norm(const float* x, const float* weight, float eps, float* out, int64_t T,
                       int64_t H, int nthreads)
    int taper_fused_add_rms_norm(float* x, float* residual, const float* weight, float eps,
                                 int64_t T, int64_t H, int nthreads)
    int taper_layer_norm(const float* x, const float* weight, const float* bias, float eps,
                         float* out, int64_t T, int64_t H, int nthreads)
    int taper_fused_add_layer_norm(float* x, float* residual, const float* weight,
                                   const float* bias, float eps, int64_t T, int64_t H,
                                   int nthreads)
    int taper_rotary_embedding(const int32_t* positions, float* q, float* k,
                               const float* cos_sin_cache, int64_t T, int64_t Hq, int64_t Hkv,
                               int64_t D, int64_t rot_dim, int64_t max_pos, int is_neox,
                               int nthreads)
    int taper_silu_and_mul(int isa, const float* x, float* out, int64_t T, int64_t inter, int nthreads)
    int taper_gelu_tanh_and_mul(int isa, const float* x, float* out, int64_t T, int64_t inter,
                                int nthreads)
    int taper_softcap(int isa, float* x, int64_t n, float cap, int nthreads)
    int taper_scale(float* x, int64_t n, float s, int nthreads)
    int taper_reshape_and_cache(const float* k, const float* v, float* k_cache, float* v_cache,
                                const int32_t* slot_mapping, int64_t T, int64_t Hkv, int64_t D,
                                int64_t NB, int64_t BS, int nthreads)
    int taper_paged_attention(int isa, float* out, const float* q, const float* k_cache,
                              const float* v_cache, const int32_t* block_tables,
                              const int32_t* seq_lens, const int32_t* query_start_loc, int64_t T,
                              int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t NB,
                              int64_t BS, int64_t MB, float scale, int64_t sliding_window,
                              float softcap, const float* sinks, int batch_invariant, int nthreads)
    int taper_reshape_and_cache_fp8(const float* k, const float* v, uint8_t* k_cache,
                                    uint8_t* v_cache, const float* k_scale, const float* v_scale,
                                    const int32_t* slot_mapping, int64_t T, int64_t Hkv, int64_t D,
                                    int64_t NB, int64_t BS, int nthreads)
    int taper_paged_attention_fp8(int isa, float* out, const float* q, const uint8_t* k_cache,
                                  const uint8_t* v_cache, const float* k_scale,
                                  const float* v_scale, const int32_t* block_tables,
                                  const int32_t* seq_lens, const int32_t* query_start_loc,
                                  int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                  int64_t NB, int64_t BS, int64_t MB, float scale,
                                  int64_t sliding_window, float softcap, const float* sinks,
                                  int batch_invariant, int nthreads)
    int taper_argmax(const float* logits, int64_t* out, int64_t B, int64_t V, int nthreads)
    int taper_gumbel_sample(const float* logits, const uint64_t* seeds, const int64_t* positions,
                            int64_t* out, int64_t B, int64_t V, int nthreads)
    void taper_philox4x32_10(uint32_t* ctr, const uint32_t* key)
    int taper_apply_token_bitmask(float* logits, const int32_t* bitmask, const int32_t* rows,
                                  int64_t B, int64_t V, int64_t R, int nthreads)


cdef extern from "quant_kernels.h" nogil:
    int taper_quant_block_size(int type)
    int taper_quant_type_size(int type)
    int taper_dequantize(int isa, int type, const void* src, float* dst, int64_t n)
    int taper_quantize(int type, const float* src, void* dst, int64_t rows, int64_t k,
                       int nthreads)
    int taper_quant_linear(int isa, int type, const float* x, const void* w, const float* bias,
                           float* out, int64_t T, int64_t K, int64_t N, int64_t ldo,
                           int batch_invariant, int act_split, int prefill_int8, int nthreads)
    int taper_quant_gemv_max_t(int isa, int type)
    int taper_quant_prefill_int8(int isa, int type)


cdef extern from "lora_kernels.h" nogil:
    int taper_lora_linear(int isa, const float* x, const void* a, const void* bt, int dtype,
                          const int32_t* ranks, const int32_t* parts, const int32_t* rows,
                          const int32_t* seg_offsets, const int32_t* seg_slots, float* out,
                          int64_t T, int64_t K, int64_t N, int64_t S, int64_t P, int64_t R,
                          int64_t G, int nthreads)


cdef extern from "moe_kernels.h" nogil:
    int TAPER_MOE_SILU, TAPER_MOE_GELU_TANH
    ctypedef struct taper_moe_part:
        pass
    int taper_moe_experts(int isa, const float* x, const int64_t* topk_ids,
                          const float* topk_weights, const taper_moe_part* gate_up,
                          const int64_t* gate_up_start, const taper_moe_part* down,
                          const int64_t* down_start, int activation, float* out, int64_t T,
                          int64_t H, int64_t inter, int64_t top_k, int64_t E,
                          int batch_invariant, int prefill_int8, int nthreads)


cdef extern from "mla_kernels.h" nogil:
    int taper_mla_decode_attention(int isa, float* out, const float* q, const float* cache,
                                   const int32_t* block_tables, const int32_t* seq_lens,
                                   int64_t B, int64_t Hq, int64_t D, int64_t Dv, int64_t NB,
                                   int64_t BS, int64_t MB, float scale, int nthreads)
cdef extern from "gated_delta_kernels.h" nogil:
    int taper_gated_delta_conv_decode(const float* proj, int64_t proj_cols, const float* taps,
                                      float* conv_state, const int64_t* src, const int64_t* slot,
                                      const uint8_t* fresh, float* acc, int64_t B,
                                      int64_t num_rows, int64_t C, int64_t K)
    int taper_gated_delta_recurrent_decode(const float* mixed, const float* decay,
                                           const float* beta, const float* gate,
                                           const float* norm_weight, float* ssm_state,
                                           const int64_t* src, const int64_t* slot,
                                           const uint8_t* fresh, float* core, int64_t B,
                                           int64_t num_rows, int64_t nk, int64_t nv, int64_t dk,
                                           int64_t dv, float eps)


ctypedef int (*gated_kernel)(int isa, const float* x, float* out, int64_t T, int64_t inter,
                             int nthreads) noexcept nogil


# ---- validation helpers

ISA_NAMES = {"scalar": TAPER_ISA_SCALAR, "avx2": TAPER_ISA_AVX2, "avx512": TAPER_ISA_AVX512}
_ISA_BY_CODE = {v: k for k, v in ISA_NAMES.items()}
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_U64 = np.dtype(np.uint64)
_U8 = np.dtype(np.uint8)


def quant_gemv_max_t(int qtype, str isa):
    """Token rows up to which a quantized `linear` of this type, on this ISA path, dots
    Q8-quantized activation rows with the quantized weight rows (decode); longer inputs go
    through float32 panels of the weight and the dense GEMM, with float32 activations
    (pyx/quant_kernels.c)."""
    return taper_quant_gemv_max_t(ISA_NAMES[isa], qtype)


def quant_prefill_int8(int qtype, str isa):
    """The token rows from which kernels quant_prefill=int8 multiplies this type in int8 on this
    ISA path (pyx/quant_gemm.c), the vec_dot loop's results; 0 where it never does."""
    return taper_quant_prefill_int8(ISA_NAMES[isa], qtype)


def isa_supported(str isa):
    """Whether this CPU can run the given `linear` ISA path ("scalar", "avx2", "avx512")."""
    return isa in ISA_NAMES and bool(taper_cpu_isa_supported(ISA_NAMES[isa]))


def philox4x32_10(counter, key):
    """One Philox4x32-10 block (the generator behind gumbel_sample), for known-answer tests.
    counter: 4 uint32 words; key: 2 uint32 words. Returns a tuple of 4 ints."""
    cdef uint32_t c[4]
    cdef uint32_t k[2]
    for i in range(4):
        c[i] = <uint32_t>int(counter[i])
    for i in range(2):
        k[i] = <uint32_t>int(key[i])
    taper_philox4x32_10(c, k)
    return (c[0], c[1], c[2], c[3])


# ---- GGML block quantization (pyx/quant_kernels.h); type ids are gguf's GGMLQuantizationType

def quant_block_size(int qtype):
    """(elements, bytes) per block of a ggml quant type; (0, 0) for one this build lacks."""
    return taper_quant_block_size(qtype), taper_quant_type_size(qtype)


def _row_bytes(int qtype, int64_t k):
    cdef int bs = taper_quant_block_size(qtype), ts = taper_quant_type_size(qtype)
    if bs == 0:
        raise ValueError(f"quant type {qtype} is not supported")
    if k % bs:
        raise ValueError(f"row length {k} is not a multiple of type {qtype}'s block of {bs}")
    return k // bs * ts


def dequantize(int qtype, data, int64_t k, str isa="scalar"):
    """Blocks (rows, row_bytes) uint8 -> (rows, k) float32: the scalar reference, or the type's
    SIMD body on another ISA path (bit-identical; the panel path of a quantized `linear`)."""
    if not isa_supported(isa):
        raise ValueError(f"dequantize: ISA {isa!r} is not supported on this CPU")
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, _row_bytes(qtype, k))
    cdef cnp.ndarray out = np.empty((data.shape[0], k), np.float32)
    cdef cnp.ndarray src = data
    cdef int64_t n = data.shape[0] * k
    cdef int st, code = ISA_NAMES[isa]
    cdef const void* sp = _ptr(src)
    cdef float* dp = <float*>_ptr(out)
    with nogil:
        st = taper_dequantize(code, qtype, sp, dp, n)
    if st:
        raise ValueError(f"dequantize: bad arguments (type {qtype}, k {k})")
    return out


def quantize_weight(weight, int qtype, num_threads=None):
    """In-situ quantization of a float (N, K) matrix (bf16/f16/f32) to one ggml type (--isq)."""
    x = np.asarray(weight, dtype=np.float32)
    return QuantizedWeight.of(qtype, quantize(qtype, x, num_threads), x.shape[1])


def dequantize_weight(w, str isa="scalar"):
    """A QuantizedWeight -> (N, K) float32, through the kernels' scalar reference (or the given
    ISA's bit-identical SIMD bodies)."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"dequantize_weight: expected a QuantizedWeight, got {type(w).__name__}")
    return np.concatenate([dequantize(t, b, w.k, isa) for t, b in w.quant_parts])


def default_num_threads():
    """Threads per op when the caller names none: OMP_NUM_THREADS when the user set it, else the
    CPUs this process may use (affinity and cgroup quota: pyx/cpu_threads.py)."""
    n, _ = cpu_threads.default_num_threads()
    return n or taper_cpu_max_threads()


def quantize(int qtype, x, num_threads=None):
    """(rows, k) float32 -> (rows, row_bytes) uint8 blocks (ISQ; OpenMP over rows)."""
    cdef cnp.ndarray src = np.ascontiguousarray(x, dtype=np.float32)
    if src.ndim != 2:
        raise ValueError("quantize: x must be 2-D (rows, k)")
    cdef int64_t rows = src.shape[0], k = src.shape[1]
    cdef cnp.ndarray out = np.empty((rows, _row_bytes(qtype, k)), np.uint8)
    cdef int nt = num_threads or default_num_threads(), st
    cdef const float* sp = <const float*>_ptr(src)
    cdef void* dp = _ptr(out)
    with nogil:
        st = taper_quantize(qtype, sp, dp, rows, k, nt)
    if st:
        raise ValueError(f"quantize: bad arguments (type {qtype}, k {k})")
    return out


cdef _check(str op, dict arrays, str name, object dtypes, int ndim, bint writable=False):
    """Checks arrays[name] is a C-contiguous ndarray of one of `dtypes` with `ndim` dims."""
    a = arrays[name]
    if not isinstance(a, np.ndarray):
        _fail(op, f"{name} must be a numpy array, got {type(a).__name__}", arrays)
    if a.ndim != ndim:
        _fail(op, f"{name} must have {ndim} dims", arrays)
    if a.dtype not in dtypes:
        _fail(op, f"{name} has dtype {a.dtype}, expected one of {[str(d) for d in dtypes]}",
              arrays)
    if not a.flags.c_contiguous:
        _fail(op, f"{name} must be C-contiguous", arrays)
    if writable and not a.flags.writeable:
        _fail(op, f"{name} must be writable", arrays)


cdef int _wdtype(a):
    dt = a.dtype
    if dt == _F32:
        return TAPER_F32
    if dt.itemsize == 2 and dt.name == "bfloat16":
        return TAPER_BF16
    if dt == np.float16:
        return TAPER_F16
    return -1


def _weight_dtypes():
    out = [_F32, np.dtype(np.float16)]
    try:
        import ml_dtypes
        out.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return out


_WDT = _weight_dtypes()
_LORA_DT = [d for d in _WDT if d.name in ("float32", "bfloat16")]   # lora_linear's slots
# moe_kernels.h's taper_moe_part, one record per piece of an expert's weight
_MOE_PART = np.dtype([("data", np.uintp), ("rows", np.int64), ("dtype", np.int32),
                      ("qtype", np.int32), ("act_split", np.int32), ("pad_", np.int32)])
assert _MOE_PART.itemsize == 32


cdef _check_fp8_cache(str op, dict arrays, int64_t Hkv, int64_t D, bint writable):
    """uint8 k_cache, v_cache (NB, BS, Hkv, D) and float32 k_scale, v_scale (Hkv,)."""
    _check(op, arrays, "k_cache", (_U8,), 4, writable)
    _check(op, arrays, "v_cache", (_U8,), 4, writable)
    for name in ("k_scale", "v_scale"):
        if arrays[name] is None:
            _fail(op, f"an fp8 (uint8) cache needs {name} (Hkv,) float32", arrays)
        _check(op, arrays, name, (_F32,), 1)
        if arrays[name].shape[0] != Hkv:
            _fail(op, f"{name} must be (Hkv,)", arrays)
    kc, vc = arrays["k_cache"], arrays["v_cache"]
    if kc.shape != vc.shape or kc.shape[2] != Hkv or kc.shape[3] != D:
        _fail(op, "need k_cache, v_cache (NB, BS, Hkv, D) uint8", arrays)


cdef int64_t _check_attention(str op, dict arrays, sliding_window) except? -1:
    """paged_attention's checks shared by the f32 and fp8 caches (arrays holds out, q, k_cache,
    block_tables, seq_lens, query_start_loc; the caches' own dtype and shape checks come first).
    Returns the sliding window, 0 for none."""
    _check(op, arrays, "out", (_F32,), 3, True)
    _check(op, arrays, "q", (_F32,), 3)
    _check(op, arrays, "block_tables", (_I32,), 2)
    _check(op, arrays, "seq_lens", (_I32,), 1)
    _check(op, arrays, "query_start_loc", (_I32,), 1)
    out, q, k_cache = arrays["out"], arrays["q"], arrays["k_cache"]
    B = arrays["seq_lens"].shape[0]
    Hkv = k_cache.shape[2]
    if out.shape != q.shape:
        _fail(op, "out must have q's shape (T, Hq, D)", arrays)
    if Hkv <= 0 or q.shape[1] % Hkv:
        _fail(op, "Hq must be a multiple of Hkv", arrays)
    if arrays["block_tables"].shape[0] != B or arrays["query_start_loc"].shape[0] != B + 1:
        _fail(op, "need block_tables (B, MB), seq_lens (B,), query_start_loc (B+1,)", arrays)
    if sliding_window is None:
        return 0
    if sliding_window < 0:
        _fail(op, f"sliding_window must be >= 0, got {sliding_window}", arrays)
    return sliding_window


cdef const float* _check_sinks(str op, dict arrays, sinks, Py_ssize_t Hq) except? NULL:
    """paged_attention's sinks: None (NULL), or a C-contiguous float32 (Hq,) array."""
    if sinks is None:
        return NULL
    arrays["sinks"] = sinks
    _check(op, arrays, "sinks", (_F32,), 1)
    if sinks.shape[0] != Hq:
        _fail(op, f"need sinks (Hq,) = ({Hq},), one per query head", arrays)
    return <const float*>_ptr(sinks)


cdef float _check_softcap(str op, dict arrays, softcap) except? -1:
    """paged_attention's softcap: a finite float >= 0 (0 = off)."""
    cdef double sc = 0.0 if softcap is None else float(softcap)
    if not (sc >= 0.0 and math.isfinite(sc)):
        _fail(op, f"softcap must be a finite number >= 0, got {softcap!r}", arrays)
    return <float>sc


cdef inline void* _ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef _status(int st, str op, dict arrays):
    if st == TAPER_OK:
        return
    if st == TAPER_ERR_ARG:
        raise ValueError(f"{op}: index out of range in the data [{_desc(arrays)}]")
    if st == TAPER_ERR_ISA:
        raise RuntimeError(f"{op}: ISA path not supported by this CPU [{_desc(arrays)}]")
    if st == TAPER_ERR_NOMEM:
        raise MemoryError(f"{op}: scratch allocation failed [{_desc(arrays)}]")
    raise RuntimeError(f"{op}: kernel failed with status {st} [{_desc(arrays)}]")


cdef _check_rows(str op, dict arrays, int64_t B):
    """The gated DeltaNet decode calls' int64 src, slots and uint8 fresh, (B,) each."""
    _check(op, arrays, "src", (_I64,), 1)
    _check(op, arrays, "slots", (_I64,), 1)
    _check(op, arrays, "fresh", (_U8,), 1)
    if arrays["src"].shape[0] != B or arrays["slots"].shape[0] != B or arrays["fresh"].shape[0] != B:
        _fail(op, f"src, slots and fresh must be ({B},)", arrays)


# ---- the backend

cdef class CpuBackend(Backend):
    """Backend on NumPy arrays with OpenMP C kernels.

    isa: "scalar" | "avx2" | "avx512" for `linear` (default: the kernels' cpu_isa, whose auto is
    the best the CPU supports). num_threads: OpenMP threads per op (default: $OMP_NUM_THREADS, else
    the CPUs this process may use: default_num_threads, then fewer while other processes keep
    some of them busy: adapt_threads). batch_invariant: every op computes a row (a token's
    activations, a query's attention) in an order that does not depend on the other rows of
    the call, so a request's logits are bit-identical alone or in any batch, however its prompt
    is chunked (README: Batch invariance); it costs prefill speed (bench/RESULTS.md).
    kernels: a pyx.kernel_config.KernelConfig (or its string / dict form); this backend reads
    cpu_isa, act_split (which ggml decode matmuls write each activation row as two 8-bit rows
    instead of rounding it once: the attention's qkv projection by default, every one, or none),
    quant_prefill (K- and legacy-type prefill in int8 or through float32 panels) and moe.
    """
    cdef int _isa
    cdef int _nthreads
    cdef readonly bint act_split     # kernels act_split=on: every quantized matmul
    cdef readonly bint act_split_qkv  # act_split=qkv or on: the weights placed with role "qkv"
    cdef readonly int prefill_int8  # quant_prefill: 0 f32, 1 int8, 2 int8_all (quant_kernels.h)
    cdef int _prefetch               # kernels gemv_prefetch: TAPER_PREFETCH_*
    cdef readonly object governor   # cpu_threads.ThreadGovernor, or None: the count is fixed
    moe_experts_op = True            # MoE blocks run their experts in one moe_experts call

    def __init__(self, isa=None, num_threads=None, batch_invariant=False, kernels=None):
        Backend.__init__(self, "cpu", kernels)
        self.xp = np                  # the array module of this backend's tensors
        self.act_dtype = np.float32   # activations are float32 here
        self.batch_invariant = batch_invariant
        self.act_split = self.kernels.act_split == "on"
        self.act_split_qkv = self.kernels.act_split in ("on", "qkv")
        self.prefill_int8 = ("f32", "int8", "int8_all").index(self.kernels.quant_prefill)
        self._prefetch = {"auto": TAPER_PREFETCH_AUTO, "l1": TAPER_PREFETCH_L1,
                          "l2": TAPER_PREFETCH_L2}[self.kernels.gemv_prefetch]
        if isa is None and self.kernels.cpu_isa != "auto":
            isa = self.kernels.cpu_isa
        if isa is None:
            self._isa = taper_cpu_best_isa()
        else:
            if isa not in ISA_NAMES:
                raise ValueError(f"CpuBackend: unknown isa {isa!r}, expected one of {list(ISA_NAMES)}")
            if not taper_cpu_isa_supported(ISA_NAMES[isa]):
                raise ValueError(f"CpuBackend: isa {isa!r} is not supported by this CPU (kernels "
                                 f"cpu_isa=auto picks the best it runs)")
            self._isa = ISA_NAMES[isa]
        self.num_threads = num_threads if num_threads is not None else default_num_threads()
        # The default count adapts to other processes' load; one the caller or OMP_NUM_THREADS
        # chose stays as chosen.
        self.governor = None
        if num_threads is None and not cpu_threads.user_num_threads():
            self.governor = cpu_threads.ThreadGovernor(self._nthreads)

    def adapt_threads(self):
        """Between forward passes: the thread count the governor decides (pyx/cpu_threads.py:
        fewer while other processes occupy this process's CPUs). Returns the count in force."""
        if self.governor is not None:
            self._nthreads = self.governor.update()
        return self._nthreads

    @property
    def isa(self):
        """The ISA path `linear` uses: "scalar", "avx2" or "avx512"."""
        return _ISA_BY_CODE[self._isa]

    @property
    def num_threads(self):
        """OpenMP threads each op uses."""
        return self._nthreads

    @num_threads.setter
    def num_threads(self, n):
        n = int(n)
        if n < 1:
            raise ValueError(f"CpuBackend: num_threads must be >= 1, got {n}")
        self._nthreads = n

    def __repr__(self):
        inv = ", batch_invariant=True" if self.batch_invariant else ""
        split = (", act_split='on'" if self.act_split else
                 ", act_split='qkv'" if self.act_split_qkv else ", act_split='off'")
        return f"CpuBackend(isa={self.isa!r}, num_threads={self._nthreads}{inv}{split})"

    def asarray(self, a):
        """Host array -> this backend's array: `a` itself (np.asarray of it when not an ndarray)."""
        return np.asarray(a)

    def to_host(self, a):
        """This backend's array -> NumPy: `a` itself."""
        return np.asarray(a)

    def place_weight(self, a, role=None):
        """Weights stay as loaded: the kernels read f32/bf16/f16 and packed formats directly. A
        ggml-block weight placed as the attention's qkv projection (role "qkv") is marked for
        exact activations under act_split=qkv (QuantizedWeight.exact_activations): rounding
        its input to 8 bits moves q and k, which the attention scores amplify (bench/RESULTS.md,
        Numerics: of the decode matmuls' roundings, this one costs the most greedy tokens)."""
        if role == "qkv" and self.act_split_qkv and isinstance(a, QuantizedWeight):
            return QuantizedWeight(a.quant_parts, a.k, exact_activations=True)
        return a

    def kv_cache_dtype(self, str kind):
        """float32 for "auto", uint8 e4m3 codes for "fp8"."""
        if kind == "auto":
            return _F32
        if kind == "fp8":
            return _U8
        raise ValueError(f"a {kind} KV cache is not yet supported on the CPU backend (its KV cache "
                         "is f32, or fp8)")

    def bind_thread(self):
        """Nothing to bind: every thread may call the CPU kernels."""

    def synchronize(self):
        """Every op has finished when it returns."""

    def embedding(self, token_ids, table, out):
        op = "embedding"
        arrays = {"token_ids": token_ids, "table": table, "out": out}
        if isinstance(table, QuantizedWeight):
            return self._quant_embedding(token_ids, table, out)
        _check(op, arrays, "token_ids", (_I32,), 1)
        _check(op, arrays, "table", _WDT, 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef int64_t T = token_ids.shape[0], V = table.shape[0], H = table.shape[1]
        if out.shape[0] != T or out.shape[1] != H:
            _fail(op, "out must be (T, H)", arrays)
        cdef int dt = _wdtype(table)
        cdef const int32_t* ids = <const int32_t*>_ptr(token_ids)
        cdef const void* tp = _ptr(table)
        cdef float* op_ = <float*>_ptr(out)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_embedding(ids, tp, dt, T, V, H, op_, nt)
        _status(st, op, arrays)

    def linear(self, x, weight, bias, out):
        op = "linear"
        arrays = {"x": x, "weight": weight, "bias": bias, "out": out}
        if isinstance(weight, QuantizedWeight):
            return self._quant_linear(x, weight, bias, out)
        if isinstance(weight, Fp8Weight):
            return fp8_linear(self.isa, x, weight.weight, weight.scale, weight.block, bias, out,
                              self._nthreads, self.batch_invariant)
        if isinstance(weight, Int4Weight):
            return cpu_int4.linear(self, weight, x, bias, out)
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "weight", _WDT, 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef int64_t T = x.shape[0], K = x.shape[1], N = weight.shape[0]
        if weight.shape[1] != K:
            _fail(op, "weight must be (N, K) with K = x.shape[1]", arrays)
        if out.shape[0] != T or out.shape[1] != N:
            _fail(op, "out must be (T, N)", arrays)
        cdef const float* bp = NULL
        if bias is not None:
            _check(op, arrays, "bias", (_F32,), 1)
            if bias.shape[0] != N:
                _fail(op, "bias must be (N,)", arrays)
            bp = <const float*>_ptr(bias)
        cdef int dt = _wdtype(weight), isa = self._isa, nt = self._nthreads, st
        cdef int inv = self.batch_invariant, pf = self._prefetch
        cdef const float* xp = <const float*>_ptr(x)
        cdef const void* wp = _ptr(weight)
        cdef float* outp = <float*>_ptr(out)
        with nogil:
            st = taper_linear_pf(isa, xp, wp, dt, bp, outp, T, K, N, inv, pf, nt)
        _status(st, op, arrays)

    def lora_linear(self, x, lora_a, lora_b, ranks, parts, rows, seg_offsets, seg_slots, out):
        op = "lora_linear"
        arrays = {"x": x, "lora_a": lora_a, "lora_b": lora_b, "ranks": ranks, "parts": parts,
                  "rows": rows, "seg_offsets": seg_offsets, "seg_slots": seg_slots, "out": out}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "lora_a", _LORA_DT, 3)
        _check(op, arrays, "lora_b", (lora_a.dtype,), 3)
        _check(op, arrays, "out", (_F32,), 2, True)
        for name in ("ranks", "parts", "rows", "seg_offsets", "seg_slots"):
            _check(op, arrays, name, (_I32,), 2 if name == "ranks" else 1)
        cdef int64_t T = x.shape[0], K = x.shape[1], N = out.shape[1], S = lora_a.shape[0]
        cdef int64_t P = parts.shape[0] - 1, G = seg_slots.shape[0], R
        if P < 1 or lora_a.shape[1] % P:
            _fail(op, "need parts (P+1,) with P >= 1 dividing lora_a.shape[1] (P*R)", arrays)
        R = lora_a.shape[1] // P
        if (out.shape[0] != T or lora_a.shape[2] != K or lora_b.shape != (S, R, N)
                or ranks.shape[0] != S or ranks.shape[1] != P):
            _fail(op, "need x (T, K), lora_a (S, P*R, K), lora_b (S, R, N), ranks (S, P), "
                      "out (T, N)", arrays)
        if seg_offsets.shape[0] != G + 1 or (G and seg_offsets[G] != rows.shape[0]):
            _fail(op, "need seg_slots (G,) and seg_offsets (G+1,) ending at len(rows)", arrays)
        if np.may_share_memory(x, out):
            _fail(op, "x and out must not overlap", arrays)
        cdef int isa = self._isa, nt = self._nthreads, st, dt = _wdtype(lora_a)
        cdef const float* xp = <const float*>_ptr(x)
        cdef const void* ap = _ptr(lora_a)
        cdef const void* bp = _ptr(lora_b)
        cdef const int32_t* rkp = <const int32_t*>_ptr(ranks)
        cdef const int32_t* pp = <const int32_t*>_ptr(parts)
        cdef const int32_t* rp = <const int32_t*>_ptr(rows)
        cdef const int32_t* op_ = <const int32_t*>_ptr(seg_offsets)
        cdef const int32_t* sp = <const int32_t*>_ptr(seg_slots)
        cdef float* outp = <float*>_ptr(out)
        with nogil:
            st = taper_lora_linear(isa, xp, ap, bp, dt, rkp, pp, rp, op_, sp, outp, T, K, N, S,
                                   P, R, G, nt)
        if st == TAPER_ERR_ARG:
            _fail(op, "a row, slot, rank, part or segment offset is out of range", arrays)
        _status(st, op, arrays)

    def _quant_embedding(self, token_ids, table, out):
        """Rows of a quantized table, each dequantized by the scalar reference."""
        op = "embedding"
        arrays = {"token_ids": token_ids, "out": out}
        _check(op, arrays, "token_ids", (_I32,), 1)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef int64_t V = table.shape[0], H = table.shape[1], t, row, start
        if out.shape[0] != token_ids.shape[0] or out.shape[1] != H:
            _fail(op, "out must be (T, H)", arrays)
        starts, parts, start = [], [], 0
        for qtype, blocks in table.quant_parts:
            starts.append(start)
            parts.append((qtype, blocks))
            start += blocks.shape[0]
        cdef cnp.ndarray blocks_
        cdef int qtype_, st
        for t, tok in enumerate(token_ids):
            if not 0 <= tok < V:
                _fail(op, f"token id {tok} out of range [0, {V})", arrays)
            i = int(np.searchsorted(starts, tok, side="right")) - 1
            qtype_, blocks_ = parts[i]
            row = tok - starts[i]
            st = taper_dequantize(self._isa, qtype_,
                                  <const char*>_ptr(blocks_) + row * blocks_.shape[1],
                                  <float*>_ptr(out) + t * H, H)
            _status(st, op, arrays)

    def _quant_linear(self, x, weight, bias, out):
        """A QuantizedWeight's quant_parts: (qtype, blocks (n_i, row_bytes)) stacked along N;
        each part writes its column slice of out (a fused weight may mix types, as GGUF files
        do)."""
        op = "linear"
        arrays = {"x": x, "out": out}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef int64_t T = x.shape[0], K = x.shape[1], N = out.shape[1], col = 0, n
        if weight.shape != (N, K) or out.shape[0] != T:
            _fail(op, f"quantized weight {weight.shape} does not map x to out", arrays)
        cdef const float* bp = NULL
        if bias is not None:
            arrays["bias"] = bias
            _check(op, arrays, "bias", (_F32,), 1)
            if bias.shape[0] != N:
                _fail(op, "bias must be (N,)", arrays)
            bp = <const float*>_ptr(bias)
        cdef int isa = self._isa, nt = self._nthreads, st, qtype, inv = self.batch_invariant
        cdef int split = self.act_split or weight.exact_activations
        cdef const float* xp = <const float*>_ptr(x)
        cdef float* outp = <float*>_ptr(out)
        cdef cnp.ndarray blocks
        cdef const void* wp
        for qtype, blocks in weight.quant_parts:
            n = blocks.shape[0]
            if blocks.shape[1] != _row_bytes(qtype, K) or not blocks.flags.c_contiguous:
                _fail(op, f"quant part of type {qtype} has rows of {blocks.shape[1]} bytes",
                      arrays)
            wp = _ptr(blocks)
            with nogil:
                st = taper_quant_linear(isa, qtype, xp, wp, bp + col if bp != NULL else NULL,
                                        outp + col, T, K, n, N, inv, split,
                                        self.prefill_int8, nt)
            _status(st, op, arrays)
            col += n

    def batched_linear(self, x, weight, out):
        op = "batched_linear"
        arrays = {"x": x, "weight": weight, "out": out}
        _check(op, arrays, "x", (_F32,), 3)
        _check(op, arrays, "out", (_F32,), 3, True)
        _check(op, arrays, "weight", tuple(_WDT), 3)
        if (weight.shape[0] != x.shape[0] or weight.shape[2] != x.shape[2]
                or out.shape != (x.shape[0], x.shape[1], weight.shape[1])):
            _fail(op, "need x (G, T, K), weight (G, N, K), out (G, T, N)", arrays)
        # each group through linear's kernel, the loop in C: MLA's decode calls this twice per
        # layer with a group per head, and a Python loop of linear calls cost more than the math
        cdef int64_t G = x.shape[0], T = x.shape[1], K = x.shape[2], N = weight.shape[1], g
        cdef int dt = _wdtype(weight), isa = self._isa, nt = self._nthreads, st = TAPER_OK
        cdef int inv = self.batch_invariant
        cdef int64_t wstride = N * K * weight.dtype.itemsize
        cdef const float* xp = <const float*>_ptr(x)
        cdef const char* wp = <const char*>_ptr(weight)
        cdef float* outp = <float*>_ptr(out)
        with nogil:
            for g in range(G):
                st = taper_linear_ex(isa, xp + g * T * K, wp + g * wstride, dt, NULL,
                                     outp + g * T * N, T, K, N, inv, nt)
                if st != TAPER_OK:
                    break
        _status(st, op, arrays)

    def rms_norm(self, x, weight, eps, out):
        op = "rms_norm"
        arrays = {"x": x, "weight": weight, "out": out}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "weight", (_F32,), 1)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef int64_t T = x.shape[0], H = x.shape[1]
        if weight.shape[0] != H or out.shape[0] != T or out.shape[1] != H:
            _fail(op, "need x, out (T, H) and weight (H,)", arrays)
        cdef float e = eps
        cdef const float* xp = <const float*>_ptr(x)
        cdef const float* wp = <const float*>_ptr(weight)
        cdef float* outp = <float*>_ptr(out)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_rms_norm(xp, wp, e, outp, T, H, nt)
        _status(st, op, arrays)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        op = "fused_add_rms_norm"
        arrays = {"x": x, "residual": residual, "weight": weight}
        _check(op, arrays, "x", (_F32,), 2, True)
        _check(op, arrays, "residual", (_F32,), 2, True)
        _check(op, arrays, "weight", (_F32,), 1)
        cdef int64_t T = x.shape[0], H = x.shape[1]
        if weight.shape[0] != H or residual.shape[0] != T or residual.shape[1] != H:
            _fail(op, "need x, residual (T, H) and weight (H,)", arrays)
        cdef float e = eps
        cdef float* xp = <float*>_ptr(x)
        cdef float* rp = <float*>_ptr(residual)
        cdef const float* wp = <const float*>_ptr(weight)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_fused_add_rms_norm(xp, rp, wp, e, T, H, nt)
        _status(st, op, arrays)

    def layer_norm(self, x, weight, bias, eps, out):
        op = "layer_norm"
        arrays = {"x": x, "weight": weight, "bias": bias, "out": out}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef const float* bp = self._norm_vectors(op, arrays, x.shape[1])
        if out.shape[0] != x.shape[0] or out.shape[1] != x.shape[1]:
            _fail(op, "need x, out (T, H)", arrays)
        cdef int64_t T = x.shape[0], H = x.shape[1]
        cdef float e = eps
        cdef const float* xp = <const float*>_ptr(x)
        cdef const float* wp = <const float*>_ptr(weight)
        cdef float* outp = <float*>_ptr(out)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_layer_norm(xp, wp, bp, e, outp, T, H, nt)
        _status(st, op, arrays)

    def fused_add_layer_norm(self, x, residual, weight, bias, eps):
        op = "fused_add_layer_norm"
        arrays = {"x": x, "residual": residual, "weight": weight, "bias": bias}
        _check(op, arrays, "x", (_F32,), 2, True)
        _check(op, arrays, "residual", (_F32,), 2, True)
        cdef const float* bp = self._norm_vectors(op, arrays, x.shape[1])
        if residual.shape[0] != x.shape[0] or residual.shape[1] != x.shape[1]:
            _fail(op, "need x, residual (T, H)", arrays)
        cdef int64_t T = x.shape[0], H = x.shape[1]
        cdef float e = eps
        cdef float* xp = <float*>_ptr(x)
        cdef float* rp = <float*>_ptr(residual)
        cdef const float* wp = <const float*>_ptr(weight)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_fused_add_layer_norm(xp, rp, wp, bp, e, T, H, nt)
        _status(st, op, arrays)

    cdef const float* _norm_vectors(self, str op, dict arrays, int64_t H) except? NULL:
        """Checks weight (H,) and bias (H,) or None; the bias pointer (NULL for None)."""
        _check(op, arrays, "weight", (_F32,), 1)
        if arrays["weight"].shape[0] != H:
            _fail(op, "weight must be (H,)", arrays)
        bias = arrays["bias"]
        if bias is None:
            return NULL
        _check(op, arrays, "bias", (_F32,), 1)
        if bias.shape[0] != H:
            _fail(op, "bias must be (H,)", arrays)
        return <const float*>_ptr(bias)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, head_dim, is_neox):
        op = "rotary_embedding"
        arrays = {"positions": positions, "q": q, "k": k, "cos_sin_cache": cos_sin_cache,
                  "head_dim": head_dim}
        _check(op, arrays, "positions", (_I32,), 1)
        _check(op, arrays, "q", (_F32,), 2, True)
        _check(op, arrays, "k", (_F32,), 2, True)
        _check(op, arrays, "cos_sin_cache", (_F32,), 2)
        cdef int64_t T = positions.shape[0], D = head_dim, R = cos_sin_cache.shape[1]
        cdef int64_t max_pos = cos_sin_cache.shape[0]
        if D <= 0 or q.shape[0] != T or k.shape[0] != T or q.shape[1] % D or k.shape[1] % D:
            _fail(op, "need q (T, Hq*D), k (T, Hkv*D)", arrays)
        if R <= 0 or R % 2 or R > D:
            _fail(op, "rot_dim = cos_sin_cache.shape[1] must be even and <= head_dim", arrays)
        cdef int64_t Hq = q.shape[1] // D, Hkv = k.shape[1] // D
        cdef int neox = bool(is_neox), nt = self._nthreads, st
        cdef const int32_t* pp = <const int32_t*>_ptr(positions)
        cdef float* qp = <float*>_ptr(q)
        cdef float* kp = <float*>_ptr(k)
        cdef const float* cp = <const float*>_ptr(cos_sin_cache)
        with nogil:
            st = taper_rotary_embedding(pp, qp, kp, cp, T, Hq, Hkv, D, R, max_pos, neox, nt)
        _status(st, op, arrays)

    def silu_and_mul(self, x, out):
        self._gated("silu_and_mul", x, out, taper_silu_and_mul)

    def gelu_tanh_and_mul(self, x, out):
        self._gated("gelu_tanh_and_mul", x, out, taper_gelu_tanh_and_mul)

    def clamped_swiglu(self, x, out, alpha, limit):
        """NumPy, in float32 (GPT-OSS's experts: the reference of cuda/activation.cu's)."""
        op = "clamped_swiglu"
        arrays = {"x": x, "out": out, "alpha": alpha, "limit": limit}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        I = out.shape[1]
        if x.shape[1] != 2 * I or out.shape[0] != x.shape[0]:
            _fail(op, "need x (T, 2I), out (T, I)", arrays)
        if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
            _fail(op, "need a finite alpha and a finite limit > 0", arrays)
        gate = np.minimum(x[:, :I], np.float32(limit))
        up = np.clip(x[:, I:], np.float32(-limit), np.float32(limit))
        glu = gate / (np.float32(1.0) + np.exp(np.float32(-alpha) * gate))
        np.multiply(up + np.float32(1.0), glu, out=out)

    # ---- vision encoders (pyx/cpu_vision.py)

    def gelu(self, x, out):
        op = "gelu"
        arrays = {"x": x, "out": out}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        if x.shape[0] != out.shape[0] or x.shape[1] != out.shape[1]:
            _fail(op, "need x, out (T, N)", arrays)
        cpu_vision.gelu(x, out)

    def encoder_attention(self, out, q, k, v, cu_seqlens, scale):
        op = "encoder_attention"
        arrays = {"out": out, "q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}
        for name in ("q", "k", "v"):
            _check(op, arrays, name, (_F32,), 3)
        _check(op, arrays, "out", (_F32,), 3, True)
        _check(op, arrays, "cu_seqlens", (_I32,), 1)
        if not (q.shape == k.shape == v.shape == out.shape):
            _fail(op, "need out, q, k, v of one shape (N, H, D)", arrays)
        if (len(cu_seqlens) < 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0]
                or bool((np.diff(cu_seqlens) < 0).any())):
            _fail(op, "cu_seqlens must rise from 0 to N", arrays)
        cpu_vision.encoder_attention(out, q, k, v, cu_seqlens, float(scale))

    # ---- fused MoE (pyx/cpu_moe.py: the reference of cuda/moe.cu)

    def stack_experts(self, weights):
        """The list, and in `data` moe_experts' part table (parts, starts: expert e's weight is
        parts[starts[e]:starts[e + 1]], pointers into the listed arrays) where every expert is a
        float array or ggml blocks; None where one is not (FP8, int4: moe_experts runs those
        expert by expert through linear)."""
        w0 = weights[0]
        shape = (len(weights), w0.shape[0], w0.shape[1])
        for w in weights:
            if tuple(w.shape) != shape[1:]:
                raise ValueError(f"stack_experts: experts of shapes {tuple(w0.shape)} and "
                                 f"{tuple(w.shape)}; every expert must have the first's")
        return StackedExperts(shape, list(weights), self._moe_part_table(weights))

    def _moe_part_table(self, weights):
        rows, starts = [], [0]
        for w in weights:
            if isinstance(w, QuantizedWeight):
                split = int(self.act_split or w.exact_activations)
                for qtype, blocks in w.quant_parts:
                    if blocks.shape[1] != _row_bytes(qtype, w.k) or not blocks.flags.c_contiguous:
                        raise ValueError(f"stack_experts: a quant part of type {qtype} has rows "
                                         f"of {blocks.shape[1]} bytes")
                    rows.append((blocks.ctypes.data, blocks.shape[0], -1, qtype, split, 0))
            elif (isinstance(w, np.ndarray) and w.ndim == 2 and _wdtype(w) >= 0
                  and w.flags.c_contiguous):
                rows.append((w.ctypes.data, w.shape[0], _wdtype(w), 0, 0, 0))
            else:
                return None
            starts.append(len(rows))
        return np.array(rows, _MOE_PART), np.array(starts, np.int64)

    def gated_delta_conv_decode(self, proj, taps, conv_state, src, slots, fresh, acc):
        """The gated DeltaNet's causal conv1d for B sequences of one token each, before silu
        (gated_delta_kernels.h): proj (B, >= C) -> acc (B, C); conv_state (rows, K - 1, C) rows
        src read (fresh: zeros), rows slots written."""
        op = "gated_delta_conv_decode"
        arrays = {"proj": proj, "taps": taps, "conv_state": conv_state, "src": src,
                  "slots": slots, "fresh": fresh, "acc": acc}
        _check(op, arrays, "taps", (_F32,), 2)
        _check(op, arrays, "conv_state", (_F32,), 3, True)
        _check(op, arrays, "acc", (_F32,), 2, True)
        cdef int64_t B = acc.shape[0], C = acc.shape[1], K = taps.shape[0]
        cdef int64_t rows = conv_state.shape[0]
        _check(op, arrays, "proj", (_F32,), 2)
        if proj.shape[0] != B or proj.shape[1] < C:
            _fail(op, "proj must be (B, >= C)", arrays)
        if taps.shape[1] != C or conv_state.shape[1] != K - 1 or conv_state.shape[2] != C:
            _fail(op, "taps must be (K, C), conv_state (rows, K - 1, C), acc (B, C)", arrays)
        _check_rows(op, arrays, B)
        cdef int64_t pcols = proj.shape[1]
        cdef const float* pp = <const float*>_ptr(proj)
        cdef const float* tp = <const float*>_ptr(taps)
        cdef float* cp = <float*>_ptr(conv_state)
        cdef const int64_t* srcp = <const int64_t*>_ptr(src)
        cdef const int64_t* slp = <const int64_t*>_ptr(slots)
        cdef const uint8_t* fp = <const uint8_t*>_ptr(fresh)
        cdef float* ap = <float*>_ptr(acc)
        cdef int st
        with nogil:
            st = taper_gated_delta_conv_decode(pp, pcols, tp, cp, srcp, slp, fp, ap, B, rows, C,
                                               K)
        _status(st, op, arrays)

    def gated_delta_recurrent_decode(self, mixed, decay, beta, gate, norm_weight, ssm_state,
                                     src, slots, fresh, core, int64_t num_k_heads, float eps):
        """The gated DeltaNet's delta rule and gated RMSNorm for B sequences of one token each
        (gated_delta_kernels.h): mixed (B, C) after silu, decay and beta (B, Hv), gate (B, Hv *
        dv) silu(z) -> core (B, Hv * dv); the recurrent state (rows, Hv, dk, dv) rows src read
        (fresh: zeros), rows slots written."""
        op = "gated_delta_recurrent_decode"
        arrays = {"mixed": mixed, "decay": decay, "beta": beta, "gate": gate,
                  "norm_weight": norm_weight, "ssm_state": ssm_state, "src": src, "slots": slots,
                  "fresh": fresh, "core": core}
        for name in ("mixed", "decay", "beta", "gate"):
            _check(op, arrays, name, (_F32,), 2)
        _check(op, arrays, "norm_weight", (_F32,), 1)
        _check(op, arrays, "ssm_state", (_F32,), 4, True)
        _check(op, arrays, "core", (_F32,), 2, True)
        cdef int64_t B = mixed.shape[0], rows = ssm_state.shape[0], nv = ssm_state.shape[1]
        cdef int64_t dk = ssm_state.shape[2], dv = ssm_state.shape[3], nk = num_k_heads
        if nk < 1 or nv % nk or mixed.shape[1] != 2 * nk * dk + nv * dv:
            _fail(op, f"mixed must be (B, 2 * {nk} * dk + Hv * dv) with Hv a multiple of "
                  f"num_k_heads {nk}", arrays)
        for name in ("decay", "beta"):
            if arrays[name].shape[0] != B or arrays[name].shape[1] != nv:
                _fail(op, f"{name} must be (B, Hv)", arrays)
        for name in ("gate", "core"):
            if arrays[name].shape[0] != B or arrays[name].shape[1] != nv * dv:
                _fail(op, f"{name} must be (B, Hv * dv)", arrays)
        if norm_weight.shape[0] != dv:
            _fail(op, "norm_weight must be (dv,)", arrays)
        _check_rows(op, arrays, B)
        cdef const float* mp = <const float*>_ptr(mixed)
        cdef const float* dp = <const float*>_ptr(decay)
        cdef const float* bp = <const float*>_ptr(beta)
        cdef const float* gp = <const float*>_ptr(gate)
        cdef const float* wp = <const float*>_ptr(norm_weight)
        cdef float* sp = <float*>_ptr(ssm_state)
        cdef const int64_t* srcp = <const int64_t*>_ptr(src)
        cdef const int64_t* slp = <const int64_t*>_ptr(slots)
        cdef const uint8_t* fp = <const uint8_t*>_ptr(fresh)
        cdef float* op_ = <float*>_ptr(core)
        cdef int st
        with nogil:
            st = taper_gated_delta_recurrent_decode(mp, dp, bp, gp, wp, sp, srcp, slp, fp, op_, B,
                                                    rows, nk, nv, dk, dv, eps)
        _status(st, op, arrays)

    def moe_experts(self, x, gate_up, down, topk_ids, topk_weights, activation, out):
        op = "moe_experts"
        cdef int64_t T, H, I, k, E
        T, H, I, k, E = cpu_moe.check_experts(op, x, gate_up, down, topk_ids, topk_weights,
                                              activation, out)
        if gate_up.data is None or down.data is None:
            return cpu_moe.moe_experts(self, x, gate_up, down, topk_ids, topk_weights,
                                       activation, out)
        arrays = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "out": out}
        cdef cnp.ndarray gparts = gate_up.data[0], gstarts = gate_up.data[1]
        cdef cnp.ndarray dparts = down.data[0], dstarts = down.data[1]
        if gstarts.shape[0] != E + 1 or dstarts.shape[0] != E + 1:
            _fail(op, "gate_up and down must be stack_experts' stacks of E experts", arrays)
        cdef int act = TAPER_MOE_SILU if activation == "silu" else TAPER_MOE_GELU_TANH
        cdef int isa = self._isa, nt = self._nthreads, inv = self.batch_invariant
        cdef int i8 = self.prefill_int8, st
        cdef const float* xp = <const float*>_ptr(x)
        cdef const int64_t* ip = <const int64_t*>_ptr(topk_ids)
        cdef const float* wp = <const float*>_ptr(topk_weights)
        cdef const taper_moe_part* gp = <const taper_moe_part*>_ptr(gparts)
        cdef const int64_t* gs = <const int64_t*>_ptr(gstarts)
        cdef const taper_moe_part* dp = <const taper_moe_part*>_ptr(dparts)
        cdef const int64_t* ds = <const int64_t*>_ptr(dstarts)
        cdef float* outp = <float*>_ptr(out)
        with nogil:
            st = taper_moe_experts(isa, xp, ip, wp, gp, gs, dp, ds, act, outp, T, H, I, k, E,
                                   inv, i8, nt)
        if st == TAPER_ERR_ARG:
            _fail(op, "an expert's weight parts do not cover its rows", arrays)
        _status(st, op, arrays)

    def moe_align(self, topk_ids, num_experts, block_m, sorted_ids, block_expert, expert_offsets,
                  num_padded):
        cpu_moe.moe_align(topk_ids, num_experts, block_m, sorted_ids, block_expert,
                          expert_offsets, num_padded)

    def moe_grouped_linear(self, x, weights, sorted_ids, block_expert, num_padded, x_div,
                           block_m, out):
        cpu_moe.moe_grouped_linear(self.linear, x, weights, sorted_ids, block_expert, num_padded,
                                   x_div, block_m, out)

    def moe_combine(self, y, topk_weights, topk_ids, num_experts, out):
        cpu_moe.moe_combine(y, topk_weights, topk_ids, num_experts, out)

    cdef _gated(self, str op, x, out, gated_kernel kernel):
        """out = act(x[:, :I]) * x[:, I:] through one of the gated-activation kernels."""
        arrays = {"x": x, "out": out}
        _check(op, arrays, "x", (_F32,), 2)
        _check(op, arrays, "out", (_F32,), 2, True)
        cdef int64_t T = x.shape[0], inter = out.shape[1]
        if x.shape[1] != 2 * inter or out.shape[0] != T:
            _fail(op, "need x (T, 2I), out (T, I)", arrays)
        cdef const float* xp = <const float*>_ptr(x)
        cdef float* outp = <float*>_ptr(out)
        cdef int nt = self._nthreads, isa = self._isa, st
        with nogil:
            st = kernel(isa, xp, outp, T, inter, nt)
        _status(st, op, arrays)

    def softcap(self, x, cap):
        op = "softcap"
        arrays = {"x": x, "cap": cap}
        _check(op, arrays, "x", (_F32,), 2, True)
        cdef double c = float(cap)
        if not (c > 0.0 and math.isfinite(c)):
            _fail(op, "cap must be a finite number > 0", arrays)
        cdef int64_t n = x.size
        cdef float* xp = <float*>_ptr(x)
        cdef float cf = <float>c
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_softcap(self._isa, xp, n, cf, nt)
        _status(st, op, arrays)

    def scale(self, x, s):
        op = "scale"
        arrays = {"x": x, "s": s}
        _check(op, arrays, "x", (_F32,), 2, True)
        cdef double sd = float(s)
        if not math.isfinite(sd):
            _fail(op, "s must be a finite number", arrays)
        cdef int64_t n = x.size
        cdef float* xp = <float*>_ptr(x)
        cdef float sf = <float>sd
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_scale(xp, n, sf, nt)
        _status(st, op, arrays)

    def reshape_and_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        if k_scale is not None or v_scale is not None or getattr(k_cache, "dtype", None) == _U8:
            return self._reshape_and_cache_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale,
                                               v_scale)
        op = "reshape_and_cache"
        arrays = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache,
                  "slot_mapping": slot_mapping}
        _check(op, arrays, "k", (_F32,), 3)
        _check(op, arrays, "v", (_F32,), 3)
        _check(op, arrays, "k_cache", (_F32,), 4, True)
        _check(op, arrays, "v_cache", (_F32,), 4, True)
        _check(op, arrays, "slot_mapping", (_I32,), 1)
        cdef int64_t T = k.shape[0], Hkv = k.shape[1], D = k.shape[2]
        cdef int64_t NB = k_cache.shape[0], BS = k_cache.shape[1]
        if v.shape != k.shape or slot_mapping.shape[0] != T:
            _fail(op, "need k, v (T, Hkv, D) and slot_mapping (T,)", arrays)
        if k_cache.shape != v_cache.shape or k_cache.shape[2] != Hkv or k_cache.shape[3] != D:
            _fail(op, "need k_cache, v_cache (NB, BS, Hkv, D)", arrays)
        cdef const float* kp = <const float*>_ptr(k)
        cdef const float* vp = <const float*>_ptr(v)
        cdef float* kcp = <float*>_ptr(k_cache)
        cdef float* vcp = <float*>_ptr(v_cache)
        cdef const int32_t* sp = <const int32_t*>_ptr(slot_mapping)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_reshape_and_cache(kp, vp, kcp, vcp, sp, T, Hkv, D, NB, BS, nt)
        _status(st, op, arrays)

    def paged_attention(self, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window, k_scale=None, v_scale=None, softcap=0.0,
                        sinks=None, attention_chunk=0):
        if attention_chunk:     # pyx/chunked_attention.py: the batch cut into pieces
            chunk = check_masks("paged_attention", sinks, attention_chunk, q.shape[1], 0)
            tables, lens, starts = chunked_batch(block_tables, seq_lens, query_start_loc, chunk,
                                                 k_cache.shape[1])
            return self.paged_attention(out, q, k_cache, v_cache, tables, lens, starts, scale,
                                        sliding_window, k_scale, v_scale, softcap, sinks)
        if k_scale is not None or v_scale is not None or getattr(k_cache, "dtype", None) == _U8:
            return self._paged_attention_fp8(out, q, k_cache, v_cache, block_tables, seq_lens,
                                             query_start_loc, scale, sliding_window, k_scale,
                                             v_scale, softcap, sinks)
        op = "paged_attention"
        arrays = {"out": out, "q": q, "k_cache": k_cache, "v_cache": v_cache,
                  "block_tables": block_tables, "seq_lens": seq_lens,
                  "query_start_loc": query_start_loc}
        _check(op, arrays, "q", (_F32,), 3)
        _check(op, arrays, "k_cache", (_F32,), 4)
        _check(op, arrays, "v_cache", (_F32,), 4)
        if v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[2]:
            _fail(op, "need k_cache, v_cache (NB, BS, Hkv, D) with q's D", arrays)
        cdef int64_t sw = _check_attention(op, arrays, sliding_window)
        cdef float cap = _check_softcap(op, arrays, softcap)
        cdef const float* snp = _check_sinks(op, arrays, sinks, q.shape[1])
        cdef int64_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2]
        cdef int64_t NB = k_cache.shape[0], BS = k_cache.shape[1], Hkv = k_cache.shape[2]
        cdef int64_t B = seq_lens.shape[0], MB = block_tables.shape[1]
        cdef float sc = scale
        cdef float* outp = <float*>_ptr(out)
        cdef const float* qp = <const float*>_ptr(q)
        cdef const float* kcp = <const float*>_ptr(k_cache)
        cdef const float* vcp = <const float*>_ptr(v_cache)
        cdef const int32_t* btp = <const int32_t*>_ptr(block_tables)
        cdef const int32_t* slp = <const int32_t*>_ptr(seq_lens)
        cdef const int32_t* qsp = <const int32_t*>_ptr(query_start_loc)
        cdef int nt = self._nthreads, st, inv = self.batch_invariant
        with nogil:
            st = taper_paged_attention(self._isa, outp, qp, kcp, vcp, btp, slp, qsp, T, B, Hq, Hkv, D, NB,
                                       BS, MB, sc, sw, cap, snp, inv, nt)
        _status(st, op, arrays)

    def mla_decode_attention(self, out, q, cache, block_tables, seq_lens, scale):
        """paged_attention's numbers with the cache as both K and V (the latent is the value's
        first Dv values), one query row each, by its own kernel (pyx/mla_kernels.c: the query
        heads as vector lanes over each cached row)."""
        op = "mla_decode_attention"
        arrays = {"out": out, "q": q, "cache": cache, "block_tables": block_tables,
                  "seq_lens": seq_lens}
        _check(op, arrays, "out", (_F32,), 3, True)
        _check(op, arrays, "q", (_F32,), 3)
        _check(op, arrays, "cache", (_F32,), 4)
        _check(op, arrays, "block_tables", (_I32,), 2)
        _check(op, arrays, "seq_lens", (_I32,), 1)
        B, Hq, D = q.shape
        if (cache.shape[2] != 1 or cache.shape[3] != D or out.shape[:2] != (B, Hq)
                or out.shape[2] > D or seq_lens.shape[0] != B
                or block_tables.shape[0] != B):
            _fail(op, "need out (B, Hq, Dv), q (B, Hq, D), cache (NB, BS, 1, D) with Dv <= D, "
                      "block_tables (B, MB), seq_lens (B,)", arrays)
        cdef float* outp = <float*>_ptr(out)
        cdef const float* qp = <const float*>_ptr(q)
        cdef const float* cp = <const float*>_ptr(cache)
        cdef const int32_t* btp = <const int32_t*>_ptr(block_tables)
        cdef const int32_t* slp = <const int32_t*>_ptr(seq_lens)
        cdef int64_t nb = B, hq = Hq, d = D, dv = out.shape[2], NB = cache.shape[0]
        cdef int64_t BS = cache.shape[1], MB = block_tables.shape[1]
        cdef float sc = scale
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_mla_decode_attention(self._isa, outp, qp, cp, btp, slp, nb, hq, d, dv, NB,
                                            BS, MB, sc, nt)
        _status(st, op, arrays)

    # ---- FP8 KV cache (uint8 e4m3 codes, per-KV-head scales): the same ops' fp8 variants

    def _reshape_and_cache_fp8(self, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        op = "reshape_and_cache"
        arrays = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache,
                  "slot_mapping": slot_mapping, "k_scale": k_scale, "v_scale": v_scale}
        _check(op, arrays, "k", (_F32,), 3)
        _check(op, arrays, "v", (_F32,), 3)
        _check(op, arrays, "slot_mapping", (_I32,), 1)
        cdef int64_t T = k.shape[0], Hkv = k.shape[1], D = k.shape[2]
        if v.shape != k.shape or slot_mapping.shape[0] != T:
            _fail(op, "need k, v (T, Hkv, D) and slot_mapping (T,)", arrays)
        _check_fp8_cache(op, arrays, Hkv, D, True)
        cdef int64_t NB = k_cache.shape[0], BS = k_cache.shape[1]
        cdef const float* kp = <const float*>_ptr(k)
        cdef const float* vp = <const float*>_ptr(v)
        cdef uint8_t* kcp = <uint8_t*>_ptr(k_cache)
        cdef uint8_t* vcp = <uint8_t*>_ptr(v_cache)
        cdef const float* ksp = <const float*>_ptr(k_scale)
        cdef const float* vsp = <const float*>_ptr(v_scale)
        cdef const int32_t* sp = <const int32_t*>_ptr(slot_mapping)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_reshape_and_cache_fp8(kp, vp, kcp, vcp, ksp, vsp, sp, T, Hkv, D, NB, BS, nt)
        _status(st, op, arrays)

    def _paged_attention_fp8(self, out, q, k_cache, v_cache, block_tables, seq_lens,
                             query_start_loc, scale, sliding_window, k_scale, v_scale, softcap,
                             sinks=None):
        op = "paged_attention"
        arrays = {"out": out, "q": q, "k_cache": k_cache, "v_cache": v_cache,
                  "block_tables": block_tables, "seq_lens": seq_lens,
                  "query_start_loc": query_start_loc, "k_scale": k_scale, "v_scale": v_scale}
        _check(op, arrays, "q", (_F32,), 3)
        _check(op, arrays, "k_cache", (_U8,), 4)
        _check_fp8_cache(op, arrays, k_cache.shape[2], q.shape[2], False)
        cdef int64_t sw = _check_attention(op, arrays, sliding_window)
        cdef float cap = _check_softcap(op, arrays, softcap)
        cdef const float* snp = _check_sinks(op, arrays, sinks, q.shape[1])
        cdef int64_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2]
        cdef int64_t NB = k_cache.shape[0], BS = k_cache.shape[1], Hkv = k_cache.shape[2]
        cdef int64_t B = seq_lens.shape[0], MB = block_tables.shape[1]
        cdef float sc = scale
        cdef float* outp = <float*>_ptr(out)
        cdef const float* qp = <const float*>_ptr(q)
        cdef const uint8_t* kcp = <const uint8_t*>_ptr(k_cache)
        cdef const uint8_t* vcp = <const uint8_t*>_ptr(v_cache)
        cdef const float* ksp = <const float*>_ptr(k_scale)
        cdef const float* vsp = <const float*>_ptr(v_scale)
        cdef const int32_t* btp = <const int32_t*>_ptr(block_tables)
        cdef const int32_t* slp = <const int32_t*>_ptr(seq_lens)
        cdef const int32_t* qsp = <const int32_t*>_ptr(query_start_loc)
        cdef int nt = self._nthreads, st, inv = self.batch_invariant
        with nogil:
            st = taper_paged_attention_fp8(self._isa, outp, qp, kcp, vcp, ksp, vsp, btp, slp, qsp,
                                           T, B, Hq, Hkv, D, NB, BS, MB, sc, sw, cap, snp, inv,
                                           nt)
        _status(st, op, arrays)

    def argmax(self, logits, out):
        op = "argmax"
        arrays = {"logits": logits, "out": out}
        _check(op, arrays, "logits", (_F32,), 2)
        _check(op, arrays, "out", (_I64,), 1, True)
        cdef int64_t B = logits.shape[0], V = logits.shape[1]
        if out.shape[0] != B or V == 0:
            _fail(op, "need logits (B, V) with V > 0 and out (B,)", arrays)
        cdef const float* lp = <const float*>_ptr(logits)
        cdef int64_t* outp = <int64_t*>_ptr(out)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_argmax(lp, outp, B, V, nt)
        _status(st, op, arrays)

    def gumbel_sample(self, logits, seeds, positions, out):
        op = "gumbel_sample"
        arrays = {"logits": logits, "seeds": seeds, "positions": positions, "out": out}
        _check(op, arrays, "logits", (_F32,), 2)
        _check(op, arrays, "seeds", (_U64,), 1)
        _check(op, arrays, "positions", (_I64,), 1)
        _check(op, arrays, "out", (_I64,), 1, True)
        cdef int64_t B = logits.shape[0], V = logits.shape[1]
        if seeds.shape[0] != B or positions.shape[0] != B or out.shape[0] != B or V == 0:
            _fail(op, "need logits (B, V) with V > 0 and seeds, positions, out (B,)", arrays)
        cdef const float* lp = <const float*>_ptr(logits)
        cdef const uint64_t* sp = <const uint64_t*>_ptr(seeds)
        cdef const int64_t* pp = <const int64_t*>_ptr(positions)
        cdef int64_t* outp = <int64_t*>_ptr(out)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_gumbel_sample(lp, sp, pp, outp, B, V, nt)
        _status(st, op, arrays)

    def apply_token_bitmask(self, logits, bitmask, rows):
        op = "apply_token_bitmask"
        arrays = {"logits": logits, "bitmask": bitmask, "rows": rows}
        _check(op, arrays, "logits", (_F32,), 2, True)
        _check(op, arrays, "bitmask", (_I32,), 2)
        _check(op, arrays, "rows", (_I32,), 1)
        cdef int64_t B = logits.shape[0], V = logits.shape[1], R = rows.shape[0]
        if bitmask.shape[0] != B or bitmask.shape[1] != (V + 31) // 32:
            _fail(op, "need bitmask (B, ceil(V / 32)) for logits (B, V)", arrays)
        cdef float* lp = <float*>_ptr(logits)
        cdef const int32_t* mp = <const int32_t*>_ptr(bitmask)
        cdef const int32_t* rp = <const int32_t*>_ptr(rows)
        cdef int nt = self._nthreads, st
        with nogil:
            st = taper_apply_token_bitmask(lp, mp, rp, B, V, R, nt)
        if st == TAPER_ERR_ARG:
            _fail(op, "a row index is outside [0, B)", arrays)
        _status(st, op, arrays)

    # ---- logits processing (NumPy, pyx/cpu_sampling.py)

    def apply_penalties(self, logits, rows, cols, bias, rep, pres_freq):
        op = "apply_penalties"
        arrays = {"logits": logits, "rows": rows, "cols": cols, "bias": bias, "rep": rep,
                  "pres_freq": pres_freq}
        _check(op, arrays, "logits", (_F32,), 2, True)
        _check(op, arrays, "rows", (_I32,), 1)
        _check(op, arrays, "cols", (_I32,), 1)
        for name in ("bias", "rep", "pres_freq"):
            _check(op, arrays, name, (_F32,), 1)
        cdef int64_t B = logits.shape[0], V = logits.shape[1], N = rows.shape[0]
        if cols.shape[0] != N or bias.shape[0] != N or rep.shape[0] != N or pres_freq.shape[0] != N:
            _fail(op, "need rows, cols, bias, rep, pres_freq all (N,)", arrays)
        if N == 0:
            return
        if rows.min() < 0 or rows.max() >= B or cols.min() < 0 or cols.max() >= V:
            _fail(op, "an entry's (row, col) is outside logits (B, V)", arrays)
        keys = rows.astype(np.int64) * V + cols
        keys.sort()
        if N > 1 and not (keys[1:] != keys[:-1]).all():
            _fail(op, "(row, col) entries must be distinct", arrays)
        cpu_sampling.apply_penalties(logits, rows, cols, bias, rep, pres_freq)

    def filter_logits(self, logits, temperature, top_k, top_p, min_p):
        op = "filter_logits"
        arrays = {"logits": logits, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                  "min_p": min_p}
        _check(op, arrays, "logits", (_F32,), 2, True)
        _check(op, arrays, "temperature", (_F32,), 1)
        _check(op, arrays, "top_k", (_I32,), 1)
        _check(op, arrays, "top_p", (_F32,), 1)
        _check(op, arrays, "min_p", (_F32,), 1)
        cdef int64_t B = logits.shape[0]
        if (temperature.shape[0] != B or top_k.shape[0] != B or top_p.shape[0] != B
                or min_p.shape[0] != B):
            _fail(op, "need logits (B, V) and temperature, top_k, top_p, min_p (B,)", arrays)
        if B == 0:
            return
        if not (temperature >= 0).all() or not np.isfinite(temperature).all():
            _fail(op, "temperature must be finite and >= 0", arrays)
        if (top_k < 0).any():
            _fail(op, "top_k must be >= 0 (0 = off)", arrays)
        if not ((top_p > 0) & (top_p <= 1)).all():
            _fail(op, "top_p must be in (0, 1] (1 = off)", arrays)
        if not ((min_p >= 0) & (min_p <= 1)).all():
            _fail(op, "min_p must be in [0, 1] (0 = off)", arrays)
        cpu_sampling.filter_logits(logits, temperature, top_k, top_p, min_p)

"""CUDA backend: the op table of pyx/backend.pyx on CuPy arrays, backed by cuda/*.cu.

Two layers, as CuPy's own driver wrappers: `launch_*` functions take device pointers as integers,
call one C launcher of cuda/taper_cuda.h inside `with nogil:` and turn a nonzero status into a
CudaError naming the op and the sizes; `CudaBackend` validates CuPy arrays (dtype, shape,
contiguity, device) and calls them. The module imports without CuPy and without a GPU, where every
launch fails with cudaErrorInsufficientDriver (statically linked cudart), which CI checks.

Activations are bf16, f16 or f32 (`dtype`), accumulated in float32; vectors (norm weights,
biases, the RoPE cos/sin cache, FP8 scales, logits) are float32 as on the CPU. Dense GEMMs go
through cuBLAS (the libcublas CuPy loads, on a handle of our own, so no extra link dependency).
All work is queued on one stream, `backend.stream`, with no synchronization inside an op, so a
decode step can be captured in a CUDA Graph. Where the backend has a choice of kernel, the
KernelConfig it is built with picks it (pyx/kernel_config.py: the values, the defaults and why):
decode=split|simple (flash-decoding: split-K decode attention with the split count of
pyx/decode_splits.py, or one pass per sequence), prefill=fa3|fa2|simple (prefill attention: the
warp-specialized wgmma form of FlashAttention-2 for Hopper, which runs fa2 on other GPUs, the
FlashAttention-2 kernel with GQA packing and a cp.async ring, or the simple one, which also serves
the inputs the tensor-core kernels lack), marlin=pipeline (the pipelined Marlin W4A16 GEMM),
fp8=cutlass (FP8 block-wise weights through CUTLASS on sm_90a instead of dequantized once to bf16),
fp8_gemv=on (FP8 block-wise weights kept e4m3, read by the FP8 GEMV kernel for small M),
sampling=fused (the sampler's penalties, argmax, filter and Gumbel draw in one launch,
`sample_fused`) and moe=fused (`fused_moe`: MoE blocks take the grouped-GEMM path of cuda/moe.cu
instead of one linear per expert). Each choice is also a public attribute (split_k, prefill_kernel,
marlin_pipeline, ...) that tests and benchmarks may flip on a built backend.
"""
import logging
import math
import os

import numpy as np
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint64_t

from pyx.backend cimport Backend, describe_arrays as _desc, fail as _fail
from pyx.cuda_launch cimport *
from pyx import attention_dispatch, cpu_moe
from pyx.decode_splits import decode_num_splits
from pyx.moe import StackedExperts
from pyx.weights.fp8 import Fp8Weight
from pyx.weights.ggml import QuantizedWeight
from pyx.weights.int4 import Int4Weight
from pyx.weights.marlin import MarlinWeight, repack_int4


class CudaError(RuntimeError):
    """A CUDA launcher returned an error status."""


def device_count():
    """Visible CUDA devices; 0 without a driver or a device (never raises)."""
    return taper_cuda_device_count()


cdef _check_status(int st, str op, dict sizes):
    if st == TAPER_CUDA_OK:
        return
    desc = ", ".join(f"{k}={v}" for k, v in sizes.items())
    msg = taper_cuda_error_string(st).decode("utf-8", "replace")
    raise CudaError(f"{op}: {msg} (status {st}) [{desc}]")


include "cuda_launchers.pxi"


class DeviceFp8Weight:
    """Block-wise FP8 codes (N, K) and their 128 x 128 block scales on the device, for the
    CUTLASS GEMM (kernels fp8=cutlass on sm_90a; `cutlass`) and the small-M FP8 GEMV
    (fp8_gemv=on)."""

    def __init__(self, codes, scales, cutlass=True):
        self.codes, self.scales, self.cutlass = codes, scales, cutlass

    @property
    def shape(self):
        return tuple(self.codes.shape)


class DeviceMarlinWeight:
    """An int4 weight on the device in the Marlin layout (pyx/weights/marlin.py MarlinWeight)."""

    def __init__(self, qweight, scales, zeros, n, k, group_size):
        self.qweight, self.scales, self.zeros = qweight, scales, zeros
        self.n, self.k, self.group_size = n, k, group_size

    @property
    def shape(self):
        return self.n, self.k


# ---- validation

ACT_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_U64 = np.dtype(np.uint64)
_U8 = np.dtype(np.uint8)

# ggml-block weights: up to this many token rows take the int8 dot-product GEMV (decode), more
# go through weight panels of at most GGUF_PANEL_BYTES dequantized for cuBLAS (prefill).
cdef int64_t GGUF_MMVQ_MAX_M = 16
cdef int64_t GGUF_PANEL_BYTES = 64 << 20
# FP8 GEMV (cuda/fp8_gemv.cu) up to this many rows by default (the kernel takes 64). An estimate
# for an H100 until a GPU run measures the crossover: its float FMAs (M per weight byte) stay
# under the time of the weight bytes to about M = 8-16, and it beats the dequantized bf16
# weights through cuBLAS (twice the bytes) to about M = 20.
FP8_GEMV_MAX_M = 16


include "cuda_cublas.pxi"


def _dtype_code(dt):
    """TAPER_DT_* of an activation dtype, -1 for any other."""
    dt = np.dtype(dt)
    if dt == _F32:
        return TAPER_DT_F32
    if dt.name == "bfloat16":
        return TAPER_DT_BF16
    if dt == np.float16:
        return TAPER_DT_F16
    return -1


class _PoolScope:
    """`with` both an allocator scope and the backend's stream."""

    def __init__(self, allocator_scope, stream):
        self.allocator_scope, self.stream = allocator_scope, stream

    def __enter__(self):
        self.allocator_scope.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        return self.allocator_scope.__exit__(*exc)


class _StreamGraph:
    """A captured graph bound to the stream it replays on."""

    def __init__(self, graph, stream):
        self.graph, self.stream = graph, stream

    def launch(self):
        self.graph.launch(stream=self.stream)


# The prefill attention kernels (taper_cuda_paged_attention_prefill's variants) by their
# KernelConfig names; the tensor-core ones take bf16/f16 with a same-type cache and D 64 or 128,
# other batches the simple one.
PREFILL_VARIANTS = {"simple": 0, "fa2": 1, "fa3": 2}


log = logging.getLogger("taper.cuda")


cdef class CudaBackend(Backend):
    """Backend on CuPy arrays of one device with the kernels of cuda/.

    dtype: activation type, "bf16" (default), "f16" or "f32". device: the CUDA device index.
    kernels: a pyx.kernel_config.KernelConfig (or its string / dict form): the kernel choices
    above, read here once.
    """
    cdef readonly object stream, device
    cdef readonly int num_sms
    cdef int _act_code
    cdef object _cupy, _workspace, _panel, _retired, _cublas_workspace, _decode_occupancy
    cdef void* _blas_handle
    cdef public str prefill_kernel   # a PREFILL_VARIANTS name: kernels prefill
    cdef public bint split_k         # decode=split
    cdef public bint fp8_cutlass     # fp8=cutlass
    cdef public bint fp8_gemv        # fp8_gemv=on
    cdef public bint marlin_pipeline # marlin=pipeline
    cdef public int fp8_gemv_max_m   # FP8 weights take the GEMV up to this many rows
    cdef public int64_t max_context  # decode split-K sizes its partitions for this many keys
    cdef public int decode_splits    # > 0: this many split-K partitions (benchmarks); 0: the rule

    def __init__(self, dtype="bf16", device=0, kernels=None):
        cdef void* handle = NULL
        Backend.__init__(self, "cuda", kernels)
        if dtype not in ACT_DTYPES:
            raise ValueError(f"CudaBackend: dtype must be one of {list(ACT_DTYPES)}, got {dtype!r}")
        if taper_cuda_device_count() <= device:
            raise RuntimeError(f"CudaBackend: no CUDA device {device} (this machine has "
                               f"{taper_cuda_device_count()} usable devices)")
        try:
            import cupy
        except ImportError as e:
            raise RuntimeError("the CUDA backend needs CuPy: pip install 'taper[cuda13]' (or "
                               "[cuda12], matching the CUDA toolkit)") from e
        import ml_dtypes
        self._cupy = cupy
        self.xp = cupy
        self.act_dtype = np.dtype(getattr(ml_dtypes, ACT_DTYPES[dtype])
                                  if dtype == "bf16" else ACT_DTYPES[dtype])
        self._act_code = _dtype_code(self.act_dtype)
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.num_sms = self.device.attributes["MultiProcessorCount"]
        # A blocking stream: CuPy work that runs on the legacy default stream by mistake still
        # orders with it instead of racing.
        self.stream = cupy.cuda.Stream(non_blocking=False)
        self.stream.use()
        # Our own cuBLAS handle (see _load_cublas) on our stream, with its workspace given up
        # front so it allocates nothing inside a graph capture. The stream is set first: setting
        # it resets the workspace.
        _load_cublas()
        _check_cublas(_blas.create(&handle), "cublasCreate", dict(device=device))
        self._blas_handle = handle
        _check_cublas(_blas.set_stream(handle, <void*><size_t>self.stream.ptr),
                      "cublasSetStream", dict(device=device))
        self._cublas_workspace = cupy.empty(CUBLAS_WORKSPACE_BYTES, dtype=np.uint8)
        if _blas.set_workspace != NULL:
            _check_cublas(_blas.set_workspace(
                handle, <void*><size_t>self._cublas_workspace.data.ptr, CUBLAS_WORKSPACE_BYTES),
                "cublasSetWorkspace", dict(bytes=CUBLAS_WORKSPACE_BYTES))
        self._workspace = None
        self._panel = None
        self._retired = []
        k = self.kernels
        self.split_k = k.decode == "split"
        self.prefill_kernel = k.prefill
        if self.prefill_kernel == "fa3" and self.device.compute_capability != "90":
            # fa3's wgmma / setmaxnreg exist only in sm_90a code (H100, H200)
            log.warning("kernels prefill=fa3 needs compute capability 9.0, device %d has %s: "
                        "running fa2", device, self.device.compute_capability)
            self.prefill_kernel = "fa2"
        self.fp8_cutlass = k.fp8 == "cutlass"
        self.marlin_pipeline = k.marlin == "pipeline"
        self.fp8_gemv = k.fp8_gemv == "on"
        self.fused_sampling = k.sampling == "fused"
        self.fp8_gemv_max_m = FP8_GEMV_MAX_M
        self.max_context = 0
        self.decode_splits = 0
        self._decode_occupancy = {}

    def __dealloc__(self):
        if self._blas_handle != NULL and _blas.destroy != NULL:
            _blas.destroy(self._blas_handle)   # status ignored: nothing to do about it here
            self._blas_handle = NULL

    def __repr__(self):
        return (f"CudaBackend(device={self.device.id}, dtype={self.act_dtype.name}, "
                f"split_k={self.split_k}, prefill_kernel={self.prefill_kernel!r})")

    # ---- arrays

    def bind_thread(self):
        """Makes this backend's device and stream current on the calling thread (CuPy keeps both
        per thread): the engine thread calls it before running a step."""
        self.device.use()
        self.stream.use()

    def asarray(self, a):
        """A device copy of a host array, same dtype (a device array comes back C-contiguous;
        NumPy would refuse to convert it)."""
        if isinstance(a, self._cupy.ndarray):
            return self._cupy.ascontiguousarray(a)
        return self._cupy.asarray(np.ascontiguousarray(a))

    def place_weight(self, a, role=None):
        """A weight on the device: matrices in the activation dtype, vectors in float32. Takes
        a NumPy array (copied over), a CuPy one (cast in place on the device) or a packed
        format of pyx/weights/."""
        if isinstance(a, QuantizedWeight):  # ggml blocks (GGUF, --isq): the same bytes, moved
            for qtype, _ in a.quant_parts:
                if not taper_cuda_gguf_supported(qtype):
                    raise ValueError(f"ggml type {qtype} has no CUDA kernel")
            return QuantizedWeight([(t, self.asarray(b)) for t, b in a.quant_parts], a.k)
        if isinstance(a, Fp8Weight):       # FP8 codes with block scales
            return self._place_fp8(a)
        if isinstance(a, (Int4Weight, MarlinWeight)):  # int4 (GPTQ, AWQ, ...): Marlin
            m = repack_int4(a) if isinstance(a, Int4Weight) else a
            return DeviceMarlinWeight(self.asarray(m.qweight), self.asarray(m.scales),
                                      None if m.zeros is None else self.asarray(m.zeros),
                                      m.n, m.k, m.group_size)
        if not isinstance(a, (np.ndarray, self._cupy.ndarray)):
            raise ValueError(f"{type(a).__name__} weights are not yet supported on the CUDA "
                             "backend (serve this checkpoint with --cpu)")
        dtype = self.act_dtype if a.ndim == 2 else _F32
        if isinstance(a, np.ndarray):
            return self.asarray(a.astype(dtype, copy=False))
        return self._cupy.ascontiguousarray(a.astype(dtype, copy=False))

    def _place_fp8(self, w):
        """FP8 weights: by default dequantized once, on the device, to the activation dtype
        (cuBLAS then multiplies them: the simple path, twice the bytes of the codes). With
        kernels fp8=cutlass on an sm_90a device, 128 x 128 block-wise weights stay e4m3
        for the CUTLASS block-scaled GEMM (the tuned path, until a GPU run verifies it). With
        fp8_gemv=on they stay e4m3 too, for the small-M FP8 GEMV (any sm80+; larger M
        then goes through CUTLASS where it applies, else panels dequantized for cuBLAS)."""
        n, k = w.shape
        codes, scales = self.asarray(w.weight), self.asarray(w.scale)
        blocks128 = tuple(w.block) == (128, 128) and k % 128 == 0
        cutlass = (self.fp8_cutlass and blocks128 and n % 8 == 0
                   and self._act_code == TAPER_DT_BF16)
        if cutlass or (self.fp8_gemv and blocks128):
            return DeviceFp8Weight(codes, scales, cutlass)
        out = self._cupy.empty((n, k), self.act_dtype)
        launch_fp8_dequantize(codes.data.ptr, scales.data.ptr, out.data.ptr, n, k, w.block[0],
                              w.block[1], self._act_code, self._sptr())
        return out

    def to_host(self, a):
        return self._cupy.asnumpy(a, stream=self.stream) if isinstance(a, self._cupy.ndarray) else a

    def synchronize(self):
        self.stream.synchronize()

    # ---- CUDA graphs (engine/runner/cuda_graph.py)

    def new_graph_pool(self):
        """A private device memory pool for the graphs' allocations (a plain cudaMalloc pool:
        stream-ordered allocations would become memory nodes inside the graphs)."""
        return self._cupy.cuda.MemoryPool()

    def use_graph_pool(self, pool):
        """Context manager: device allocations inside come from `pool`, work runs on the stream."""
        return _PoolScope(self._cupy.cuda.using_allocator(pool.malloc), self.stream)

    def capture_graph(self, fn):
        """Calls fn() under stream capture and returns the graph; .launch() replays it on the
        backend's stream."""
        with self.stream:
            self.stream.begin_capture()
            try:
                fn()
            except BaseException:
                try:
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            graph = self.stream.end_capture()
        graph.upload(self.stream)      # instantiate now, so the first replay is not slower
        return _StreamGraph(graph, self.stream)

    def pinned_empty(self, n, dtype):
        """A NumPy array of n elements in page-locked host memory (async copies need it)."""
        dtype = np.dtype(dtype)
        mem = self._cupy.cuda.alloc_pinned_memory(max(int(n) * dtype.itemsize, 1))
        return np.frombuffer(mem, dtype, int(n))

    def copy_to_device_async(self, dst, src):
        """Enqueues a host-to-device copy on the backend's stream (no synchronization)."""
        dst.set(src, stream=self.stream)

    def kv_cache_dtype(self, str kind):
        """The KV cache element type: the activation dtype for "auto" (and "bf16" with bf16
        activations), e4m3 codes for "fp8"."""
        if kind == "auto" or kind == self.act_dtype.name or (kind == "bf16" and
                                                             self.act_dtype.name == "bfloat16"):
            return self.act_dtype
        if kind == "fp8":
            return _U8
        raise ValueError(f"a {kind} KV cache needs {kind} activations on the CUDA backend "
                         f"(these are {self.act_dtype.name}); use auto or fp8")

    def memory_info(self):
        """(free, total) bytes of the device."""
        return self._cupy.cuda.runtime.memGetInfo()

    cdef _check(self, str op, dict arrays, str name, object dtypes, int ndim, bint writable=False):
        a = arrays[name]
        if not isinstance(a, self._cupy.ndarray):
            _fail(op, f"{name} must be a CuPy array, got {type(a).__name__}", arrays)
        if a.ndim != ndim:
            _fail(op, f"{name} must have {ndim} dims", arrays)
        if a.dtype not in dtypes:
            _fail(op, f"{name} has dtype {a.dtype}, expected one of {[str(d) for d in dtypes]}",
                  arrays)
        if not a.flags.c_contiguous:
            _fail(op, f"{name} must be C-contiguous", arrays)
        if a.device.id != self.device.id:
            _fail(op, f"{name} is on device {a.device.id}, the backend on {self.device.id}",
                  arrays)

    cdef inline ptr_t _ptr(self, a):
        return a.data.ptr

    cdef inline ptr_t _sptr(self):
        return self.stream.ptr

    # ---- ops

    def embedding(self, token_ids, table, out):
        op, act = "embedding", (self.act_dtype,)
        arrays = {"token_ids": token_ids, "table": table, "out": out}
        if isinstance(table, QuantizedWeight):
            return self._quant_embedding(token_ids, table, out)
        self._check(op, arrays, "token_ids", (_I32,), 1)
        self._check(op, arrays, "table", act, 2)
        self._check(op, arrays, "out", act, 2, True)
        T, V, H = token_ids.shape[0], table.shape[0], table.shape[1]
        if out.shape != (T, H):
            _fail(op, "out must be (T, H)", arrays)
        launch_embedding(self._ptr(token_ids), self._ptr(table), self._ptr(out), T, V, H,
                         self._act_code, self._sptr())

    def linear(self, x, weight, bias, out):
        """cuBLAS GEMM, float32 accumulation; out may be the activation dtype or float32."""
        op, act = "linear", (self.act_dtype,)
        arrays = {"x": x, "weight": weight, "bias": bias, "out": out}
        if isinstance(weight, QuantizedWeight):
            return self._packed_linear(x, weight, bias, out, self._ggml_compute)
        if isinstance(weight, DeviceMarlinWeight):
            return self._packed_linear(x, weight, bias, out, self._marlin_compute)
        if isinstance(weight, DeviceFp8Weight):
            return self._packed_linear(x, weight, bias, out, self._fp8_compute)
        if not isinstance(weight, self._cupy.ndarray):
            _fail(op, f"{type(weight).__name__} weights are not yet supported on the CUDA backend",
                  arrays)
        self._check(op, arrays, "x", act, 2)
        self._check(op, arrays, "weight", act, 2)
        self._check(op, arrays, "out", (self.act_dtype, _F32), 2, True)
        cdef int64_t T = x.shape[0], K = x.shape[1], N = weight.shape[0]
        if weight.shape[1] != K or out.shape != (T, N):
            _fail(op, "need x (T, K), weight (N, K), out (T, N)", arrays)
        if bias is not None:
            self._check(op, arrays, "bias", (_F32,), 1)
            if bias.shape[0] != N:
                _fail(op, "bias must be (N,)", arrays)
        if T == 0:
            return
        self._gemm(self._ptr(weight), self._ptr(x), self._ptr(out), T, N, K, N,
                   _dtype_code(out.dtype))
        if bias is not None:
            launch_add_bias(self._ptr(out), self._ptr(bias), T, N, _dtype_code(out.dtype),
                            self._sptr())

    def lora_linear(self, x, lora_a, lora_b, ranks, parts, rows, seg_offsets, seg_slots, out):
        """cuBLAS per adapter segment on the gathered rows (pyx/cuda_lora.pxi); `rows` are not
        range-checked on the device (that would wait for it): the engine makes them."""
        _lora_linear(self, x, lora_a, lora_b, ranks, parts, rows, seg_offsets, seg_slots, out)

    def lora_linear_slots(self, x, lora_a, lora_b, parts, slot_of_row, out):
        """cuda/lora.cu's shrink and expand, the rows' slots read on the device: graph-safe
        (pyx/cuda_lora.pxi); slots past S are treated as -1, not checked (that would wait)."""
        _lora_linear_slots(self, x, lora_a, lora_b, parts, slot_of_row, out)

    cdef _gemm(self, ptr_t w, ptr_t x, ptr_t out, int64_t T, int64_t N, int64_t K,
               int64_t ldo, int out_code):
        """out[t, n] (row stride ldo) = sum_k x[t, k] * w[n, k] through cuBLAS, float32
        accumulation. Row-major out (T, N) = x (T, K) @ w (N, K)^T is the column-major product
        out^T (N, T) = op(A) B with A = w seen column-major as (K, N), transposed (lda = K), and
        B = x seen column-major as (K, T) (ldb = K); C = out^T with ldc = ldo. Host-pointer
        alpha/beta (a new handle's pointer mode), float for CUBLAS_COMPUTE_32F."""
        if T > INT32_MAX or N > INT32_MAX or K > INT32_MAX or ldo > INT32_MAX:
            raise ValueError(f"linear: cuBLAS sizes must fit in int32 [T={T}, N={N}, K={K}]")
        cdef int ab = CUDA_R_16BF if self._act_code == TAPER_DT_BF16 else (
            CUDA_R_16F if self._act_code == TAPER_DT_F16 else CUDA_R_32F)
        cdef int ct = CUDA_R_32F if out_code == TAPER_DT_F32 else ab
        cdef void* handle = self._blas_handle
        cdef int m = <int>N, n = <int>T, k = <int>K, ldc = <int>ldo, st
        with nogil:
            st = _blas.gemm_ex(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &_ONE, <const void*>w,
                               ab, k, <const void*>x, ab, k, &_ZERO, <void*>out, ct, ldc,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check_cublas(st, "linear (cublasGemmEx)", dict(T=T, N=N, K=K, a_type=ab, c_type=ct))

    def batched_linear(self, x, weight, out):
        """One cuBLAS strided-batched GEMM (as linear's layout per group), float32 accumulation."""
        op, act = "batched_linear", (self.act_dtype,)
        arrays = {"x": x, "weight": weight, "out": out}
        self._check(op, arrays, "x", act, 3)
        self._check(op, arrays, "weight", act, 3)
        self._check(op, arrays, "out", (self.act_dtype, _F32), 3, True)
        cdef int64_t G = x.shape[0], T = x.shape[1], K = x.shape[2], N = weight.shape[1]
        if weight.shape[0] != G or weight.shape[2] != K or out.shape != (G, T, N):
            _fail(op, "need x (G, T, K), weight (G, N, K), out (G, T, N)", arrays)
        if G == 0 or T == 0:
            return
        if T > INT32_MAX or N > INT32_MAX or K > INT32_MAX or G > INT32_MAX:
            _fail(op, "cuBLAS sizes must fit in int32", arrays)
        cdef int ab = CUDA_R_16BF if self._act_code == TAPER_DT_BF16 else (
            CUDA_R_16F if self._act_code == TAPER_DT_F16 else CUDA_R_32F)
        cdef int ct = CUDA_R_32F if _dtype_code(out.dtype) == TAPER_DT_F32 else ab
        cdef void* handle = self._blas_handle
        cdef int m = <int>N, n = <int>T, k = <int>K, g = <int>G, st
        cdef ptr_t w = self._ptr(weight), xp_ = self._ptr(x), o = self._ptr(out)
        with nogil:
            st = _blas.gemm_strided_batched_ex(
                handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &_ONE, <const void*>w, ab, k,
                <long long>N * K, <const void*>xp_, ab, k, <long long>T * K, &_ZERO, <void*>o, ct,
                m, <long long>T * N, g, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check_cublas(st, "batched_linear (cublasGemmStridedBatchedEx)",
                      dict(G=G, T=T, N=N, K=K, a_type=ab, c_type=ct))

    def _packed_linear(self, x, weight, bias, out, compute):
        """linear for packed weights (ggml blocks, Marlin int4, FP8 codes): the checks, then
        compute(x, weight, target) runs the format's kernels into an activation-dtype target
        (float32 logits go through a temporary, since the kernels write the activation dtype),
        then the bias."""
        op = "linear"
        arrays = {"x": x, "out": out, "bias": bias}
        self._check(op, arrays, "x", (self.act_dtype,), 2)
        self._check(op, arrays, "out", (self.act_dtype, _F32), 2, True)
        T, K, N = x.shape[0], x.shape[1], out.shape[1]
        if weight.shape != (N, K) or out.shape[0] != T:
            _fail(op, f"{type(weight).__name__} {weight.shape} does not map x to out", arrays)
        if bias is not None:
            self._check(op, arrays, "bias", (_F32,), 1)
            if bias.shape[0] != N:
                _fail(op, "bias must be (N,)", arrays)
        if T == 0:
            return
        target = out if out.dtype == self.act_dtype else self._cupy.empty(out.shape,
                                                                           self.act_dtype)
        compute(x, weight, target)
        if bias is not None:
            launch_add_bias(self._ptr(target), self._ptr(bias), T, N, self._act_code,
                            self._sptr())
        if target is not out:
            self._cupy.copyto(out, target)

    def _ggml_compute(self, x, weight, out):
        """ggml blocks stacked along N in parts (a fused weight may mix types); each part writes
        its column slice of out. Up to GGUF_MMVQ_MAX_M rows: int8 dot products on the blocks;
        more: panels of weight rows dequantized to the activation dtype, then cuBLAS."""
        cdef int64_t T = x.shape[0], K = x.shape[1], N = out.shape[1]
        cdef int64_t item = self.act_dtype.itemsize, col = 0, n, r0, rows, panel_rows
        for qtype, blocks in weight.quant_parts:
            n = blocks.shape[0]
            if T <= GGUF_MMVQ_MAX_M:
                ws = gguf_mmvq_workspace_bytes(T, K)
                launch_gguf_mmvq(qtype, self._ptr(x), blocks.data.ptr,
                                 self._ptr(out) + col * item, T, n, K, N, self._act_code,
                                 self._workspace_ptr(ws), ws, self._sptr())
            else:
                panel_rows = max(1, min(n, GGUF_PANEL_BYTES // (K * item)))
                panel = self._panel_ptr(panel_rows * K * item)
                for r0 in range(0, n, panel_rows):
                    rows = min(panel_rows, n - r0)
                    launch_gguf_dequantize(qtype, blocks.data.ptr + r0 * blocks.shape[1], panel,
                                           rows, K, self._act_code, self._sptr())
                    self._gemm(panel, self._ptr(x), self._ptr(out) + (col + r0) * item, T, rows,
                               K, N, self._act_code)
            col += n

    def _marlin_compute(self, x, weight, out):
        """W4A16 through the Marlin-layout GEMM: the simple kernel by default, the pipelined
        one with a global reduce for small M under kernels marlin=pipeline (falling back to the
        simple one for shapes it lacks)."""
        T, K, N = x.shape[0], x.shape[1], out.shape[1]
        args = (self._ptr(x), weight.qweight.data.ptr, weight.scales.data.ptr,
                self._opt_ptr(weight.zeros), self._ptr(out), T, N, K, weight.group_size,
                self._act_code)
        if self.marlin_pipeline:
            ws = taper_cuda_marlin_workspace_bytes(T, N, K, 1)
            try:
                launch_marlin_gemm(*args, 1, self._workspace_ptr(ws), ws, self._sptr())
                return
            except CudaError as e:  # shapes the tuned kernel lacks: the simple one runs
                if "status -1" not in str(e):
                    raise
        launch_marlin_gemm(*args, 0, 0, 0, self._sptr())

    def _fp8_compute(self, x, weight, out):
        """Up to fp8_gemv_max_m rows under kernels fp8_gemv=on: the FP8 GEMV on the codes.
        Else, for a weight placed for CUTLASS: activations quantized per token and group of 128
        to e4m3, then the CUTLASS block-scaled GEMM (bf16 out), one workspace holding the e4m3
        activations, their (T, K/128) scales and CUTLASS's own scratch, each part 16-byte
        aligned. Else panels of weight rows dequantized to the activation dtype for cuBLAS."""
        T, K, N = x.shape[0], x.shape[1], out.shape[1]
        if self.fp8_gemv and T <= self.fp8_gemv_max_m:
            launch_fp8_gemv(self._ptr(x), weight.codes.data.ptr, weight.scales.data.ptr,
                            self._ptr(out), T, N, K, self._act_code, self._sptr())
            return
        if not weight.cutlass:
            self._fp8_panels(x, weight, out)
            return
        codes_bytes = -(-T * K // 16) * 16
        scale_bytes = -(-T * (K // 128) * 4 // 16) * 16
        gemm_ws = fp8_block_gemm_workspace_bytes(T, N, K)
        base = self._workspace_ptr(codes_bytes + scale_bytes + gemm_ws)
        q, scales, scratch = base, base + codes_bytes, base + codes_bytes + scale_bytes
        launch_fp8_quantize_per_token_group(self._ptr(x), q, scales, T, K, 128, self._act_code,
                                            self._sptr())
        launch_fp8_block_gemm(q, scales, weight.codes.data.ptr, weight.scales.data.ptr,
                              self._ptr(out), T, N, K, scratch if gemm_ws else 0, gemm_ws,
                              self._sptr())

    def _fp8_panels(self, x, weight, out):
        """out = x W^T with W dequantized, whole 128-row scale blocks at a time, into the
        panel buffer and multiplied by cuBLAS (the default path's arithmetic, in pieces)."""
        cdef int64_t T = x.shape[0], K = x.shape[1], N = out.shape[1]
        cdef int64_t item = self.act_dtype.itemsize, r0, rows
        cdef int64_t panel_rows = min(N, max(128, GGUF_PANEL_BYTES // (K * item) // 128 * 128))
        panel = self._panel_ptr(panel_rows * K * item)
        for r0 in range(0, N, panel_rows):
            rows = min(panel_rows, N - r0)
            launch_fp8_dequantize(weight.codes.data.ptr + r0 * K,
                                  weight.scales.data.ptr + (r0 // 128) * (K // 128) * 4, panel,
                                  rows, K, 128, 128, self._act_code, self._sptr())
            self._gemm(panel, self._ptr(x), self._ptr(out) + r0 * item, T, rows, K, N,
                       self._act_code)

    def _quant_embedding(self, token_ids, table, out):
        """Rows of a ggml-block table: the token rows' blocks are gathered, then dequantized."""
        op = "embedding"
        arrays = {"token_ids": token_ids, "out": out}
        self._check(op, arrays, "token_ids", (_I32,), 1)
        self._check(op, arrays, "out", (self.act_dtype,), 2, True)
        if len(table.quant_parts) != 1:
            _fail(op, "a quantized embedding table must be one ggml type", arrays)
        qtype, blocks = table.quant_parts[0]
        T, H = token_ids.shape[0], table.k
        if out.shape != (T, H):
            _fail(op, "out must be (T, H)", arrays)
        rows = blocks.take(token_ids, axis=0)
        launch_gguf_dequantize(qtype, rows.data.ptr, self._ptr(out), T, H, self._act_code,
                               self._sptr())

    def rms_norm(self, x, weight, eps, out):
        op, act = "rms_norm", (self.act_dtype,)
        arrays = {"x": x, "weight": weight, "out": out}
        self._check(op, arrays, "x", act, 2)
        self._check(op, arrays, "weight", (_F32,), 1)
        self._check(op, arrays, "out", act, 2, True)
        T, H = x.shape[0], x.shape[1]
        if weight.shape[0] != H or out.shape != x.shape:
            _fail(op, "need x, out (T, H) and weight (H,)", arrays)
        launch_rms_norm(self._ptr(x), self._ptr(weight), self._ptr(out), T, H, eps,
                        self._act_code, self._sptr())

    def fused_add_rms_norm(self, x, residual, weight, eps):
        op, act = "fused_add_rms_norm", (self.act_dtype,)
        arrays = {"x": x, "residual": residual, "weight": weight}
        self._check(op, arrays, "x", act, 2, True)
        self._check(op, arrays, "residual", act, 2, True)
        self._check(op, arrays, "weight", (_F32,), 1)
        T, H = x.shape[0], x.shape[1]
        if weight.shape[0] != H or residual.shape != x.shape:
            _fail(op, "need x, residual (T, H) and weight (H,)", arrays)
        launch_fused_add_rms_norm(self._ptr(x), self._ptr(residual), self._ptr(weight), T, H, eps,
                                  self._act_code, self._sptr())

    def layer_norm(self, x, weight, bias, eps, out):
        op, act = "layer_norm", (self.act_dtype,)
        arrays = {"x": x, "weight": weight, "bias": bias, "out": out}
        self._check(op, arrays, "x", act, 2)
        self._check(op, arrays, "out", act, 2, True)
        if out.shape != x.shape:
            _fail(op, "need x, out (T, H)", arrays)
        bias_ptr = self._norm_vectors(op, arrays, x.shape[1])
        launch_layer_norm(self._ptr(x), self._ptr(weight), bias_ptr, self._ptr(out), x.shape[0],
                          x.shape[1], eps, self._act_code, self._sptr())

    def fused_add_layer_norm(self, x, residual, weight, bias, eps):
        op, act = "fused_add_layer_norm", (self.act_dtype,)
        arrays = {"x": x, "residual": residual, "weight": weight, "bias": bias}
        self._check(op, arrays, "x", act, 2, True)
        self._check(op, arrays, "residual", act, 2, True)
        if residual.shape != x.shape:
            _fail(op, "need x, residual (T, H)", arrays)
        bias_ptr = self._norm_vectors(op, arrays, x.shape[1])
        launch_fused_add_layer_norm(self._ptr(x), self._ptr(residual), self._ptr(weight),
                                    bias_ptr, x.shape[0], x.shape[1], eps, self._act_code,
                                    self._sptr())

    def _norm_vectors(self, str op, dict arrays, H):
        """Checks weight (H,) f32 and bias (H,) f32 or None; the bias pointer, 0 for None."""
        self._check(op, arrays, "weight", (_F32,), 1)
        if arrays["weight"].shape[0] != H:
            _fail(op, "weight must be (H,)", arrays)
        if arrays["bias"] is None:
            return 0
        self._check(op, arrays, "bias", (_F32,), 1)
        if arrays["bias"].shape[0] != H:
            _fail(op, "bias must be (H,)", arrays)
        return self._ptr(arrays["bias"])

    def rotary_embedding(self, positions, q, k, cos_sin_cache, head_dim, is_neox):
        op, act = "rotary_embedding", (self.act_dtype,)
        arrays = {"positions": positions, "q": q, "k": k, "cos_sin_cache": cos_sin_cache,
                  "head_dim": head_dim}
        self._check(op, arrays, "positions", (_I32,), 1)
        self._check(op, arrays, "q", act, 2, True)
        self._check(op, arrays, "k", act, 2, True)
        self._check(op, arrays, "cos_sin_cache", (_F32,), 2)
        T, D, R = positions.shape[0], head_dim, cos_sin_cache.shape[1]
        if D <= 0 or q.shape[0] != T or k.shape[0] != T or q.shape[1] % D or k.shape[1] % D:
            _fail(op, "need q (T, Hq*D), k (T, Hkv*D)", arrays)
        if R <= 0 or R % 2 or R > D:
            _fail(op, "rot_dim = cos_sin_cache.shape[1] must be even and <= head_dim", arrays)
        launch_rotary_embedding(self._ptr(positions), self._ptr(q), self._ptr(k),
                                self._ptr(cos_sin_cache), T, q.shape[1] // D, k.shape[1] // D, D,
                                R, cos_sin_cache.shape[0], bool(is_neox), self._act_code,
                                self._sptr())

    def _gated(self, str op, x, out, launcher):
        act = (self.act_dtype,)
        arrays = {"x": x, "out": out}
        self._check(op, arrays, "x", act, 2)
        self._check(op, arrays, "out", act, 2, True)
        T, inter = x.shape[0], out.shape[1]
        if x.shape[1] != 2 * inter or out.shape[0] != T:
            _fail(op, "need x (T, 2I), out (T, I)", arrays)
        launcher(self._ptr(x), self._ptr(out), T, inter, self._act_code, self._sptr())

    def silu_and_mul(self, x, out):
        self._gated("silu_and_mul", x, out, launch_silu_and_mul)

    def gelu_tanh_and_mul(self, x, out):
        self._gated("gelu_tanh_and_mul", x, out, launch_gelu_tanh_and_mul)

    def clamped_swiglu(self, x, out, alpha, limit):
        """cuda/activation.cu's kernel (GPT-OSS's experts)."""
        op = "clamped_swiglu"
        arrays = {"x": x, "out": out, "alpha": alpha, "limit": limit}
        if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
            _fail(op, "need a finite alpha and a finite limit > 0", arrays)
        self._gated(op, x, out, lambda xp_, op_, T, I, code, st: launch_clamped_swiglu(
            xp_, op_, T, I, alpha, limit, code, st))

    def softcap(self, x, cap):
        op = "softcap"
        arrays = {"x": x, "cap": cap}
        self._check(op, arrays, "x", (self.act_dtype, _F32), 2, True)
        if not cap > 0:
            _fail(op, "cap must be > 0", arrays)
        launch_softcap(self._ptr(x), x.size, cap, _dtype_code(x.dtype), self._sptr())

    def scale(self, x, s):
        op = "scale"
        arrays = {"x": x, "s": s}
        self._check(op, arrays, "x", (self.act_dtype,), 2, True)
        if not math.isfinite(s):
            _fail(op, "s must be a finite number", arrays)
        launch_scale(self._ptr(x), x.size, s, self._act_code, self._sptr())

    # ---- fused MoE (cuda/moe.cu; shapes checked by pyx/cpu_moe.py's checks, shared with the CPU)

    def stack_experts(self, weights):
        """One (E, N, K) stack of activation-dtype experts, or (E, N, K / 32 * 34) bytes of Q8_0
        blocks (a fused gate_up's two parts joined row-wise, as linear reads them)."""
        E, (N, K) = len(weights), weights[0].shape
        cp = self._cupy
        if all(isinstance(w, cp.ndarray) and w.dtype == self.act_dtype and w.shape == (N, K)
               for w in weights):
            return StackedExperts((E, N, K), None, cp.stack(weights), TAPER_MOE_W_DTYPE)
        if (K % 32 == 0 and all(isinstance(w, QuantizedWeight) and tuple(w.shape) == (N, K)
                                and all(t == TAPER_MOE_W_Q8_0 for t, _ in w.quant_parts)
                                for w in weights)):
            data = cp.stack([cp.concatenate([b for _, b in w.quant_parts]) for w in weights])
            if data.shape == (E, N, K // 32 * 34) and data.dtype == _U8:
                return StackedExperts((E, N, K), None, data, TAPER_MOE_W_Q8_0)
        kinds = sorted({type(w).__name__ if not isinstance(w, QuantizedWeight) else
                        "ggml types " + ",".join(str(t) for t, _ in w.quant_parts)
                        for w in weights})
        raise ValueError(f"stack_experts: the fused MoE path (kernels moe=fused) takes "
                         f"{self.act_dtype.name} or GGUF Q8_0 experts (K % 32 == 0 for Q8_0), "
                         f"not {kinds} of shape {(N, K)}; use moe=simple for these")

    def _need(self, str op, dict arrays, str name, dtype, tuple shape):
        self._check(op, arrays, name, (dtype,), len(shape), True)
        if tuple(arrays[name].shape) != shape:
            _fail(op, f"{name} must be {shape}", arrays)

    def moe_align(self, topk_ids, num_experts, block_m, sorted_ids, block_expert, expert_offsets,
                  num_padded):
        op = "moe_align"
        self._check(op, {"topk_ids": topk_ids}, "topk_ids", (_I64,), 2)
        cpu_moe.check_align(op, topk_ids, num_experts, block_m, sorted_ids, block_expert,
                            expert_offsets, num_padded, need=self._need)
        launch_moe_align(self._ptr(topk_ids), self._ptr(sorted_ids), self._ptr(block_expert),
                         self._ptr(expert_offsets), self._ptr(num_padded), topk_ids.size,
                         num_experts, block_m, self._sptr())

    def moe_grouped_linear(self, x, weights, sorted_ids, block_expert, num_padded, x_div,
                           block_m, out):
        op = "moe_grouped_linear"
        arrays = {"x": x, "weights": weights, "sorted_ids": sorted_ids,
                  "block_expert": block_expert, "num_padded": num_padded, "out": out}
        if not isinstance(weights, StackedExperts) or weights.data is None:
            _fail(op, "weights must come from this backend's stack_experts", arrays)
        if self._act_code == TAPER_DT_F32:
            _fail(op, "the grouped GEMM runs on tensor cores: bf16 or f16 activations", arrays)
        for name, dtypes in (("x", (self.act_dtype,)), ("out", (self.act_dtype,)),
                             ("sorted_ids", (_I32,)), ("block_expert", (_I32,)),
                             ("num_padded", (_I32,))):
            self._check(op, arrays, name, dtypes, 1 if arrays[name].ndim == 1 else 2)
        P, E, N, K = cpu_moe.check_grouped(op, x, weights, sorted_ids, block_expert, num_padded,
                                           x_div, block_m, out, (self.act_dtype,))
        launch_moe_grouped_gemm(self._ptr(x), weights.data.data.ptr, weights.qtype,
                                self._ptr(sorted_ids), self._ptr(block_expert),
                                self._ptr(num_padded), self._ptr(out), P, E, N, K, x_div,
                                block_m, self._act_code, self._sptr())

    def moe_combine(self, y, topk_weights, topk_ids, num_experts, out):
        op = "moe_combine"
        arrays = {"y": y, "topk_weights": topk_weights, "topk_ids": topk_ids, "out": out}
        self._check(op, arrays, "y", (self.act_dtype,), 2)
        self._check(op, arrays, "topk_weights", (_F32,), 2)
        self._check(op, arrays, "topk_ids", (_I64,), 2)
        self._check(op, arrays, "out", (self.act_dtype,), 2, True)
        T, k, H = cpu_moe.check_combine(op, y, topk_weights, topk_ids, num_experts, out,
                                        (self.act_dtype,))
        launch_moe_combine(self._ptr(y), self._ptr(topk_weights), self._ptr(topk_ids),
                           self._ptr(out), T, k, H, num_experts, self._act_code, self._sptr())

    cdef int _cache_code(self, str op, dict arrays, bint writable) except? -2:
        """The caches' TAPER_DT_* code; checks their dtype, shape and the FP8 scales."""
        k_cache, v_cache = arrays["k_cache"], arrays["v_cache"]
        self._check(op, arrays, "k_cache", (self.act_dtype, _U8), 4, writable)
        self._check(op, arrays, "v_cache", (k_cache.dtype,), 4, writable)
        if v_cache.shape != k_cache.shape:
            _fail(op, "k_cache and v_cache must be (NB, BS, Hkv, D)", arrays)
        if k_cache.dtype != _U8:
            if arrays.get("k_scale") is not None or arrays.get("v_scale") is not None:
                _fail(op, "k_scale/v_scale go with an fp8 (uint8) cache only", arrays)
            return self._act_code
        for name in ("k_scale", "v_scale"):
            if arrays.get(name) is None:
                _fail(op, f"an fp8 (uint8) cache needs {name} (Hkv,) float32", arrays)
            self._check(op, arrays, name, (_F32,), 1)
            if arrays[name].shape[0] != k_cache.shape[2]:
                _fail(op, f"{name} must be (Hkv,)", arrays)
        return TAPER_DT_FP8

    # ---- vision encoders (cuda/vision.cu)

    def gelu(self, x, out):
        """In the activation dtype, as the other elementwise ops; out may be x."""
        op, act = "gelu", (self.act_dtype,)
        arrays = {"x": x, "out": out}
        self._check(op, arrays, "x", act, 2)
        self._check(op, arrays, "out", act, 2, True)
        if out.shape != x.shape:
            _fail(op, "need x, out (T, N)", arrays)
        launch_gelu(self._ptr(x), self._ptr(out), x.size, self._act_code, self._sptr())

    def encoder_attention(self, out, q, k, v, cu_seqlens, scale):
        """q, k, v, out in the activation dtype, head_dim up to 256; cu_seqlens on the device,
        trusted as the op contract states (checking it would wait for the device)."""
        op, act = "encoder_attention", (self.act_dtype,)
        arrays = {"out": out, "q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}
        self._check(op, arrays, "out", act, 3, True)
        for name in ("q", "k", "v"):
            self._check(op, arrays, name, act, 3)
        self._check(op, arrays, "cu_seqlens", (_I32,), 1)
        N, H, D = q.shape
        if k.shape != q.shape or v.shape != q.shape or out.shape != q.shape:
            _fail(op, "need out, q, k, v of one shape (N, H, D)", arrays)
        if cu_seqlens.shape[0] < 1:
            _fail(op, "cu_seqlens needs at least one entry", arrays)
        if D > 256:
            _fail(op, "the kernel takes head_dim <= 256", arrays)
        launch_encoder_attention(self._ptr(out), self._ptr(q), self._ptr(k), self._ptr(v),
                                 self._ptr(cu_seqlens), N, cu_seqlens.shape[0] - 1, H, D,
                                 float(scale), self._act_code, self._sptr())

    cdef inline ptr_t _opt_ptr(self, a):
        return 0 if a is None else a.data.ptr

    def reshape_and_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        op, act = "reshape_and_cache", (self.act_dtype,)
        arrays = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache,
                  "slot_mapping": slot_mapping, "k_scale": k_scale, "v_scale": v_scale}
        self._check(op, arrays, "k", act, 3)
        self._check(op, arrays, "v", act, 3)
        self._check(op, arrays, "slot_mapping", (_I32,), 1)
        cache_code = self._cache_code(op, arrays, True)
        T, Hkv, D = k.shape
        if v.shape != k.shape or slot_mapping.shape[0] != T:
            _fail(op, "need k, v (T, Hkv, D) and slot_mapping (T,)", arrays)
        if k_cache.shape[2] != Hkv or k_cache.shape[3] != D:
            _fail(op, "need k_cache, v_cache (NB, BS, Hkv, D)", arrays)
        launch_reshape_and_cache(self._ptr(k), self._ptr(v), self._ptr(k_cache),
                                 self._ptr(v_cache), self._ptr(slot_mapping),
                                 self._opt_ptr(k_scale), self._opt_ptr(v_scale), T, Hkv, D,
                                 k_cache.shape[0], k_cache.shape[1], self._act_code, cache_code,
                                 self._sptr())

    def paged_attention(self, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window, k_scale=None, v_scale=None, softcap=0.0,
                        sinks=None, attention_chunk=0):
        """pyx/attention_dispatch.py picks the kernel: sinks, a chunk or a head over 256 take the
        masked (simple) kernel for any batch; else decode batches (one query row per sequence,
        T == B) the decode kernel, anything else the prefill kernel, which handles mixed
        batches."""
        op, act = "paged_attention", (self.act_dtype,)
        arrays = {"out": out, "q": q, "k_cache": k_cache, "v_cache": v_cache,
                  "block_tables": block_tables, "seq_lens": seq_lens,
                  "query_start_loc": query_start_loc, "k_scale": k_scale, "v_scale": v_scale,
                  "sinks": sinks}
        self._check(op, arrays, "out", act, 3, True)
        self._check(op, arrays, "q", act, 3)
        self._check(op, arrays, "block_tables", (_I32,), 2)
        self._check(op, arrays, "seq_lens", (_I32,), 1)
        self._check(op, arrays, "query_start_loc", (_I32,), 1)
        cache_code = self._cache_code(op, arrays, False)
        T, Hq, D = q.shape
        NB, BS, Hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        B, MB = seq_lens.shape[0], block_tables.shape[1]
        if out.shape != q.shape or k_cache.shape[3] != D:
            _fail(op, "need out, q (T, Hq, D) and caches (NB, BS, Hkv, D) with q's D", arrays)
        if Hkv <= 0 or Hq % Hkv:
            _fail(op, "Hq must be a multiple of Hkv", arrays)
        if block_tables.shape[0] != B or query_start_loc.shape[0] != B + 1:
            _fail(op, "need block_tables (B, MB), seq_lens (B,), query_start_loc (B+1,)", arrays)
        sw = sliding_window or 0
        if sw < 0:
            _fail(op, f"sliding_window must be >= 0, got {sliding_window}", arrays)
        if softcap < 0:
            _fail(op, f"softcap must be >= 0, got {softcap}", arrays)
        chunk = attention_dispatch.check_masks(op, sinks, attention_chunk, Hq, D)
        if sinks is not None:
            self._check(op, arrays, "sinks", (_F32,), 1)
        kernel = attention_dispatch.attention_kernel(T, B, D, sinks, chunk)
        ks, vs = self._opt_ptr(k_scale), self._opt_ptr(v_scale)
        if kernel == "masked":
            launch_paged_attention_masked(
                self._ptr(out), self._ptr(q), self._ptr(k_cache), self._ptr(v_cache), ks, vs,
                self._ptr(block_tables), self._ptr(seq_lens), self._ptr(query_start_loc),
                self._opt_ptr(sinks), T, B, Hq, Hkv, D, NB, BS, MB, scale, sw, chunk, softcap,
                self._act_code, cache_code, self._sptr())
            return
        if kernel == "decode":
            fp8 = cache_code == TAPER_DT_FP8
            splits = self.decode_split_count(B, Hq, Hkv, D, BS, MB, fp8)
            ws_bytes = decode_workspace_bytes(B, Hq, D, splits)
            launch_paged_attention_decode(
                self._ptr(out), self._ptr(q), self._ptr(k_cache), self._ptr(v_cache), ks, vs,
                self._ptr(block_tables), self._ptr(seq_lens), B, Hq, Hkv, D, NB, BS, MB, scale,
                sw, softcap, self._act_code, cache_code, splits, self._workspace_ptr(ws_bytes),
                ws_bytes, self._sptr())
            return
        args = (self._ptr(out), self._ptr(q), self._ptr(k_cache), self._ptr(v_cache), ks, vs,
                self._ptr(block_tables), self._ptr(seq_lens), self._ptr(query_start_loc), T, B,
                Hq, Hkv, D, NB, BS, MB, scale, sw, softcap, self._act_code, cache_code)
        variant = PREFILL_VARIANTS[self.prefill_kernel]
        if variant:
            try:
                launch_paged_attention_prefill(*args, variant, self._sptr())
                return
            except CudaError as e:  # shapes the tensor-core kernels lack: the simple one runs
                if "status -1" not in str(e):
                    raise
        launch_paged_attention_prefill(*args, 0, self._sptr())

    def mla_decode_attention(self, out, q, cache, block_tables, seq_lens, scale):
        """cuda/mla_decode.cu; a cache of the activation type (no FP8)."""
        op, act = "mla_decode_attention", (self.act_dtype,)
        arrays = {"out": out, "q": q, "cache": cache, "block_tables": block_tables,
                  "seq_lens": seq_lens}
        self._check(op, arrays, "out", act, 3, True)
        self._check(op, arrays, "q", act, 3)
        self._check(op, arrays, "cache", act, 4)
        self._check(op, arrays, "block_tables", (_I32,), 2)
        self._check(op, arrays, "seq_lens", (_I32,), 1)
        B, Hq, D = q.shape
        if (cache.shape[2] != 1 or cache.shape[3] != D or out.shape[:2] != (B, Hq)
                or out.shape[2] > D or seq_lens.shape[0] != B or block_tables.shape[0] != B):
            _fail(op, "need out (B, Hq, Dv), q (B, Hq, D), cache (NB, BS, 1, D) with Dv <= D, "
                      "block_tables (B, MB), seq_lens (B,)", arrays)
        if D > 1024:
            _fail(op, "the kernel takes D <= 1024", arrays)
        launch_mla_decode_attention(self._ptr(out), self._ptr(q), self._ptr(cache),
                                    self._ptr(block_tables), self._ptr(seq_lens), B, Hq, D,
                                    out.shape[2], cache.shape[0], cache.shape[1],
                                    block_tables.shape[1], scale, self._act_code, self._sptr())

    def decode_split_count(self, B, Hq, Hkv, D, BS, MB, fp8_cache=False):
        """Partitions per (sequence, KV head) that paged_attention gives a decode batch: 1
        without the split-K switch, else `decode_splits` when set, else the rule of
        pyx/decode_splits.py for this device's SMs and the kernel's occupancy at this shape."""
        if not self.split_k:
            return 1
        if self.decode_splits:
            return self.decode_splits
        cache_code = TAPER_DT_FP8 if fp8_cache else self._act_code
        key = (Hq, Hkv, D, cache_code)
        if key not in self._decode_occupancy:
            self._decode_occupancy[key] = decode_blocks_per_sm(Hq, Hkv, D, self._act_code,
                                                               cache_code)
        return decode_num_splits(B, Hkv, self.max_context or MB * BS, BS, self.num_sms,
                                 self._decode_occupancy[key])

    def _workspace_ptr(self, int64_t nbytes):
        """Scratch of at least nbytes shared by the ops that need one (split-K decode, the
        quantized GEMV's int8 activations); grown, never during a graph capture."""
        self._workspace = self._grown(self._workspace, nbytes)
        return 0 if self._workspace is None else self._workspace.data.ptr

    def _panel_ptr(self, int64_t nbytes):
        """The buffer quantized prefill dequantizes weight panels into."""
        self._panel = self._grown(self._panel, nbytes)
        return self._panel.data.ptr

    def _grown(self, buf, int64_t nbytes):
        if nbytes == 0 or (buf is not None and buf.nbytes >= nbytes):
            return buf
        if self.stream.is_capturing():
            raise CudaError(f"a scratch buffer of {nbytes} bytes was requested while capturing "
                            "a CUDA graph; warm up every bucket before capturing")
        # A captured graph may still use the old buffer: keep it alive, never reuse it.
        if buf is not None:
            self._retired.append(buf)
        return self._cupy.empty(nbytes, dtype=np.uint8)

    def argmax(self, logits, out):
        op = "argmax"
        arrays = {"logits": logits, "out": out}
        self._check(op, arrays, "logits", (_F32,), 2)
        self._check(op, arrays, "out", (_I64,), 1, True)
        B, V = logits.shape
        if out.shape[0] != B or V == 0:
            _fail(op, "need logits (B, V) with V > 0 and out (B,)", arrays)
        launch_argmax(self._ptr(logits), self._ptr(out), B, V, self._sptr())

    def gumbel_sample(self, logits, seeds, positions, out):
        op = "gumbel_sample"
        arrays = {"logits": logits, "seeds": seeds, "positions": positions, "out": out}
        self._check(op, arrays, "logits", (_F32,), 2)
        self._check(op, arrays, "seeds", (_U64,), 1)
        self._check(op, arrays, "positions", (_I64,), 1)
        self._check(op, arrays, "out", (_I64,), 1, True)
        B, V = logits.shape
        if seeds.shape[0] != B or positions.shape[0] != B or out.shape[0] != B or V == 0:
            _fail(op, "need logits (B, V) with V > 0 and seeds, positions, out (B,)", arrays)
        launch_gumbel_sample(self._ptr(logits), self._ptr(seeds), self._ptr(positions),
                             self._ptr(out), B, V, self._sptr())

    def apply_token_bitmask(self, logits, bitmask, rows):
        op = "apply_token_bitmask"
        arrays = {"logits": logits, "bitmask": bitmask, "rows": rows}
        self._check(op, arrays, "logits", (_F32,), 2, True)
        self._check(op, arrays, "bitmask", (_I32,), 2)
        self._check(op, arrays, "rows", (_I32,), 1)
        B, V = logits.shape
        if bitmask.shape[0] != B or bitmask.shape[1] != (V + 31) // 32:
            _fail(op, "need bitmask (B, ceil(V / 32)) for logits (B, V)", arrays)
        launch_apply_token_bitmask(self._ptr(logits), self._ptr(bitmask), self._ptr(rows), B, V,
                                   rows.shape[0], self._sptr())

    def apply_penalties(self, logits, rows, cols, bias, rep, pres_freq):
        op = "apply_penalties"
        arrays = {"logits": logits, "rows": rows, "cols": cols, "bias": bias, "rep": rep,
                  "pres_freq": pres_freq}
        self._check(op, arrays, "logits", (_F32,), 2, True)
        for name in ("rows", "cols"):
            self._check(op, arrays, name, (_I32,), 1)
        for name in ("bias", "rep", "pres_freq"):
            self._check(op, arrays, name, (_F32,), 1)
        N = rows.shape[0]
        if any(arrays[n].shape[0] != N for n in ("cols", "bias", "rep", "pres_freq")):
            _fail(op, "rows, cols, bias, rep, pres_freq must all be (N,)", arrays)
        B, V = logits.shape
        launch_apply_penalties(self._ptr(logits), self._ptr(rows), self._ptr(cols),
                               self._ptr(bias), self._ptr(rep), self._ptr(pres_freq), B, V, N,
                               self._sptr())

    def filter_logits(self, logits, temperature, top_k, top_p, min_p):
        op = "filter_logits"
        arrays = {"logits": logits, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                  "min_p": min_p}
        self._check(op, arrays, "logits", (_F32,), 2, True)
        self._check(op, arrays, "temperature", (_F32,), 1)
        self._check(op, arrays, "top_k", (_I32,), 1)
        self._check(op, arrays, "top_p", (_F32,), 1)
        self._check(op, arrays, "min_p", (_F32,), 1)
        B, V = logits.shape
        if any(arrays[n].shape[0] != B for n in ("temperature", "top_k", "top_p", "min_p")):
            _fail(op, "temperature, top_k, top_p, min_p must be (B,)", arrays)
        launch_filter_logits(self._ptr(logits), self._ptr(temperature), self._ptr(top_k),
                             self._ptr(top_p), self._ptr(min_p), B, V, self._sptr())

    def sample_fused(self, logits, greedy, temperature, top_k, top_p, min_p, seeds, positions,
                     out, penalties=None):
        """out (B,) = the sampler's tokens in one launch: `penalties` (rows, cols, bias, rep,
        pres_freq, as apply_penalties, rows sorted ascending) applied to `logits` in place, then
        per row the argmax where greedy[b], else the Gumbel-max draw after temperature and the
        top-k / top-p / min-p filter (radix select). Temperature and the filter are not written
        back, so logits hold only the penalised values afterwards."""
        op = "sample_fused"
        arrays = {"logits": logits, "greedy": greedy, "temperature": temperature,
                  "top_k": top_k, "top_p": top_p, "min_p": min_p, "seeds": seeds,
                  "positions": positions, "out": out}
        self._check(op, arrays, "logits", (_F32,), 2, True)
        self._check(op, arrays, "greedy", (_U8,), 1)
        for name in ("temperature", "top_p", "min_p"):
            self._check(op, arrays, name, (_F32,), 1)
        self._check(op, arrays, "top_k", (_I32,), 1)
        self._check(op, arrays, "seeds", (_U64,), 1)
        self._check(op, arrays, "positions", (_I64,), 1)
        self._check(op, arrays, "out", (_I64,), 1, True)
        B, V = logits.shape
        if V == 0 or any(arrays[n].shape[0] != B for n in arrays if n != "logits"):
            _fail(op, "need logits (B, V) with V > 0 and every per-row array (B,)", arrays)
        cdef int64_t N = 0
        cdef ptr_t pr = 0, pc = 0, pb = 0, pp = 0, pf = 0
        if penalties is not None:
            names = ("rows", "cols", "bias", "rep", "pres_freq")
            if len(penalties) != 5:
                _fail(op, "penalties must be (rows, cols, bias, rep, pres_freq)", arrays)
            arrays.update(zip(names, penalties))
            for name in names:
                self._check(op, arrays, name, (_I32,) if name in ("rows", "cols") else (_F32,), 1)
            N = arrays["rows"].shape[0]
            if any(arrays[n].shape[0] != N for n in names):
                _fail(op, "rows, cols, bias, rep, pres_freq must all be (N,)", arrays)
            pr, pc, pb, pp, pf = (self._ptr(arrays[n]) for n in names)
        launch_sample_fused(self._ptr(logits), self._ptr(greedy), self._ptr(temperature),
                            self._ptr(top_k), self._ptr(top_p), self._ptr(min_p),
                            self._ptr(seeds), self._ptr(positions), pr, pc, pb, pp, pf,
                            self._ptr(out), B, V, N, self._sptr())


include "cuda_lora.pxi"

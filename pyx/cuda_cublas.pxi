# cuBLAS for pyx/cuda_backend.pyx (included there): the enums it passes and the function
# pointers it calls.

# cuBLAS enums (cublas_api.h, library_types.h)
cdef int CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
cdef int CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14
cdef int CUBLAS_COMPUTE_32F = 68
cdef int CUBLAS_GEMM_DEFAULT = -1
cdef float _ONE = 1.0, _ZERO = 0.0
cdef size_t CUBLAS_WORKSPACE_BYTES = 32 << 20   # NVIDIA's recommendation for Hopper

# ---- cuBLAS, called directly
#
# CuPy's binding (cupy_backends.cuda.libs.cublas) points the handle at CuPy's current stream
# before every call, and that refuses (NotImplementedError) while the stream captures a CUDA
# graph, and resets the handle's workspace. So the backend keeps a handle of its own, bound once
# to its stream and workspace, and calls cuBLAS through function pointers taken from the
# libcublas that importing CuPy's binding has loaded: no link dependency of our own.

ctypedef int (*cublas_create_t)(void** handle) noexcept nogil
ctypedef int (*cublas_destroy_t)(void* handle) noexcept nogil
ctypedef int (*cublas_set_stream_t)(void* handle, void* stream) noexcept nogil
ctypedef int (*cublas_set_workspace_t)(void* handle, void* workspace,
                                       size_t nbytes) noexcept nogil
ctypedef int (*cublas_gemm_ex_t)(void* handle, int transa, int transb, int m, int n, int k,
                                 const void* alpha, const void* A, int Atype, int lda,
                                 const void* B, int Btype, int ldb, const void* beta, void* C,
                                 int Ctype, int ldc, int computeType, int algo) noexcept nogil

ctypedef int (*cublas_gemm_strided_batched_ex_t)(
    void* handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* A,
    int Atype, int lda, long long strideA, const void* B, int Btype, int ldb, long long strideB,
    const void* beta, void* C, int Ctype, int ldc, long long strideC, int batchCount,
    int computeType, int algo) noexcept nogil

cdef struct CublasApi:
    cublas_create_t create
    cublas_destroy_t destroy
    cublas_set_stream_t set_stream
    cublas_set_workspace_t set_workspace
    cublas_gemm_ex_t gemm_ex
    cublas_gemm_strided_batched_ex_t gemm_strided_batched_ex

cdef CublasApi _blas
_blas_lib = []   # the ctypes library, kept loaded

_CUBLAS_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE",
                  8: "ARCH_MISMATCH", 11: "MAPPING_ERROR", 13: "EXECUTION_FAILED",
                  14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}


cdef _check_cublas(int st, str op, dict sizes):
    if st == 0:
        return
    desc = ", ".join(f"{k}={v}" for k, v in sizes.items())
    raise CudaError(f"{op}: cuBLAS error CUBLAS_STATUS_{_CUBLAS_STATUS.get(st, 'UNKNOWN')} "
                    f"(status {st}) [{desc}]")


def _mapped_cublas_path():
    """The libcublas (not libcublasLt) file mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(
                        "libcublas.so"):
                    return parts[5].strip()
    except OSError:
        pass
    return None


def _cublas_symbol(lib, *names):
    """Address of the first of names that lib exports, 0 for none."""
    import ctypes
    for name in names:
        try:
            return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
        except AttributeError:
            continue
    return 0


def _load_cublas():
    """Fills _blas from CuPy's libcublas, once; returns the library's name."""
    if _blas_lib:
        return _blas_lib[0]._name
    import ctypes
    from cupy_backends.cuda.libs import cublas  # noqa: F401 (its import loads libcublas)
    path = _mapped_cublas_path()
    lib = None
    for name in ([path] if path else []) + ["libcublas.so.13", "libcublas.so.12"]:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise RuntimeError("CudaBackend: CuPy's cuBLAS binding imported, but no libcublas is "
                           "mapped into the process")
    addrs = {"create": _cublas_symbol(lib, "cublasCreate_v2", "cublasCreate"),
             "destroy": _cublas_symbol(lib, "cublasDestroy_v2", "cublasDestroy"),
             "set_stream": _cublas_symbol(lib, "cublasSetStream_v2", "cublasSetStream"),
             "gemm_ex": _cublas_symbol(lib, "cublasGemmEx"),
             "gemm_strided_batched_ex": _cublas_symbol(lib, "cublasGemmStridedBatchedEx")}
    missing = [k for k, v in addrs.items() if not v]
    if missing:
        raise RuntimeError(f"CudaBackend: {lib._name} lacks cuBLAS entry points {missing}")
    _blas.create = <cublas_create_t><size_t>addrs["create"]
    _blas.destroy = <cublas_destroy_t><size_t>addrs["destroy"]
    _blas.set_stream = <cublas_set_stream_t><size_t>addrs["set_stream"]
    _blas.gemm_ex = <cublas_gemm_ex_t><size_t>addrs["gemm_ex"]
    _blas.gemm_strided_batched_ex = <cublas_gemm_strided_batched_ex_t><size_t>addrs[
        "gemm_strided_batched_ex"]
    # Every CUDA 12+ cuBLAS has it; without it cuBLAS would allocate inside a graph capture.
    _blas.set_workspace = <cublas_set_workspace_t><size_t>_cublas_symbol(
        lib, "cublasSetWorkspace_v2", "cublasSetWorkspace")
    _blas_lib.append(lib)
    return lib._name

# CudaBackend.lora_linear (included at the end of pyx/cuda_backend.pyx; pyx/backend.pyx documents
# the op), composed of existing pieces rather than a kernel of its own: the step's adapter rows
# gathered into contiguous rows (CuPy take), per adapter segment one cuBLAS GEMM for the shrink
# (all parts' A at once, into an (L, P*R) buffer) and one per part for the expand, which
# accumulates (beta = 1) into the gathered output rows over the part's columns and the adapter's
# own rank, then the rows scattered back. Sums in float32 (CUBLAS_COMPUTE_32F); the shrink's
# result is rounded to the activation dtype before the expand reads it.
#
# The segment loop runs on the host with the step's segment sizes, so a graph cannot replay it.
# CudaBackend.lora_linear_slots is the graph-safe form: each row's slot read on the device by the
# shrink and expand kernels of cuda/lora.cu (one launch each, grids fixed by the shapes), which
# the decode graphs use under KernelConfig graphs_lora=on (engine/runner/cuda_graph.py).


cdef _gemm_acc(CudaBackend be, ptr_t a, int lda, ptr_t b, int ldb, ptr_t c, int ldc, int m,
               int n, int k):
    """Row-major out (n, m) rows of stride ldc += y (n, k, row stride ldb) @ w (k, m, row stride
    lda), in the activation dtype: column-major C (m, n) += A (m, k) B (k, n), both untransposed,
    with A = w and B = y as cuBLAS sees row-major memory."""
    cdef int ab = CUDA_R_16BF if be._act_code == TAPER_DT_BF16 else (
        CUDA_R_16F if be._act_code == TAPER_DT_F16 else CUDA_R_32F)
    cdef void* handle = be._blas_handle
    cdef int st
    with nogil:
        st = _blas.gemm_ex(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &_ONE, <const void*>a, ab,
                           lda, <const void*>b, ab, ldb, &_ONE, <void*>c, ab, ldc,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    _check_cublas(st, "lora_linear (cublasGemmEx)", dict(m=m, n=n, k=k))


cdef _lora_linear(CudaBackend be, x, lora_a, lora_b, ranks, parts, rows, seg_offsets, seg_slots,
                  out):
    op, act = "lora_linear", (be.act_dtype,)
    arrays = {"x": x, "lora_a": lora_a, "lora_b": lora_b, "ranks": ranks, "parts": parts,
              "rows": rows, "seg_offsets": seg_offsets, "seg_slots": seg_slots, "out": out}
    be._check(op, arrays, "x", act, 2)
    be._check(op, arrays, "lora_a", act, 3)
    be._check(op, arrays, "lora_b", act, 3)
    be._check(op, arrays, "out", act, 2, True)
    be._check(op, arrays, "rows", (_I32,), 1)
    for name in ("ranks", "parts", "seg_offsets", "seg_slots"):
        a = arrays[name]
        if not isinstance(a, np.ndarray) or a.dtype != _I32 or a.ndim != (2 if name == "ranks"
                                                                          else 1):
            _fail(op, f"{name} must be a host (NumPy) int32 array", arrays)
    cdef int64_t T = x.shape[0], K = x.shape[1], N = out.shape[1], S = lora_a.shape[0]
    cdef int64_t P = parts.shape[0] - 1, G = seg_slots.shape[0], L = rows.shape[0], R
    if P < 1 or lora_a.shape[1] % P:
        _fail(op, "need parts (P+1,) with P >= 1 dividing lora_a.shape[1] (P*R)", arrays)
    R = lora_a.shape[1] // P
    if (out.shape[0] != T or lora_a.shape[2] != K or lora_b.shape != (S, R, N)
            or ranks.shape[0] != S or ranks.shape[1] != P):
        _fail(op, "need x (T, K), lora_a (S, P*R, K), lora_b (S, R, N), ranks (S, P), "
                  "out (T, N)", arrays)
    if seg_offsets.shape[0] != G + 1 or (G and seg_offsets[G] != L):
        _fail(op, "need seg_slots (G,) and seg_offsets (G+1,) ending at len(rows)", arrays)
    if (parts[0] != 0 or parts[P] != N or (np.diff(parts) < 0).any() or (ranks < 0).any()
            or (ranks > R).any() or (G and ((seg_slots < 0).any() or (seg_slots >= S).any()
                                             or (np.diff(seg_offsets) < 0).any()))):
        _fail(op, "a slot, rank, part or segment offset is out of range", arrays)
    if G == 0 or L == 0 or R == 0:
        return
    cp = be._cupy
    cdef int64_t item = be.act_dtype.itemsize, PR = P * R, g, p, s, a0, n, r, c0, c1
    with be.stream:
        xs = cp.take(x, rows, axis=0)            # (L, K): the adapter rows, segment by segment
        ys = cp.empty((L, PR), be.act_dtype)      # their shrink, all parts
        os_ = cp.take(out, rows, axis=0)          # (L, N): their outputs, the deltas added here
        for g in range(G):
            a0, n, s = seg_offsets[g], seg_offsets[g + 1] - seg_offsets[g], seg_slots[g]
            if n == 0:
                continue
            be._gemm(be._ptr(lora_a) + s * PR * K * item, be._ptr(xs) + a0 * K * item,
                     be._ptr(ys) + a0 * PR * item, n, PR, K, PR, be._act_code)
            for p in range(P):
                r, c0, c1 = ranks[s, p], parts[p], parts[p + 1]
                if r == 0 or c1 == c0:
                    continue
                _gemm_acc(be, be._ptr(lora_b) + (s * R * N + c0) * item, <int>N,
                          be._ptr(ys) + (a0 * PR + p * R) * item, <int>PR,
                          be._ptr(os_) + (a0 * N + c0) * item, <int>N, <int>(c1 - c0), <int>n,
                          <int>r)
        out[rows] = os_


cdef _lora_linear_slots(CudaBackend be, x, lora_a, lora_b, parts, slot_of_row, out):
    op, act = "lora_linear_slots", (be.act_dtype,)
    arrays = {"x": x, "lora_a": lora_a, "lora_b": lora_b, "parts": parts,
              "slot_of_row": slot_of_row, "out": out}
    be._check(op, arrays, "x", act, 2)
    be._check(op, arrays, "lora_a", act, 3)
    be._check(op, arrays, "lora_b", act, 3)
    be._check(op, arrays, "out", act, 2, True)
    be._check(op, arrays, "slot_of_row", (_I32,), 1)
    if not isinstance(parts, np.ndarray) or parts.dtype != _I32 or parts.ndim != 1:
        _fail(op, "parts must be a host (NumPy) int32 array", arrays)
    cdef int64_t T = x.shape[0], K = x.shape[1], N = out.shape[1], S = lora_a.shape[0]
    cdef int64_t P = parts.shape[0] - 1, R
    if P < 1 or lora_a.shape[1] % P:
        _fail(op, "need parts (P+1,) with P >= 1 dividing lora_a.shape[1] (P*R)", arrays)
    R = lora_a.shape[1] // P
    if (out.shape[0] != T or slot_of_row.shape[0] != T or lora_a.shape[2] != K
            or lora_b.shape != (S, R, N)):
        _fail(op, "need x (T, K), lora_a (S, P*R, K), lora_b (S, R, N), slot_of_row (T,), "
                  "out (T, N)", arrays)
    host_parts = np.ascontiguousarray(parts)
    with be.stream:
        y = be._cupy.empty((T, P * R), be.act_dtype)    # the shrink (a graph's pool under capture)
    cdef ptr_t px = be._ptr(x), pa = be._ptr(lora_a), pb = be._ptr(lora_b)
    cdef ptr_t ps = be._ptr(slot_of_row), py = be._ptr(y), po = be._ptr(out), st_ = be._sptr()
    cdef ptr_t pp = host_parts.ctypes.data
    cdef int code = be._act_code, st
    with nogil:
        st = taper_cuda_lora_linear_slots(<const void*>px, <const void*>pa, <const void*>pb,
                                          <const int32_t*>ps, <const int32_t*>pp, <void*>py,
                                          <void*>po, T, K, N, S, P, R, code,
                                          <taper_stream_t>st_)
    _check_status(st, op, dict(T=T, K=K, N=N, S=S, P=P, R=R))

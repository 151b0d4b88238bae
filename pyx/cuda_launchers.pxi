# The launch_* wrappers of pyx/cuda_backend.pyx (included there): one per C launcher of
# cuda/taper_cuda.h and cutlass_ext/taper_cutlass.h, device pointers and sizes as integers,
# the C call inside `with nogil:`, a nonzero status raised as a CudaError naming the op and
# the sizes. CI calls one without a device to check that error path.

# ---- launchers: device pointers and sizes as integers

ctypedef size_t ptr_t


def launch_embedding(ptr_t token_ids, ptr_t table, ptr_t out, int64_t T, int64_t V, int64_t H,
                     int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_embedding(<const int32_t*>token_ids, <const void*>table, <void*>out, T,
                                  V, H, dtype, <taper_stream_t>stream)
    _check_status(st, "embedding", dict(T=T, V=V, H=H, dtype=dtype))


def launch_rms_norm(ptr_t x, ptr_t weight, ptr_t out, int64_t T, int64_t H, float eps,
                    int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_rms_norm(<const void*>x, <const float*>weight, <void*>out, T, H, eps,
                                 dtype, <taper_stream_t>stream)
    _check_status(st, "rms_norm", dict(T=T, H=H, dtype=dtype))


def launch_layer_norm(ptr_t x, ptr_t weight, ptr_t bias, ptr_t out, int64_t T, int64_t H,
                      float eps, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_layer_norm(<const void*>x, <const float*>weight, <const float*>bias,
                                   <void*>out, T, H, eps, dtype, <taper_stream_t>stream)
    _check_status(st, "layer_norm", dict(T=T, H=H, dtype=dtype))


def launch_fused_add_layer_norm(ptr_t x, ptr_t residual, ptr_t weight, ptr_t bias, int64_t T,
                                int64_t H, float eps, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_fused_add_layer_norm(<void*>x, <void*>residual, <const float*>weight,
                                             <const float*>bias, T, H, eps, dtype,
                                             <taper_stream_t>stream)
    _check_status(st, "fused_add_layer_norm", dict(T=T, H=H, dtype=dtype))


def launch_fused_add_rms_norm(ptr_t x, ptr_t residual, ptr_t weight, int64_t T, int64_t H,
                              float eps, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_fused_add_rms_norm(<void*>x, <void*>residual, <const float*>weight, T, H,
                                           eps, dtype, <taper_stream_t>stream)
    _check_status(st, "fused_add_rms_norm", dict(T=T, H=H, dtype=dtype))


def launch_rotary_embedding(ptr_t positions, ptr_t q, ptr_t k, ptr_t cos_sin_cache, int64_t T,
                            int64_t Hq, int64_t Hkv, int64_t D, int64_t rot_dim, int64_t max_pos,
                            bint is_neox, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_rotary_embedding(<const int32_t*>positions, <void*>q, <void*>k,
                                         <const float*>cos_sin_cache, T, Hq, Hkv, D, rot_dim,
                                         max_pos, is_neox, dtype, <taper_stream_t>stream)
    _check_status(st, "rotary_embedding",
                  dict(T=T, Hq=Hq, Hkv=Hkv, D=D, rot_dim=rot_dim, max_pos=max_pos, dtype=dtype))


def launch_silu_and_mul(ptr_t x, ptr_t out, int64_t T, int64_t I, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_silu_and_mul(<const void*>x, <void*>out, T, I, dtype,
                                     <taper_stream_t>stream)
    _check_status(st, "silu_and_mul", dict(T=T, I=I, dtype=dtype))


def launch_gelu_tanh_and_mul(ptr_t x, ptr_t out, int64_t T, int64_t I, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_gelu_tanh_and_mul(<const void*>x, <void*>out, T, I, dtype,
                                          <taper_stream_t>stream)
    _check_status(st, "gelu_tanh_and_mul", dict(T=T, I=I, dtype=dtype))


def launch_clamped_swiglu(ptr_t x, ptr_t out, int64_t T, int64_t I, float alpha, float limit,
                          int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_clamped_swiglu(<const void*>x, <void*>out, T, I, alpha, limit, dtype,
                                       <taper_stream_t>stream)
    _check_status(st, "clamped_swiglu", dict(T=T, I=I, alpha=alpha, limit=limit, dtype=dtype))


def launch_softcap(ptr_t x, int64_t n, float cap, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_softcap(<void*>x, n, cap, dtype, <taper_stream_t>stream)
    _check_status(st, "softcap", dict(n=n, cap=cap, dtype=dtype))


def launch_scale(ptr_t x, int64_t n, float s, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_scale(<void*>x, n, s, dtype, <taper_stream_t>stream)
    _check_status(st, "scale", dict(n=n, s=s, dtype=dtype))


def launch_add_bias(ptr_t out, ptr_t bias, int64_t T, int64_t N, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_add_bias(<void*>out, <const float*>bias, T, N, dtype,
                                 <taper_stream_t>stream)
    _check_status(st, "add_bias", dict(T=T, N=N, dtype=dtype))



def launch_gelu(ptr_t x, ptr_t out, int64_t n, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_gelu(<const void*>x, <void*>out, n, dtype, <taper_stream_t>stream)
    _check_status(st, "gelu", dict(n=n, dtype=dtype))


def launch_encoder_attention(ptr_t out, ptr_t q, ptr_t k, ptr_t v, ptr_t cu_seqlens, int64_t N,
                             int64_t S, int64_t H, int64_t D, float scale, int dtype,
                             ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_encoder_attention(<void*>out, <const void*>q, <const void*>k,
                                          <const void*>v, <const int32_t*>cu_seqlens, N, S, H, D,
                                          scale, dtype, <taper_stream_t>stream)
    _check_status(st, "encoder_attention", dict(N=N, S=S, H=H, D=D, dtype=dtype))

def launch_reshape_and_cache(ptr_t k, ptr_t v, ptr_t k_cache, ptr_t v_cache, ptr_t slot_mapping,
                             ptr_t k_scale, ptr_t v_scale, int64_t T, int64_t Hkv, int64_t D,
                             int64_t NB, int64_t BS, int dtype, int cache_dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_reshape_and_cache(<const void*>k, <const void*>v, <void*>k_cache,
                                          <void*>v_cache, <const int32_t*>slot_mapping,
                                          <const float*>k_scale, <const float*>v_scale, T, Hkv,
                                          D, NB, BS, dtype, cache_dtype, <taper_stream_t>stream)
    _check_status(st, "reshape_and_cache", dict(T=T, Hkv=Hkv, D=D, NB=NB, BS=BS, dtype=dtype,
                                                cache_dtype=cache_dtype))


def decode_workspace_bytes(int64_t B, int64_t Hq, int64_t D, int num_splits):
    """Workspace bytes the split-K decode kernel needs (0 for one split)."""
    return taper_cuda_decode_workspace_bytes(B, Hq, D, num_splits)


def decode_blocks_per_sm(int64_t Hq, int64_t Hkv, int64_t D, int dtype, int cache_dtype):
    """Blocks of the decode attention kernel for this shape that one SM holds at once (the
    runtime's occupancy calculator); the split rule fills num_sms times this many slots."""
    cdef int blocks = 0
    cdef int st
    with nogil:
        st = taper_cuda_decode_blocks_per_sm(Hq, Hkv, D, dtype, cache_dtype, &blocks)
    _check_status(st, "decode_blocks_per_sm", dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype,
                                                   cache_dtype=cache_dtype))
    return blocks


def launch_paged_attention_decode(ptr_t out, ptr_t q, ptr_t k_cache, ptr_t v_cache,
                                  ptr_t k_scale, ptr_t v_scale, ptr_t block_tables,
                                  ptr_t seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                  int64_t NB, int64_t BS, int64_t MB, float scale,
                                  int64_t sliding_window, float softcap, int dtype,
                                  int cache_dtype, int num_splits, ptr_t workspace,
                                  int64_t workspace_bytes, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_paged_attention_decode(
            <void*>out, <const void*>q, <const void*>k_cache, <const void*>v_cache,
            <const float*>k_scale, <const float*>v_scale, <const int32_t*>block_tables,
            <const int32_t*>seq_lens, B, Hq, Hkv, D, NB, BS, MB, scale, sliding_window, softcap,
            dtype, cache_dtype, num_splits, <void*>workspace, workspace_bytes,
            <taper_stream_t>stream)
    _check_status(st, "paged_attention (decode)",
                  dict(B=B, Hq=Hq, Hkv=Hkv, D=D, NB=NB, BS=BS, MB=MB, dtype=dtype,
                       cache_dtype=cache_dtype, num_splits=num_splits))


def launch_paged_attention_prefill(ptr_t out, ptr_t q, ptr_t k_cache, ptr_t v_cache,
                                   ptr_t k_scale, ptr_t v_scale, ptr_t block_tables,
                                   ptr_t seq_lens, ptr_t query_start_loc, int64_t T, int64_t B,
                                   int64_t Hq, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                                   int64_t MB, float scale, int64_t sliding_window, float softcap,
                                   int dtype, int cache_dtype, int variant, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_paged_attention_prefill(
            <void*>out, <const void*>q, <const void*>k_cache, <const void*>v_cache,
            <const float*>k_scale, <const float*>v_scale, <const int32_t*>block_tables,
            <const int32_t*>seq_lens, <const int32_t*>query_start_loc, T, B, Hq, Hkv, D, NB, BS,
            MB, scale, sliding_window, softcap, dtype, cache_dtype, variant,
            <taper_stream_t>stream)
    _check_status(st, "paged_attention (prefill)",
                  dict(T=T, B=B, Hq=Hq, Hkv=Hkv, D=D, NB=NB, BS=BS, MB=MB, dtype=dtype,
                       cache_dtype=cache_dtype, variant=variant))


def launch_paged_attention_masked(ptr_t out, ptr_t q, ptr_t k_cache, ptr_t v_cache,
                                  ptr_t k_scale, ptr_t v_scale, ptr_t block_tables,
                                  ptr_t seq_lens, ptr_t query_start_loc, ptr_t sinks, int64_t T,
                                  int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t NB,
                                  int64_t BS, int64_t MB, float scale, int64_t sliding_window,
                                  int64_t attention_chunk, float softcap, int dtype,
                                  int cache_dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_paged_attention_masked(
            <void*>out, <const void*>q, <const void*>k_cache, <const void*>v_cache,
            <const float*>k_scale, <const float*>v_scale, <const int32_t*>block_tables,
            <const int32_t*>seq_lens, <const int32_t*>query_start_loc, <const float*>sinks, T, B,
            Hq, Hkv, D, NB, BS, MB, scale, sliding_window, attention_chunk, softcap, dtype,
            cache_dtype, <taper_stream_t>stream)
    _check_status(st, "paged_attention (masked)",
                  dict(T=T, B=B, Hq=Hq, Hkv=Hkv, D=D, NB=NB, BS=BS, MB=MB, dtype=dtype,
                       cache_dtype=cache_dtype, sinks=sinks != 0,
                       attention_chunk=attention_chunk))


def launch_mla_decode_attention(ptr_t out, ptr_t q, ptr_t cache, ptr_t block_tables,
                                ptr_t seq_lens, int64_t B, int64_t Hq, int64_t D, int64_t Dv,
                                int64_t NB, int64_t BS, int64_t MB, float scale, int dtype,
                                ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_mla_decode_attention(
            <void*>out, <const void*>q, <const void*>cache, <const int32_t*>block_tables,
            <const int32_t*>seq_lens, B, Hq, D, Dv, NB, BS, MB, scale, dtype,
            <taper_stream_t>stream)
    _check_status(st, "mla_decode_attention",
                  dict(B=B, Hq=Hq, D=D, Dv=Dv, NB=NB, BS=BS, MB=MB, dtype=dtype))


def launch_argmax(ptr_t logits, ptr_t out, int64_t B, int64_t V, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_argmax(<const float*>logits, <int64_t*>out, B, V, <taper_stream_t>stream)
    _check_status(st, "argmax", dict(B=B, V=V))


def launch_gumbel_sample(ptr_t logits, ptr_t seeds, ptr_t positions, ptr_t out, int64_t B,
                         int64_t V, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_gumbel_sample(<const float*>logits, <const uint64_t*>seeds,
                                      <const int64_t*>positions, <int64_t*>out, B, V,
                                      <taper_stream_t>stream)
    _check_status(st, "gumbel_sample", dict(B=B, V=V))


def launch_apply_token_bitmask(ptr_t logits, ptr_t bitmask, ptr_t rows, int64_t B, int64_t V,
                               int64_t R, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_apply_token_bitmask(<float*>logits, <const int32_t*>bitmask,
                                            <const int32_t*>rows, B, V, R,
                                            <taper_stream_t>stream)
    _check_status(st, "apply_token_bitmask", dict(B=B, V=V, R=R))


def launch_apply_penalties(ptr_t logits, ptr_t rows, ptr_t cols, ptr_t bias, ptr_t rep,
                           ptr_t pres_freq, int64_t B, int64_t V, int64_t N, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_apply_penalties(<float*>logits, <const int32_t*>rows,
                                        <const int32_t*>cols, <const float*>bias,
                                        <const float*>rep, <const float*>pres_freq, B, V, N,
                                        <taper_stream_t>stream)
    _check_status(st, "apply_penalties", dict(B=B, V=V, N=N))


def launch_filter_logits(ptr_t logits, ptr_t temperature, ptr_t top_k, ptr_t top_p, ptr_t min_p,
                         int64_t B, int64_t V, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_filter_logits(<float*>logits, <const float*>temperature,
                                      <const int32_t*>top_k, <const float*>top_p,
                                      <const float*>min_p, B, V, <taper_stream_t>stream)
    _check_status(st, "filter_logits", dict(B=B, V=V))


def launch_sample_fused(ptr_t logits, ptr_t greedy, ptr_t temperature, ptr_t top_k, ptr_t top_p,
                        ptr_t min_p, ptr_t seeds, ptr_t positions, ptr_t pen_rows, ptr_t pen_cols,
                        ptr_t pen_bias, ptr_t pen_rep, ptr_t pen_pres_freq, ptr_t out, int64_t B,
                        int64_t V, int64_t N, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_sample_fused(<float*>logits, <const uint8_t*>greedy,
                                     <const float*>temperature, <const int32_t*>top_k,
                                     <const float*>top_p, <const float*>min_p,
                                     <const uint64_t*>seeds, <const int64_t*>positions,
                                     <const int32_t*>pen_rows, <const int32_t*>pen_cols,
                                     <const float*>pen_bias, <const float*>pen_rep,
                                     <const float*>pen_pres_freq, <int64_t*>out, B, V, N,
                                     <taper_stream_t>stream)
    _check_status(st, "sample_fused", dict(B=B, V=V, N=N))


def gguf_supported(int qtype):
    """Whether the GPU kernels handle this ggml block type (GGUF's type id)."""
    return bool(taper_cuda_gguf_supported(qtype))


def gguf_mmvq_workspace_bytes(int64_t M, int64_t K):
    return taper_cuda_gguf_mmvq_workspace_bytes(M, K)


def launch_gguf_dequantize(int qtype, ptr_t w, ptr_t out, int64_t N, int64_t K, int dtype,
                           ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_gguf_dequantize(qtype, <const void*>w, <void*>out, N, K, dtype,
                                        <taper_stream_t>stream)
    _check_status(st, "gguf_dequantize", dict(qtype=qtype, N=N, K=K, dtype=dtype))


def launch_gguf_mmvq(int qtype, ptr_t x, ptr_t w, ptr_t out, int64_t M, int64_t N, int64_t K,
                     int64_t ldo, int dtype, ptr_t workspace, int64_t workspace_bytes,
                     ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_gguf_mmvq(qtype, <const void*>x, <const void*>w, <void*>out, M, N, K,
                                  ldo, dtype, <void*>workspace, workspace_bytes,
                                  <taper_stream_t>stream)
    _check_status(st, "linear (gguf_mmvq)", dict(qtype=qtype, M=M, N=N, K=K, ldo=ldo,
                                                 dtype=dtype))


def launch_marlin_gemm(ptr_t x, ptr_t qweight, ptr_t scales, ptr_t zeros, ptr_t out, int64_t M,
                       int64_t N, int64_t K, int64_t group_size, int dtype, int variant,
                       ptr_t workspace, int64_t workspace_bytes, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_marlin_gemm(<const void*>x, <const uint32_t*>qweight,
                                    <const float*>scales, <const uint8_t*>zeros, <void*>out, M, N,
                                    K, group_size, dtype, variant, <void*>workspace,
                                    workspace_bytes, <taper_stream_t>stream)
    _check_status(st, "linear (marlin_gemm)", dict(M=M, N=N, K=K, group_size=group_size,
                                                   dtype=dtype, variant=variant))


def marlin_workspace_bytes(int64_t M, int64_t N, int64_t K, int variant):
    return taper_cuda_marlin_workspace_bytes(M, N, K, variant)


def launch_fp8_dequantize(ptr_t w, ptr_t scales, ptr_t out, int64_t N, int64_t K, int64_t bn,
                          int64_t bk, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_fp8_dequantize(<const uint8_t*>w, <const float*>scales, <void*>out, N, K,
                                       bn, bk, dtype, <taper_stream_t>stream)
    _check_status(st, "fp8_dequantize", dict(N=N, K=K, bn=bn, bk=bk, dtype=dtype))


def launch_fp8_gemv(ptr_t x, ptr_t w, ptr_t scales, ptr_t out, int64_t M, int64_t N, int64_t K,
                    int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_fp8_gemv(<const void*>x, <const uint8_t*>w, <const float*>scales,
                                 <void*>out, M, N, K, dtype, <taper_stream_t>stream)
    _check_status(st, "fp8_gemv", dict(M=M, N=N, K=K, dtype=dtype))


def launch_fp8_quantize_per_token_group(ptr_t x, ptr_t q, ptr_t scales, int64_t M, int64_t K,
                                        int64_t group, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_fp8_quantize_per_token_group(<const void*>x, <uint8_t*>q, <float*>scales,
                                                     M, K, group, dtype, <taper_stream_t>stream)
    _check_status(st, "fp8_quantize_per_token_group", dict(M=M, K=K, group=group, dtype=dtype))


def fp8_block_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K):
    return taper_cutlass_fp8_block_gemm_workspace_bytes(M, N, K)


def launch_fp8_block_gemm(ptr_t a, ptr_t a_scales, ptr_t b, ptr_t b_scales, ptr_t out, int64_t M,
                          int64_t N, int64_t K, ptr_t workspace, int64_t workspace_bytes,
                          ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cutlass_fp8_block_gemm(<const uint8_t*>a, <const float*>a_scales,
                                          <const uint8_t*>b, <const float*>b_scales, <void*>out,
                                          M, N, K, <void*>workspace, workspace_bytes,
                                          <taper_stream_t>stream)
    _check_status(st, "linear (fp8_block_gemm)", dict(M=M, N=N, K=K))


def launch_moe_align(ptr_t topk_ids, ptr_t sorted_ids, ptr_t block_expert, ptr_t expert_offsets,
                     ptr_t num_padded, int64_t P, int64_t E, int64_t block_m, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_moe_align(<const int64_t*>topk_ids, <int32_t*>sorted_ids,
                                  <int32_t*>block_expert, <int32_t*>expert_offsets,
                                  <int32_t*>num_padded, P, E, block_m, <taper_stream_t>stream)
    _check_status(st, "moe_align", dict(P=P, E=E, block_m=block_m))


def launch_moe_grouped_gemm(ptr_t x, ptr_t w, int wtype, ptr_t sorted_ids, ptr_t block_expert,
                            ptr_t num_padded, ptr_t out, int64_t P, int64_t E, int64_t N,
                            int64_t K, int64_t x_div, int64_t block_m, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_moe_grouped_gemm(<const void*>x, <const void*>w, wtype,
                                         <const int32_t*>sorted_ids, <const int32_t*>block_expert,
                                         <const int32_t*>num_padded, <void*>out, P, E, N, K,
                                         x_div, block_m, dtype, <taper_stream_t>stream)
    _check_status(st, "moe_grouped_gemm", dict(P=P, E=E, N=N, K=K, x_div=x_div,
                                               block_m=block_m, wtype=wtype, dtype=dtype))


def launch_moe_combine(ptr_t y, ptr_t weights, ptr_t topk_ids, ptr_t out, int64_t T,
                       int64_t top_k, int64_t H, int64_t E, int dtype, ptr_t stream):
    cdef int st
    with nogil:
        st = taper_cuda_moe_combine(<const void*>y, <const float*>weights,
                                    <const int64_t*>topk_ids, <void*>out, T, top_k, H, E, dtype,
                                    <taper_stream_t>stream)
    _check_status(st, "moe_combine", dict(T=T, top_k=top_k, H=H, E=E, dtype=dtype))

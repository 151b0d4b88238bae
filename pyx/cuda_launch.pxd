# The C ABI of cuda/taper_cuda.h, declared nogil for pyx/cuda_backend.pyx.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "taper_cuda.h" nogil:
    ctypedef void* taper_stream_t
    int TAPER_CUDA_OK, TAPER_CUDA_ERR_ARG
    int TAPER_DT_F32, TAPER_DT_BF16, TAPER_DT_F16, TAPER_DT_FP8

    int taper_cuda_device_count()
    const char* taper_cuda_error_string(int status)

    int taper_cuda_lora_linear_slots(const void* x, const void* a, const void* b,
                                     const int32_t* slot_of_row, const int32_t* parts, void* y,
                                     void* out, int64_t T, int64_t K, int64_t N, int64_t S,
                                     int64_t P, int64_t R, int dtype, taper_stream_t stream)
    int taper_cuda_embedding(const int32_t* token_ids, const void* table, void* out, int64_t T,
                             int64_t V, int64_t H, int dtype, taper_stream_t stream)
    int taper_cuda_rms_norm(const void* x, const float* weight, void* out, int64_t T, int64_t H,
                            float eps, int dtype, taper_stream_t stream)
    int taper_cuda_fused_add_rms_norm(void* x, void* residual, const float* weight, int64_t T,
                                      int64_t H, float eps, int dtype, taper_stream_t stream)
    int taper_cuda_layer_norm(const void* x, const float* weight, const float* bias, void* out,
                              int64_t T, int64_t H, float eps, int dtype, taper_stream_t stream)
    int taper_cuda_fused_add_layer_norm(void* x, void* residual, const float* weight,
                                        const float* bias, int64_t T, int64_t H, float eps,
                                        int dtype, taper_stream_t stream)
    int taper_cuda_rotary_embedding(const int32_t* positions, void* q, void* k,
                                    const float* cos_sin_cache, int64_t T, int64_t Hq,
                                    int64_t Hkv, int64_t D, int64_t rot_dim, int64_t max_pos,
                                    int is_neox, int dtype, taper_stream_t stream)
    int taper_cuda_silu_and_mul(const void* x, void* out, int64_t T, int64_t I, int dtype,
                                taper_stream_t stream)
    int taper_cuda_gelu_tanh_and_mul(const void* x, void* out, int64_t T, int64_t I, int dtype,
                                     taper_stream_t stream)
    int taper_cuda_clamped_swiglu(const void* x, void* out, int64_t T, int64_t I, float alpha,
                                  float limit, int dtype, taper_stream_t stream)
    int taper_cuda_softcap(void* x, int64_t n, float cap, int dtype, taper_stream_t stream)
    int taper_cuda_scale(void* x, int64_t n, float s, int dtype, taper_stream_t stream)
    int taper_cuda_add_bias(void* out, const float* bias, int64_t T, int64_t N, int dtype,
                            taper_stream_t stream)
    int taper_cuda_gelu(const void* x, void* out, int64_t n, int dtype, taper_stream_t stream)
    int taper_cuda_encoder_attention(void* out, const void* q, const void* k, const void* v,
                                     const int32_t* cu_seqlens, int64_t N, int64_t S, int64_t H,
                                     int64_t D, float scale, int dtype, taper_stream_t stream)
    int taper_cuda_reshape_and_cache(const void* k, const void* v, void* k_cache, void* v_cache,
                                     const int32_t* slot_mapping, const float* k_scale,
                                     const float* v_scale, int64_t T, int64_t Hkv, int64_t D,
                                     int64_t NB, int64_t BS, int dtype, int cache_dtype,
                                     taper_stream_t stream)
    int64_t taper_cuda_decode_workspace_bytes(int64_t B, int64_t Hq, int64_t D, int num_splits)
    int taper_cuda_decode_blocks_per_sm(int64_t Hq, int64_t Hkv, int64_t D, int dtype,
                                        int cache_dtype, int* blocks)
    int taper_cuda_paged_attention_decode(void* out, const void* q, const void* k_cache,
                                          const void* v_cache, const float* k_scale,
                                          const float* v_scale, const int32_t* block_tables,
                                          const int32_t* seq_lens, int64_t B, int64_t Hq,
                                          int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                                          int64_t MB, float scale, int64_t sliding_window,
                                          float softcap, int dtype, int cache_dtype,
                                          int num_splits, void* workspace,
                                          int64_t workspace_bytes, taper_stream_t stream)
    int taper_cuda_paged_attention_prefill(void* out, const void* q, const void* k_cache,
                                           const void* v_cache, const float* k_scale,
                                           const float* v_scale, const int32_t* block_tables,
                                           const int32_t* seq_lens,
                                           const int32_t* query_start_loc, int64_t T, int64_t B,
                                           int64_t Hq, int64_t Hkv, int64_t D, int64_t NB,
                                           int64_t BS, int64_t MB, float scale,
                                           int64_t sliding_window, float softcap, int dtype,
                                           int cache_dtype, int variant, taper_stream_t stream)
    int taper_cuda_paged_attention_masked(void* out, const void* q, const void* k_cache,
                                          const void* v_cache, const float* k_scale,
                                          const float* v_scale, const int32_t* block_tables,
                                          const int32_t* seq_lens,
                                          const int32_t* query_start_loc, const float* sinks,
                                          int64_t T, int64_t B, int64_t Hq, int64_t Hkv,
                                          int64_t D, int64_t NB, int64_t BS, int64_t MB,
                                          float scale, int64_t sliding_window,
                                          int64_t attention_chunk, float softcap, int dtype,
                                          int cache_dtype, taper_stream_t stream)
    int taper_cuda_mla_decode_attention(void* out, const void* q, const void* cache,
                                        const int32_t* block_tables, const int32_t* seq_lens,
                                        int64_t B, int64_t Hq, int64_t D, int64_t Dv, int64_t NB,
                                        int64_t BS, int64_t MB, float scale, int dtype,
                                        taper_stream_t stream)
    int taper_cuda_argmax(const float* logits, int64_t* out, int64_t B, int64_t V,
                          taper_stream_t stream)
    int taper_cuda_gumbel_sample(const float* logits, const uint64_t* seeds,
                                 const int64_t* positions, int64_t* out, int64_t B, int64_t V,
                                 taper_stream_t stream)
    int taper_cuda_apply_token_bitmask(float* logits, const int32_t* bitmask, const int32_t* rows,
                                       int64_t B, int64_t V, int64_t R, taper_stream_t stream)
    int taper_cuda_apply_penalties(float* logits, const int32_t* rows, const int32_t* cols,
                                   const float* bias, const float* rep, const float* pres_freq,
                                   int64_t B, int64_t V, int64_t N, taper_stream_t stream)
    int taper_cuda_filter_logits(float* logits, const float* temperature, const int32_t* top_k,
                                 const float* top_p, const float* min_p, int64_t B, int64_t V,
                                 taper_stream_t stream)
    int taper_cuda_sample_fused(float* logits, const uint8_t* greedy, const float* temperature,
                                const int32_t* top_k, const float* top_p, const float* min_p,
                                const uint64_t* seeds, const int64_t* positions,
                                const int32_t* pen_rows, const int32_t* pen_cols,
                                const float* pen_bias, const float* pen_rep,
                                const float* pen_pres_freq, int64_t* out, int64_t B, int64_t V,
                                int64_t N, taper_stream_t stream)
    int taper_cuda_gguf_supported(int qtype)
    int taper_cuda_gguf_dequantize(int qtype, const void* w, void* out, int64_t N, int64_t K,
                                   int dtype, taper_stream_t stream)
    int64_t taper_cuda_gguf_mmvq_workspace_bytes(int64_t M, int64_t K)
    int taper_cuda_gguf_mmvq(int qtype, const void* x, const void* w, void* out, int64_t M,
                             int64_t N, int64_t K, int64_t ldo, int dtype, void* workspace,
                             int64_t workspace_bytes, taper_stream_t stream)
    int taper_cuda_marlin_gemm(const void* x, const uint32_t* qweight, const float* scales,
                               const uint8_t* zeros, void* out, int64_t M, int64_t N, int64_t K,
                               int64_t group_size, int dtype, int variant, void* workspace,
                               int64_t workspace_bytes, taper_stream_t stream)
    int64_t taper_cuda_marlin_workspace_bytes(int64_t M, int64_t N, int64_t K, int variant)
    int TAPER_MOE_W_DTYPE, TAPER_MOE_W_Q8_0
    int64_t taper_cuda_moe_align_capacity(int64_t P, int64_t E, int64_t block_m)
    int taper_cuda_moe_align(const int64_t* topk_ids, int32_t* sorted_ids, int32_t* block_expert,
                             int32_t* expert_offsets, int32_t* num_padded, int64_t P, int64_t E,
                             int64_t block_m, taper_stream_t stream)
    int taper_cuda_moe_grouped_gemm(const void* x, const void* w, int wtype,
                                    const int32_t* sorted_ids, const int32_t* block_expert,
                                    const int32_t* num_padded, void* out, int64_t P, int64_t E,
                                    int64_t N, int64_t K, int64_t x_div, int64_t block_m,
                                    int dtype, taper_stream_t stream)
    int taper_cuda_moe_combine(const void* y, const float* weights, const int64_t* topk_ids,
                               void* out, int64_t T, int64_t top_k, int64_t H, int64_t E,
                               int dtype, taper_stream_t stream)


cdef extern from "taper_cutlass.h" nogil:
    int64_t taper_cutlass_fp8_block_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K)
    int taper_cutlass_fp8_block_gemm(const uint8_t* a, const float* a_scales, const uint8_t* b,
                                     const float* b_scales, void* out, int64_t M, int64_t N,
                                     int64_t K, void* workspace, int64_t workspace_bytes,
                                     taper_stream_t stream)
    int taper_cuda_fp8_dequantize(const uint8_t* w, const float* scales, void* out, int64_t N,
                                  int64_t K, int64_t bn, int64_t bk, int dtype,
                                  taper_stream_t stream)
    int taper_cuda_fp8_quantize_per_token_group(const void* x, uint8_t* q, float* scales,
                                                int64_t M, int64_t K, int64_t group, int dtype,
                                                taper_stream_t stream)
    int taper_cuda_fp8_gemv(const void* x, const uint8_t* w, const float* scales, void* out,
                            int64_t M, int64_t N, int64_t K, int dtype, taper_stream_t stream)

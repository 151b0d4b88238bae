// The warp-specialized Hopper prefill kernel (attention_prefill.cu's variant 2), launched by
// taper_cuda_paged_attention_prefill after it has validated the arguments.
#pragma once

#include "common.cuh"

namespace taper {

// bf16/f16 activations with a same-type cache, D in {64, 128}, on a compute capability 9.0
// device (the kernel exists only in the sm_90a build); other inputs return TAPER_CUDA_ERR_ARG,
// and the caller falls back to fa2.
int prefill_attention_fa3(void* out, const void* q, const void* k_cache, const void* v_cache,
                          const int32_t* block_tables, const int32_t* seq_lens,
                          const int32_t* query_start_loc, int64_t T, int64_t B, int64_t Hq,
                          int64_t Hkv, int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                          int64_t sliding_window, float softcap, int dtype, cudaStream_t stream);

}  // namespace taper

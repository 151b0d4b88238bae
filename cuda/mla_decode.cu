// Decode attention over multi-head latent attention's cache (DeepSeek-V2/V3, GLM-4.7-Flash:
// pyx/mla.py's absorbed form). One query row per sequence; every query head reads the one cached
// head, a row of D = kv_lora_rank + qk_rope_head_dim values per token (576 in the released
// models, past the paged attention kernels' D <= 256), and the value is the row's first Dv values.
// Reference: the CPU backend's mla_decode_attention (paged_attention with the cache as K and V).
//
// The simple kernel: a block of 8 warps per (sequence, 8 heads), one warp per head walking the
// sequence's rows in order with an online softmax in float. Lane l holds elements l, l + 32, ...
// of its head's query (scaled) and of its output accumulator, so each row is read by a warp in
// coalesced 32-element runs and a score is one warp sum. The 8 heads of a block read the same
// rows, which stay in L1/L2 between them. No split over the keys: a long context with few
// sequences runs on few blocks (a split-K variant is the next step where that matters).
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kWarps = 8;   // heads per block

// E elements per lane: D <= 32 * E.
template <typename T, int E>
__global__ void __launch_bounds__(kWarps * 32)
mla_decode_kernel(T* __restrict__ out,                    // (B, Hq, Dv)
                  const T* __restrict__ q,                // (B, Hq, D)
                  const T* __restrict__ cache,            // (NB, BS, 1, D)
                  const int32_t* __restrict__ block_tables,  // (B, MB)
                  const int32_t* __restrict__ seq_lens,   // (B,)
                  int Hq, int D, int Dv, int BS, int MB, float scale) {
    const int b = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.y * kWarps + (threadIdx.x >> 5);
    if (h >= Hq) return;    // whole warps leave; nothing below synchronizes the block
    const int sl = seq_lens[b];
    const T* qh = q + ((int64_t)b * Hq + h) * D;
    float qr[E], acc[E];
#pragma unroll
    for (int i = 0; i < E; i++) {
        const int d = lane + 32 * i;
        qr[i] = d < D ? taper::to_float(qh[d]) * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const int32_t* table = block_tables + (int64_t)b * MB;
    for (int j = 0; j < sl; j++) {
        const T* row = cache + ((int64_t)table[j / BS] * BS + j % BS) * D;
        float x[E];
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) {
            const int d = lane + 32 * i;
            x[i] = d < D ? taper::to_float(row[d]) : 0.0f;
            s += qr[i] * x[i];
        }
        s = taper::warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);   // 0 for the first row (m = -inf)
        const float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int i = 0; i < E; i++)
            acc[i] = acc[i] * correction + (lane + 32 * i < Dv ? p * x[i] : 0.0f);
        m = m_new;
    }
    T* oh = out + ((int64_t)b * Hq + h) * Dv;
    const float inv = sl > 0 ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < E; i++) {
        const int d = lane + 32 * i;
        if (d < Dv) oh[d] = taper::from_float<T>(acc[i] * inv);
    }
}

template <typename T, int E>
void launch(void* out, const void* q, const void* cache, const int32_t* block_tables,
            const int32_t* seq_lens, int64_t B, int Hq, int D, int Dv, int BS, int MB,
            float scale, cudaStream_t s) {
    dim3 grid((unsigned)B, (unsigned)taper::ceil_div(Hq, kWarps));
    mla_decode_kernel<T, E><<<grid, kWarps * 32, 0, s>>>(
        (T*)out, (const T*)q, (const T*)cache, block_tables, seq_lens, Hq, D, Dv, BS, MB, scale);
}

}  // namespace

extern "C" int taper_cuda_mla_decode_attention(void* out,                    // (B, Hq, Dv) dtype
                                               const void* q,                // (B, Hq, D) dtype
                                               const void* cache,            // (NB, BS, 1, D)
                                               const int32_t* block_tables,  // (B, MB)
                                               const int32_t* seq_lens,      // (B,)
                                               int64_t B, int64_t Hq, int64_t D, int64_t Dv,
                                               int64_t NB, int64_t BS, int64_t MB, float scale,
                                               int dtype, taper_stream_t stream) {
    if (B < 0 || Hq <= 0 || D <= 0 || D > 1024 || Dv <= 0 || Dv > D || NB <= 0 || BS <= 0 ||
        MB <= 0 || B > INT32_MAX || Hq > 65535 * kWarps || BS > INT32_MAX || MB > INT32_MAX)
        return TAPER_CUDA_ERR_ARG;
    if (B == 0) return TAPER_CUDA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    const int e = (int)taper::ceil_div(D, 32);
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        if (e <= 4)
            launch<scalar_t, 4>(out, q, cache, block_tables, seq_lens, B, (int)Hq, (int)D,
                                (int)Dv, (int)BS, (int)MB, scale, s);
        else if (e <= 8)
            launch<scalar_t, 8>(out, q, cache, block_tables, seq_lens, B, (int)Hq, (int)D,
                                (int)Dv, (int)BS, (int)MB, scale, s);
        else if (e <= 18)
            launch<scalar_t, 18>(out, q, cache, block_tables, seq_lens, B, (int)Hq, (int)D,
                                 (int)Dv, (int)BS, (int)MB, scale, s);
        else
            launch<scalar_t, 32>(out, q, cache, block_tables, seq_lens, B, (int)Hq, (int)D,
                                 (int)Dv, (int)BS, (int)MB, scale, s);
    });
    return taper::launch_status();
}

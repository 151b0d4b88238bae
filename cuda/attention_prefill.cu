// Paged attention for a mixed batch of prefill chunks and decode rows (the CPU op's contract,
// pyx/cpu_kernels.c taper_paged_attention): sequence b owns query rows
// [query_start_loc[b], query_start_loc[b+1]), its last q_len tokens, so row i sits at position
// p = seq_lens[b] - (query_start_loc[b+1] - i) and attends the keys j with
// max(0, p - sliding_window + 1) <= j <= p; key j lives at slot
// block_tables[b, j / BS] * BS + j % BS. Query head h reads KV head h / (Hq / Hkv). Scores are
// scale * dot(q, k), soft-capped when softcap > 0, softmaxed in float. FP8 caches are read back as
// decode(code) * k_scale[kv head] (v_scale). A row whose key range is empty writes zeros.
//
// Three kernels: variant 1, FlashAttention-2 style with GQA packing and a cp.async ring, lives
// in attention_prefill_fa2.cu, and variant 2, its warp-specialized wgmma form for Hopper, in
// attention_prefill_fa3.cu, falling back to variant 1 off compute capability 9.0. They take
// bf16/f16 with a same-type cache and D in {64, 128}. The one here is the reference and the
// general fallback for every other input (f32, FP8 caches, other head sizes):
// (A first tensor-core kernel, mma.sync with one query head per block, was removed after the
// first GPU window: 1676 us against fa2's 836 and fa3's 741 on an H200, 2026-11-28, one 4096-
// token prompt, Hq 32, Hkv 8, D 128.)
// - variant 0: one warp per (query row, query head). The warp finds its sequence by a binary
//   search over query_start_loc, then walks its keys one at a time with an online softmax
//   (running max m, running sum l, output accumulator spread over the lanes). The lanes split
//   each dot product over D and reduce it with shuffles. Any D that is a multiple of 8 up to
//   256, any cache type.
// The same kernel, instanced for D up to 512 as well, serves taper_cuda_paged_attention_masked:
// every batch (decode rows too) of a layer with a mask or a step the tuned kernels lack, GPT-OSS's
// attention sinks (a logit per query head that joins each row's softmax with no value), Llama 4's
// chunked attention (a row at position p sees only the keys of its own attention_chunk-aligned
// chunk, from p / chunk * chunk) and head sizes above 256 (Gemma 4's full layers).
//
// Device data cannot be validated without a synchronization (the engine builds the batch arrays
// from its own block tables), so the kernels only keep a bad batch in bounds: key positions are
// clipped to the block table's MB * BS slots and a block id outside [0, NB) reads as missing
// (variant 0 skips the key, variants 1 and 2 read zeros).
#include "attention_prefill_fa2.cuh"
#include "attention_prefill_fa3.cuh"
#include "common.cuh"

namespace {

// ---- kernels (variant 0)

constexpr int V0_WARPS = 4;    // warps per block: 4 (row, head) pairs
constexpr int V0_MAX_PER_LANE = 8;  // D <= 256 = 32 lanes * 8 elements
constexpr int MASKED_MAX_D = 512;   // the masked entry's widest head: 32 lanes * 16 elements

// One K or V element as float. C is the cache's element type: the activation type, or uint8_t
// for FP8 e4m3 codes (then scaled by the KV head's scale).
template <typename C>
__device__ __forceinline__ float load_kv(const C* p, float /*scale*/) {
    return taper::to_float(*p);
}
template <>
__device__ __forceinline__ float load_kv<uint8_t>(const uint8_t* p, float scale) {
    return taper::fp8_decode(*p) * scale;
}

// Largest b in [0, B) with query_start_loc[b] <= i: the sequence that owns row i (an empty
// sequence shares its start with the next one and loses to it).
__device__ __forceinline__ int find_sequence(const int32_t* __restrict__ query_start_loc,
                                             int B, int64_t i) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if ((int64_t)query_start_loc[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Warp w of the grid handles row i = w / Hq and query head h = w % Hq. Lane l holds dimensions
// l, l + 32, l + 64, ... (D / 32 rounded up of them, at most kPerLane), so every K/V row load is
// coalesced. sinks (Hq,) or NULL: the row's softmax denominator gains exp(sinks[h] - m), as the
// CPU kernel's attn_denominator. chunk > 0: keys before p / chunk * chunk are masked.
template <typename T, typename C, int kPerLane>
__global__ void __launch_bounds__(V0_WARPS * 32)
prefill_attention_simple_kernel(T* __restrict__ out,                    // (T, Hq, D)
                                const T* __restrict__ q,                // (T, Hq, D)
                                const C* __restrict__ k_cache,          // (NB, BS, Hkv, D)
                                const C* __restrict__ v_cache,          // (NB, BS, Hkv, D)
                                const float* __restrict__ k_scale,      // (Hkv,) FP8, else NULL
                                const float* __restrict__ v_scale,      // (Hkv,) FP8, else NULL
                                const int32_t* __restrict__ block_tables,     // (B, MB)
                                const int32_t* __restrict__ seq_lens,         // (B,)
                                const int32_t* __restrict__ query_start_loc,  // (B+1,)
                                const float* __restrict__ sinks,        // (Hq,) or NULL
                                int64_t num_tokens, int B, int Hq, int Hkv, int D, int64_t NB,
                                int BS, int MB, float scale, int64_t sliding_window,
                                int64_t chunk, float softcap) {
    const int lane = threadIdx.x & 31;
    const int64_t w = (int64_t)blockIdx.x * V0_WARPS + (threadIdx.x >> 5);
    if (w >= num_tokens * Hq) return;  // warp-uniform: no shuffle below runs short of lanes
    const int64_t i = w / Hq;
    const int h = (int)(w % Hq);
    const int kvh = h / (Hq / Hkv);

    const int b = find_sequence(query_start_loc, B, i);
    const int64_t p = (int64_t)seq_lens[b] - ((int64_t)query_start_loc[b + 1] - i);
    int64_t k_lo = sliding_window > 0 ? max((int64_t)0, p - sliding_window + 1) : 0;
    if (chunk > 0 && p >= 0) k_lo = max(k_lo, p / chunk * chunk);
    const int64_t k_hi = min(p, (int64_t)MB * BS - 1);
    const int32_t* bt = block_tables + (int64_t)b * MB;
    const float ks = k_scale ? k_scale[kvh] : 1.f;
    const float vs = v_scale ? v_scale[kvh] : 1.f;

    // The query, pre-scaled as the CPU kernel does (q * scale, then the dot product).
    const T* qrow = q + (i * Hq + h) * D;
    float qr[kPerLane], acc[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; e++) {
        const int d = e * 32 + lane;
        qr[e] = d < D ? taper::to_float(qrow[d]) * scale : 0.f;
        acc[e] = 0.f;
    }

    float m = -INFINITY, l = 0.f;
    for (int64_t j = k_lo; j <= k_hi; j++) {
        const int32_t blk = bt[j / BS];
        if (blk < 0 || blk >= NB) continue;  // a bad block table: skip, never read out of bounds
        const int64_t base = (((int64_t)blk * BS + j % BS) * Hkv + kvh) * D;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; e++) {
            const int d = e * 32 + lane;
            if (d < D) s += qr[e] * load_kv(k_cache + base + d, ks);
        }
        // The xor butterfly adds the same two values in swapped order on both lanes of each pair,
        // so every lane ends with the bit-identical score and m, l stay warp-uniform.
        s = taper::warp_sum(s);
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        if (m_new == -INFINITY) continue;  // only an infinite input gets here; it adds nothing
        const float alpha = expf(m - m_new);  // 0 on the first key (m = -inf)
        const float pj = expf(s - m_new);
        l = l * alpha + pj;
        m = m_new;
#pragma unroll
        for (int e = 0; e < kPerLane; e++) {
            const int d = e * 32 + lane;
            if (d < D) acc[e] = acc[e] * alpha + pj * load_kv(v_cache + base + d, vs);
        }
    }

    if (sinks && l > 0.f) l += expf(sinks[h] - m);
    const float inv = l > 0.f ? 1.f / l : 0.f;  // an empty key range writes zeros
    T* orow = out + (i * Hq + h) * D;
#pragma unroll
    for (int e = 0; e < kPerLane; e++) {
        const int d = e * 32 + lane;
        if (d < D) orow[d] = taper::from_float<T>(acc[e] * inv);
    }
}

// ---- launchers

struct PrefillArgs {
    void* out;
    const void* q;
    const void* k_cache;
    const void* v_cache;
    const float* k_scale;
    const float* v_scale;
    const int32_t* block_tables;
    const int32_t* seq_lens;
    const int32_t* query_start_loc;
    int64_t T, B, Hq, Hkv, D, NB, BS, MB;
    float scale;
    int64_t sliding_window;
    float softcap;
    const float* sinks;  // the masked entry's; NULL for the prefill variants
    int64_t chunk;       // the masked entry's; 0 for the prefill variants
};

template <typename T, typename C, int kPerLane>
int launch_simple_lanes(const PrefillArgs& a, cudaStream_t stream) {
    // Four warps (128 threads) per block: consecutive warps are consecutive heads of one row, so
    // the heads of a KV group read the same K/V lines and the second reader hits L1.
    const int64_t blocks = taper::ceil_div(a.T * a.Hq, V0_WARPS);
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    prefill_attention_simple_kernel<T, C, kPerLane>
        <<<(unsigned)blocks, V0_WARPS * 32, 0, stream>>>(
            (T*)a.out, (const T*)a.q, (const C*)a.k_cache, (const C*)a.v_cache, a.k_scale,
            a.v_scale, a.block_tables, a.seq_lens, a.query_start_loc, a.sinks, a.T, (int)a.B,
            (int)a.Hq, (int)a.Hkv, (int)a.D, a.NB, (int)a.BS, (int)a.MB, a.scale,
            a.sliding_window, a.chunk, a.softcap);
    return taper::launch_status();
}

// Heads up to 256 wide take the 8-per-lane instance (the prefill variant 0's, unchanged), wider
// ones (up to MASKED_MAX_D) the 16-per-lane one.
template <typename T, typename C>
int launch_simple(const PrefillArgs& a, cudaStream_t stream) {
    if (a.D <= 32 * V0_MAX_PER_LANE) return launch_simple_lanes<T, C, V0_MAX_PER_LANE>(a, stream);
    return launch_simple_lanes<T, C, 2 * V0_MAX_PER_LANE>(a, stream);
}

}  // namespace

extern "C" int taper_cuda_paged_attention_prefill(
    void* out,                       // (T, Hq, D) dtype
    const void* q,                   // (T, Hq, D) dtype
    const void* k_cache,             // (NB, BS, Hkv, D) cache_dtype
    const void* v_cache,             // (NB, BS, Hkv, D) cache_dtype
    const float* k_scale,            // (Hkv,) FP8, else NULL
    const float* v_scale,            // (Hkv,) FP8, else NULL
    const int32_t* block_tables,     // (B, MB)
    const int32_t* seq_lens,         // (B,)
    const int32_t* query_start_loc,  // (B+1,)
    int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t NB, int64_t BS, int64_t MB,
    float scale, int64_t sliding_window, float softcap, int dtype, int cache_dtype, int variant,
    taper_stream_t stream) {
    if (T < 0 || B < 0) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || B == 0) return TAPER_CUDA_OK;
    if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || D % 8 != 0 || D > 256 || NB <= 0 ||
        BS <= 0 || MB <= 0)
        return TAPER_CUDA_ERR_ARG;
    if (B >= INT32_MAX || Hq > INT32_MAX || BS > INT32_MAX || MB > INT32_MAX)
        return TAPER_CUDA_ERR_ARG;
    if (!out || !q || !k_cache || !v_cache || !block_tables || !seq_lens || !query_start_loc)
        return TAPER_CUDA_ERR_ARG;
    const bool fp8 = cache_dtype == TAPER_DT_FP8;
    if (fp8 ? (!k_scale || !v_scale) : cache_dtype != dtype) return TAPER_CUDA_ERR_ARG;
    if (variant < 0 || variant > 2) return TAPER_CUDA_ERR_ARG;

    const PrefillArgs a = {out, q, k_cache, v_cache, fp8 ? k_scale : nullptr,
                           fp8 ? v_scale : nullptr, block_tables, seq_lens, query_start_loc,
                           T, B, Hq, Hkv, D, NB, BS, MB, scale, sliding_window, softcap,
                           nullptr, 0};
    cudaStream_t s = (cudaStream_t)stream;

    if (variant == 2 && !fp8) {  // attention_prefill_fa3.cu: as fa2, on sm_90 only
        const int r = taper::prefill_attention_fa3(out, q, k_cache, v_cache, block_tables, seq_lens,
                                                   query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB,
                                                   scale, sliding_window, softcap, dtype, s);
        if (r != TAPER_CUDA_ERR_ARG) return r;  // else another arch or shape: fa2 tries
    }
    if (variant >= 1) {  // attention_prefill_fa2.cu: bf16/f16 with a same-type cache
        if (fp8) return TAPER_CUDA_ERR_ARG;
        return taper::prefill_attention_fa2(out, q, k_cache, v_cache, block_tables, seq_lens,
                                            query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB, scale,
                                            sliding_window, softcap, dtype, s);
    }

    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        return fp8 ? launch_simple<scalar_t, uint8_t>(a, s)
                   : launch_simple<scalar_t, scalar_t>(a, s);
    });
    return TAPER_CUDA_ERR_ARG;  // not reached: the dispatch returns in every case
}

extern "C" int taper_cuda_paged_attention_masked(
    void* out,                       // (T, Hq, D) dtype
    const void* q,                   // (T, Hq, D) dtype
    const void* k_cache,             // (NB, BS, Hkv, D) cache_dtype
    const void* v_cache,             // (NB, BS, Hkv, D) cache_dtype
    const float* k_scale,            // (Hkv,) FP8, else NULL
    const float* v_scale,            // (Hkv,) FP8, else NULL
    const int32_t* block_tables,     // (B, MB)
    const int32_t* seq_lens,         // (B,)
    const int32_t* query_start_loc,  // (B+1,)
    const float* sinks,              // (Hq,) or NULL
    int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t NB, int64_t BS, int64_t MB,
    float scale, int64_t sliding_window, int64_t attention_chunk, float softcap, int dtype,
    int cache_dtype, taper_stream_t stream) {
    if (T < 0 || B < 0 || sliding_window < 0 || attention_chunk < 0) return TAPER_CUDA_ERR_ARG;
    if (T == 0 || B == 0) return TAPER_CUDA_OK;
    if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || D % 8 != 0 || D > MASKED_MAX_D ||
        NB <= 0 || BS <= 0 || MB <= 0)
        return TAPER_CUDA_ERR_ARG;
    if (B >= INT32_MAX || Hq > INT32_MAX || BS > INT32_MAX || MB > INT32_MAX)
        return TAPER_CUDA_ERR_ARG;
    if (!out || !q || !k_cache || !v_cache || !block_tables || !seq_lens || !query_start_loc)
        return TAPER_CUDA_ERR_ARG;
    const bool fp8 = cache_dtype == TAPER_DT_FP8;
    if (fp8 ? (!k_scale || !v_scale) : cache_dtype != dtype) return TAPER_CUDA_ERR_ARG;
    const PrefillArgs a = {out, q, k_cache, v_cache, fp8 ? k_scale : nullptr,
                           fp8 ? v_scale : nullptr, block_tables, seq_lens, query_start_loc,
                           T, B, Hq, Hkv, D, NB, BS, MB, scale, sliding_window, softcap,
                           sinks, attention_chunk};
    cudaStream_t s = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        return fp8 ? launch_simple<scalar_t, uint8_t>(a, s)
                   : launch_simple<scalar_t, scalar_t>(a, s);
    });
    return TAPER_CUDA_ERR_ARG;  // not reached: the dispatch returns in every case
}

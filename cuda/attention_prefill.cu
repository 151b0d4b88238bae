// Paged attention for a mixed batch of prefill chunks and decode rows (the CPU op's contract,
// pyx/cpu_kernels.c taper_paged_attention): sequence b owns query rows
// [query_start_loc[b], query_start_loc[b+1]), its last q_len tokens, so row i sits at position
// p = seq_lens[b] - (query_start_loc[b+1] - i) and attends the keys j with
// max(0, p - sliding_window + 1) <= j <= p; key j lives at slot
// block_tables[b, j / BS] * BS + j % BS. Query head h reads KV head h / (Hq / Hkv). Scores are
// scale * dot(q, k), soft-capped when softcap > 0, softmaxed in float. FP8 caches are read back as
// decode(code) * k_scale[kv head] (v_scale). A row whose key range is empty writes zeros.
//
// Three kernels (variant 2, FlashAttention-2 style with GQA packing and a cp.async ring, lives
// in attention_prefill_fa2.cu, and variant 3, its warp-specialized wgmma form for Hopper, in
// attention_prefill_fa3.cu, falling back to variant 2 off compute capability 9.0; the two here
// stay as their references):
// - variant 0, the reference: one warp per (query row, query head). The warp finds its sequence
//   by a binary search over query_start_loc, then walks its keys one at a time with an online
//   softmax (running max m, running sum l, output accumulator spread over the lanes). The lanes
//   split each dot product over D and reduce it with shuffles. Any D that is a multiple of 8 up to
//   256, any cache type.
// - variant 1, flash-attention-2 style on tensor cores (mma.sync m16n8k16, bf16/f16 in, f32
//   accumulate), bf16/f16 with a same-type cache and D in {64, 128}. A block owns 64 query rows
//   of one sequence and one query head; each of its 4 warps owns 16 rows. Key tiles of 64 are
//   gathered slot by slot through the block table into shared memory (a tile may span several
//   cache blocks), S = Q K^T and O += P V run on mma.sync, and the online softmax lives in the
//   accumulator registers. The trick that avoids any host-side tile list: sequence b gets the
//   block tiles [floor(qsl[b] / 64) + b, floor(qsl[b+1] / 64) + b + 1), which is always at least
//   ceil(q_len / 64) tiles, so the grid has floor(T / 64) + B tiles and a block finds its
//   (sequence, tile) by a binary search over that strictly increasing sequence; the at most B
//   surplus tiles exit at once.
//
// Device data cannot be validated without a synchronization (the engine builds the batch arrays
// from its own block tables), so the kernels only keep a bad batch in bounds: key positions are clipped
// to the block table's MB * BS slots and a block id outside [0, NB) reads as missing (variant 0
// skips the key, variant 1 reads zeros).
#include "attention_prefill_fa2.cuh"
#include "attention_prefill_fa3.cuh"
#include "common.cuh"
#include "mma.cuh"

namespace {

// ---- kernels (variant 0)

constexpr int V0_WARPS = 4;    // warps per block: 4 (row, head) pairs
constexpr int V0_MAX_PER_LANE = 8;  // D <= 256 = 32 lanes * 8 elements

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
// l, l + 32, l + 64, ... (D / 32 rounded up of them), so every K/V row load is coalesced.
template <typename T, typename C>
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
                                int64_t num_tokens, int B, int Hq, int Hkv, int D, int64_t NB,
                                int BS, int MB, float scale, int64_t sliding_window,
                                float softcap) {
    const int lane = threadIdx.x & 31;
    const int64_t w = (int64_t)blockIdx.x * V0_WARPS + (threadIdx.x >> 5);
    if (w >= num_tokens * Hq) return;  // warp-uniform: no shuffle below runs short of lanes
    const int64_t i = w / Hq;
    const int h = (int)(w % Hq);
    const int kvh = h / (Hq / Hkv);

    const int b = find_sequence(query_start_loc, B, i);
    const int64_t p = (int64_t)seq_lens[b] - ((int64_t)query_start_loc[b + 1] - i);
    const int64_t k_lo = sliding_window > 0 ? max((int64_t)0, p - sliding_window + 1) : 0;
    const int64_t k_hi = min(p, (int64_t)MB * BS - 1);
    const int32_t* bt = block_tables + (int64_t)b * MB;
    const float ks = k_scale ? k_scale[kvh] : 1.f;
    const float vs = v_scale ? v_scale[kvh] : 1.f;

    // The query, pre-scaled as the CPU kernel does (q * scale, then the dot product).
    const T* qrow = q + (i * Hq + h) * D;
    float qr[V0_MAX_PER_LANE], acc[V0_MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < V0_MAX_PER_LANE; e++) {
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
        for (int e = 0; e < V0_MAX_PER_LANE; e++) {
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
        for (int e = 0; e < V0_MAX_PER_LANE; e++) {
            const int d = e * 32 + lane;
            if (d < D) acc[e] = acc[e] * alpha + pj * load_kv(v_cache + base + d, vs);
        }
    }

    const float inv = l > 0.f ? 1.f / l : 0.f;  // an empty key range writes zeros
    T* orow = out + (i * Hq + h) * D;
#pragma unroll
    for (int e = 0; e < V0_MAX_PER_LANE; e++) {
        const int d = e * 32 + lane;
        if (d < D) orow[d] = taper::from_float<T>(acc[e] * inv);
    }
}

// ---- kernels (variant 1)

// Tile choice: 64 query rows x 64 keys per step with 4 warps of 16 rows. 16 rows per warp is one
// mma M; 64 keys make 8 n-tiles for S and 4 k-steps for P V. With D = 128 a thread holds the Q
// fragments (32 registers), S (32 floats) and O (64 floats): ptxas uses about 224 registers and
// no spills at 128 threads (about 168 for D = 64), and K + V tiles take 2 * 64 * (128 + 8) * 2 =
// 34 KiB of shared memory, so two (D = 128) or three (D = 64) blocks share an SM, limited by
// registers, and hide each other's gather latency (there is no cp.async double buffering: simple
// first). Causal tiles past a warp's last position, or before its sliding window, are skipped
// per warp. A decode row (q_len 1) still gets a whole 64-row block; the engine mixes few of them
// into prefill steps, and variant 0 remains the default.
constexpr int V1_M = 64;       // query rows per block
constexpr int V1_N = 64;       // keys per tile
constexpr int V1_WARPS = V1_M / 16;
constexpr int V1_THREADS = V1_WARPS * 32;

// pack_pair and mma_16816 (mma.sync m16n8k16, sm_80 and up, unchanged on sm_90a): cuda/mma.cuh.
using taper::mma_16816;
using taper::pack_pair;

__device__ __forceinline__ uint32_t load_u32(const void* p) { return *(const uint32_t*)p; }

// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// g = lane / 4 and c = lane % 4:
//   A (16x16): a0 = (row g, cols 2c, 2c+1), a1 = (row g+8, same cols), a2 = (row g, cols 2c+8,
//              2c+9), a3 = (row g+8, cols 2c+8, 2c+9); the lower column sits in the low half.
//   B (16x8):  b0 = (rows 2c, 2c+1, col g), b1 = (rows 2c+8, 2c+9, col g).
//   C (16x8):  c0, c1 = (row g, cols 2c, 2c+1), c2, c3 = (row g+8, cols 2c, 2c+1).
// So each lane owns query rows g and g+8 of its warp's 16 (called rows "a" and "b" below), and
// the C fragments of S for key n-tiles 2k and 2k+1 are exactly the A fragment of P for the k-th
// 16-key step of P V (the FlashAttention-2 register reuse).
template <typename T, int D>
__global__ void __launch_bounds__(V1_THREADS)
prefill_attention_mma_kernel(T* __restrict__ out,                          // (T, Hq, D)
                             const T* __restrict__ q,                      // (T, Hq, D)
                             const T* __restrict__ k_cache,                // (NB, BS, Hkv, D)
                             const T* __restrict__ v_cache,                // (NB, BS, Hkv, D)
                             const int32_t* __restrict__ block_tables,     // (B, MB)
                             const int32_t* __restrict__ seq_lens,         // (B,)
                             const int32_t* __restrict__ query_start_loc,  // (B+1,)
                             int64_t num_tokens, int B, int Hq, int Hkv, int64_t NB, int BS,
                             int MB, float scale, int64_t sliding_window, float softcap) {
    // Rows of D + 8 elements: the 16-byte pad shifts consecutive rows by 4 banks, so the 8 rows
    // (g = 0..7) x 4 words (c = 0..3) a warp reads per fragment load fall in 32 distinct banks.
    constexpr int LD = D + 8;
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per K/V row
    __shared__ __align__(16) T sK[V1_N * LD];  // (V1_N keys, D) padded
    __shared__ __align__(16) T sV[V1_N * LD];  // (V1_N keys, D) padded
    const uint16_t* sVu = reinterpret_cast<const uint16_t*>(sV);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;

    // Heads vary fastest over blockIdx.x, so the blocks that run together read the same K/V
    // tiles (one KV head's group) from L2. Tiles go in reverse order: the last, longest-context
    // tiles of each sequence start first and the short ones fill in the tail.
    const int h = (int)(blockIdx.x % Hq);
    const int64_t ntiles = gridDim.x / Hq;
    const int64_t tile = ntiles - 1 - blockIdx.x / Hq;
    int b = 0;
    {
        int lo = 0, hi = B - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if ((int64_t)query_start_loc[mid] / V1_M + mid <= tile) lo = mid;
            else hi = mid - 1;
        }
        b = lo;
    }
    const int64_t q_begin = query_start_loc[b], q_end_raw = query_start_loc[b + 1];
    const int64_t q_end = min(q_end_raw, num_tokens);
    const int64_t r0 = q_begin + (tile - (q_begin / V1_M + b)) * V1_M;
    if (r0 < 0 || r0 >= q_end) return;  // a surplus tile (block-uniform, before any barrier)
    const int64_t r1 = min(r0 + V1_M, q_end);
    const int64_t pos_off = (int64_t)seq_lens[b] - q_end_raw;  // position of row r: r + pos_off
    const int kvh = h / (Hq / Hkv);
    const int32_t* bt = block_tables + (int64_t)b * MB;

    // The block's key range: from the first row's window start to the last row's position.
    const int64_t k_begin =
        sliding_window > 0 ? max((int64_t)0, r0 + pos_off - sliding_window + 1) : 0;
    const int64_t k_end = min(r1 - 1 + pos_off, (int64_t)MB * BS - 1);  // inclusive

    // This warp's rows and this lane's rows a = g, b = g + 8 within them.
    const int64_t w_r0 = r0 + warp * 16;
    const bool warp_active = w_r0 < r1;
    const int64_t w_p_last = min(w_r0 + 15, r1 - 1) + pos_off;
    const int64_t w_k_first = sliding_window > 0 ? w_r0 + pos_off - sliding_window + 1 : 0;
    const int64_t row_a = w_r0 + g, row_b = w_r0 + g + 8;
    const bool ok_a = row_a < r1, ok_b = row_b < r1;
    const int64_t p_a = row_a + pos_off, p_b = row_b + pos_off;
    const int64_t lo_a = sliding_window > 0 ? p_a - sliding_window + 1 : 0;
    const int64_t lo_b = sliding_window > 0 ? p_b - sliding_window + 1 : 0;

    // Q fragments for the D / 16 k-steps of S = Q K^T, read once from global memory (rows past
    // the tile read as zeros). The scale is applied to S in float, not to the 16-bit Q.
    uint32_t qf[D / 16][4];
    {
        const T* qa = q + (row_a * Hq + h) * (int64_t)D;
        const T* qb = q + (row_b * Hq + h) * (int64_t)D;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const int col = kk * 16 + 2 * c;
            qf[kk][0] = ok_a ? load_u32(qa + col) : 0u;
            qf[kk][1] = ok_b ? load_u32(qb + col) : 0u;
            qf[kk][2] = ok_a ? load_u32(qa + col + 8) : 0u;
            qf[kk][3] = ok_b ? load_u32(qb + col + 8) : 0u;
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY;  // running row maxima (quad-uniform)
    float l_a = 0.f, l_b = 0.f;              // running row sums, this lane's columns only

    for (int64_t kt = k_begin; kt <= k_end; kt += V1_N) {
        __syncthreads();  // every warp is done reading the previous tile
        // Gather: key kt + r goes to row r of sK / sV, 16 bytes per thread per step; keys past
        // k_end and missing blocks become zero rows so that P (0) * V never meets stale NaNs.
        for (int idx = tid; idx < V1_N * CHUNKS; idx += V1_THREADS) {
            const int r = idx / CHUNKS, part = idx % CHUNKS;
            const int64_t j = kt + r;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
            if (j <= k_end) {
                const int32_t blk = bt[j / BS];
                if (blk >= 0 && blk < NB) {
                    const int64_t off = (((int64_t)blk * BS + j % BS) * Hkv + kvh) * D + part * 8;
                    kv = *reinterpret_cast<const uint4*>(k_cache + off);
                    vv = *reinterpret_cast<const uint4*>(v_cache + off);
                }
            }
            *reinterpret_cast<uint4*>(sK + r * LD + part * 8) = kv;
            *reinterpret_cast<uint4*>(sV + r * LD + part * 8) = vv;
        }
        __syncthreads();
        // A tile wholly after the warp's last position or before its first window start adds
        // nothing; skipping it keeps m and l unchanged, as the masked update would.
        if (!warp_active || kt > w_p_last || kt + V1_N - 1 < w_k_first) continue;

        // S = Q K^T: 16 rows x 64 keys, 8 n-tiles of 8 keys. B[k][n] = K[key n][dim k], so b0/b1
        // are two adjacent dims of one key row: one 32-bit shared load each.
        float s[V1_N / 8][4];
#pragma unroll
        for (int n = 0; n < V1_N / 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const T* kp = sK + (n * 8 + g) * LD + 2 * c;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                mma_16816(s[n], qf[kk], load_u32(kp + kk * 16), load_u32(kp + kk * 16 + 8),
                          (T*)nullptr);
        }

        // Scale, soft-cap and mask by absolute positions; the masks become tile-relative key
        // indices [lo, hi] so the per-element test is two int compares.
        const int64_t lim = min((int64_t)V1_N - 1, k_end - kt);
        const int hi_a = ok_a ? (int)max((int64_t)-1, min(p_a - kt, lim)) : -1;
        const int hi_b = ok_b ? (int)max((int64_t)-1, min(p_b - kt, lim)) : -1;
        const int lo_ra = (int)min((int64_t)V1_N, max((int64_t)0, lo_a - kt));
        const int lo_rb = (int)min((int64_t)V1_N, max((int64_t)0, lo_b - kt));
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int n = 0; n < V1_N / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int jr = n * 8 + 2 * c + (e & 1);
                float x = s[n][e] * scale;
                if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                if (e < 2) {
                    if (jr < lo_ra || jr > hi_a) x = -INFINITY;
                    mx_a = fmaxf(mx_a, x);
                } else {
                    if (jr < lo_rb || jr > hi_b) x = -INFINITY;
                    mx_b = fmaxf(mx_b, x);
                }
                s[n][e] = x;
            }
        }
        // A row's 64 columns are spread over the 4 lanes of a quad (c = 0..3).
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        // While a row has seen no key its max is -inf: subtract 0 instead so exp gives 0, not NaN.
        const float base_a = mn_a == -INFINITY ? 0.f : mn_a;
        const float base_b = mn_b == -INFINITY ? 0.f : mn_b;
        const float alpha_a = __expf(m_a - base_a), alpha_b = __expf(m_b - base_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int n = 0; n < V1_N / 8; n++) {
            s[n][0] = __expf(s[n][0] - base_a);
            s[n][1] = __expf(s[n][1] - base_a);
            s[n][2] = __expf(s[n][2] - base_b);
            s[n][3] = __expf(s[n][3] - base_b);
            sum_a += s[n][0] + s[n][1];
            sum_b += s[n][2] + s[n][3];
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= alpha_a;
            o[n][1] *= alpha_a;
            o[n][2] *= alpha_b;
            o[n][3] *= alpha_b;
        }

        // O += P V: 4 k-steps of 16 keys, D / 8 n-tiles of 8 dims. B[k][n] = V[key k][dim n]
        // needs two keys of one dim per register: two 16-bit shared loads, packed low = lower key.
#pragma unroll
        for (int kk = 0; kk < V1_N / 16; kk++) {
            uint32_t a[4];
            a[0] = pack_pair(s[2 * kk][0], s[2 * kk][1], (T*)nullptr);
            a[1] = pack_pair(s[2 * kk][2], s[2 * kk][3], (T*)nullptr);
            a[2] = pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], (T*)nullptr);
            a[3] = pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], (T*)nullptr);
            const uint16_t* vp = sVu + (kk * 16 + 2 * c) * LD + g;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                const uint16_t* v = vp + n * 8;
                const uint32_t b0 = (uint32_t)v[0] | ((uint32_t)v[LD] << 16);
                const uint32_t b1 = (uint32_t)v[8 * LD] | ((uint32_t)v[9 * LD] << 16);
                mma_16816(o[n], a, b0, b1, (T*)nullptr);
            }
        }
    }

    // Finish the row sums over the quad and write O / l (zeros for a row that saw no key).
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f;
    const float inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    T* oa = out + (row_a * Hq + h) * (int64_t)D;
    T* ob = out + (row_b * Hq + h) * (int64_t)D;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        const int col = n * 8 + 2 * c;
        if (ok_a) *(uint32_t*)(oa + col) = pack_pair(o[n][0] * inv_a, o[n][1] * inv_a, (T*)nullptr);
        if (ok_b) *(uint32_t*)(ob + col) = pack_pair(o[n][2] * inv_b, o[n][3] * inv_b, (T*)nullptr);
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
};

template <typename T, typename C>
int launch_simple(const PrefillArgs& a, cudaStream_t stream) {
    // Four warps (128 threads) per block: consecutive warps are consecutive heads of one row, so
    // the heads of a KV group read the same K/V lines and the second reader hits L1.
    const int64_t blocks = taper::ceil_div(a.T * a.Hq, V0_WARPS);
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    prefill_attention_simple_kernel<T, C><<<(unsigned)blocks, V0_WARPS * 32, 0, stream>>>(
        (T*)a.out, (const T*)a.q, (const C*)a.k_cache, (const C*)a.v_cache, a.k_scale, a.v_scale,
        a.block_tables, a.seq_lens, a.query_start_loc, a.T, (int)a.B, (int)a.Hq, (int)a.Hkv,
        (int)a.D, a.NB, (int)a.BS, (int)a.MB, a.scale, a.sliding_window, a.softcap);
    return taper::launch_status();
}

template <typename T, int D>
int launch_mma(const PrefillArgs& a, cudaStream_t stream) {
    // floor(T / 64) + B tiles cover every sequence (see the header), times Hq heads.
    const int64_t blocks = (a.T / V1_M + a.B) * a.Hq;
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    prefill_attention_mma_kernel<T, D><<<(unsigned)blocks, V1_THREADS, 0, stream>>>(
        (T*)a.out, (const T*)a.q, (const T*)a.k_cache, (const T*)a.v_cache, a.block_tables,
        a.seq_lens, a.query_start_loc, a.T, (int)a.B, (int)a.Hq, (int)a.Hkv, a.NB, (int)a.BS,
        (int)a.MB, a.scale, a.sliding_window, a.softcap);
    return taper::launch_status();
}

template <typename T>
int launch_mma_dim(const PrefillArgs& a, cudaStream_t stream) {
    // Only the two head sizes the engine's models use get the tensor-core kernel (compile time).
    if (a.D == 64) return launch_mma<T, 64>(a, stream);
    if (a.D == 128) return launch_mma<T, 128>(a, stream);
    return TAPER_CUDA_ERR_ARG;
}

bool aligned(const void* p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; }

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
    if (variant < 0 || variant > 3) return TAPER_CUDA_ERR_ARG;

    const PrefillArgs a = {out, q, k_cache, v_cache, fp8 ? k_scale : nullptr,
                           fp8 ? v_scale : nullptr, block_tables, seq_lens, query_start_loc,
                           T, B, Hq, Hkv, D, NB, BS, MB, scale, sliding_window, softcap};
    cudaStream_t s = (cudaStream_t)stream;

    if (variant == 3 && !fp8) {  // attention_prefill_fa3.cu: as fa2, on sm_90 only
        const int r = taper::prefill_attention_fa3(out, q, k_cache, v_cache, block_tables, seq_lens,
                                                   query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB,
                                                   scale, sliding_window, softcap, dtype, s);
        if (r != TAPER_CUDA_ERR_ARG) return r;  // else another arch or shape: fa2 tries
    }
    if (variant >= 2) {  // attention_prefill_fa2.cu: bf16/f16 with a same-type cache
        if (fp8) return TAPER_CUDA_ERR_ARG;
        return taper::prefill_attention_fa2(out, q, k_cache, v_cache, block_tables, seq_lens,
                                            query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB, scale,
                                            sliding_window, softcap, dtype, s);
    }
    if (variant == 1) {
        // The tensor-core kernel moves K/V in 16-byte chunks and Q/out in 32-bit pairs.
        if (fp8 || !aligned(k_cache, 16) || !aligned(v_cache, 16) || !aligned(q, 4) ||
            !aligned(out, 4))
            return TAPER_CUDA_ERR_ARG;
        if (dtype == TAPER_DT_BF16) return launch_mma_dim<__nv_bfloat16>(a, s);
        if (dtype == TAPER_DT_F16) return launch_mma_dim<__half>(a, s);
        return TAPER_CUDA_ERR_ARG;
    }

    TAPER_DISPATCH_DTYPE(dtype, scalar_t, {
        return fp8 ? launch_simple<scalar_t, uint8_t>(a, s)
                   : launch_simple<scalar_t, scalar_t>(a, s);
    });
    return TAPER_CUDA_ERR_ARG;  // not reached: the dispatch returns in every case
}

// Prefill attention, FlashAttention-2 style (variant 1 of taper_cuda_paged_attention_prefill;
// the contract and the reference kernel are in attention_prefill.cu): sm_80 mma.sync
// m16n8k16 on bf16/f16 with f32 accumulators, running unchanged on sm_90a.
//
// - GQA packing: a block serves one KV head and 64 "packed rows", row r = token * G + head in
//   the group (G = Hq / Hkv), so every K/V tile it loads feeds all G query heads that share it
//   (for Llama-3-8B, 16 tokens x 4 heads). Q rows are gathered per row; a row's position is its
//   token's.
// - Tiles: sequence b gets the block tiles [floor(qsl[b] G / 64) + b, floor(qsl[b+1] G / 64) +
//   b + 1), always at least ceil(q_len G / 64) of them, so the grid has floor(T G / 64) + B
//   tiles per KV head and needs no host-side tile list: a block finds its (sequence, tile) by a
//   binary search over that strictly increasing sequence, and the at most B surplus tiles exit
//   at once. Blocks are ordered KV head slowest and, within a head, the
//   longest-context tiles first: the blocks resident together read one head's K/V from L2, and
//   the short tiles fill the tail.
// - Keys: tiles of 64 aligned to multiples of 64 (whole cache blocks when BS divides 64),
//   gathered through the block table by cp.async (16 bytes per copy, zero-filled outside the
//   block's key range or for a block id outside [0, NB), so P (0) * V never meets stale NaNs)
//   into a two-stage shared-memory ring: tile i + 1 is in flight while tile i is computed. Tiles
//   past the block's last position are never loaded (causal), nor tiles before its first row's
//   sliding window.
// - Compute: each of 4 warps owns 16 packed rows; Q fragments are loaded once by ldmatrix and
//   kept in registers, K by ldmatrix and V by ldmatrix.trans (rows padded by 16 bytes: no bank
//   conflicts). S = Q K^T and O += P V run on mma.sync, the S accumulators become P's A
//   fragments in registers, and the online softmax (base-2 exponent, scale folded in) lives in
//   the accumulator registers. A warp skips a tile that none of its rows attends, and masks
//   only tiles that straddle its rows' causal diagonal, a window edge or the context's end.
//
// Shared memory: 2 stages x (K + V) x 64 keys x (D + 8) x 2 bytes = 36 KiB (D = 64) or 68 KiB
// (D = 128), Q staged in stage 1 before the loop; two blocks fit an SM on A100 and H100.
#include "attention_prefill_fa2.cuh"
#include "attention_prefill_schedule.cuh"
#include "mma.cuh"

namespace {

using namespace taper;

constexpr int FA_M = 64;               // packed query rows per block
constexpr int FA_N = 64;               // keys per tile
constexpr int FA_WARPS = FA_M / 16;    // one mma M (16 rows) per warp
constexpr int FA_THREADS = FA_WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;

template <int D>
constexpr int fa_smem_bytes() {
    return 2 * 2 * FA_N * (D + 8) * 2;  // stages x (K, V) x keys x padded row x 2 bytes
}

template <typename T, int D>
__global__ void __launch_bounds__(FA_THREADS, 2)
prefill_attention_fa2_kernel(T* __restrict__ out,                          // (T, Hq, D)
                             const T* __restrict__ q,                      // (T, Hq, D)
                             const T* __restrict__ k_cache,                // (NB, BS, Hkv, D)
                             const T* __restrict__ v_cache,                // (NB, BS, Hkv, D)
                             const int32_t* __restrict__ block_tables,     // (B, MB)
                             const int32_t* __restrict__ seq_lens,         // (B,)
                             const int32_t* __restrict__ query_start_loc,  // (B+1,)
                             int64_t num_tokens, int B, int Hq, int Hkv, int64_t NB, int BS,
                             int MB, float scale, int64_t window, float softcap) {
    constexpr int LD = D + 8;                       // padded shared row (elements)
    constexpr int CHUNKS = D / 8;                   // 16-byte chunks per row
    constexpr int ROWS_PER_PASS = FA_THREADS / CHUNKS;
    constexpr int TILE = FA_N * LD;                 // elements of one K or V tile
    static_assert(FA_M == FA_N, "Q is staged in one K tile's space");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* const smem = reinterpret_cast<T*>(smem_raw);  // stage s: K at 2 s TILE, V at (2 s + 1) TILE

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int G = Hq / Hkv;

    // ---- which (KV head, sequence, packed rows) this block owns, and its keys
    PrefillBlock sched;
    if (!prefill_block<FA_M, FA_N>(sched, block_tables, seq_lens, query_start_loc, num_tokens,
                                   B, G, Hkv, BS, MB, window))
        return;  // a surplus tile (block-uniform, before any barrier)
    const int kvh = sched.kvh;
    const int64_t r0 = sched.r0, r1 = sched.r1, pos_off = sched.pos_off;
    const int32_t* bt = sched.bt;
    const int64_t k_lo = sched.k_lo, k_hi = sched.k_hi, k_start = sched.k_start;
    const int n_kv = sched.n_kv;

    // ---- this warp's 16 rows and this lane's two (g and g + 8, "a" and "b")
    const int64_t w_r0 = r0 + warp * 16;
    const bool warp_active = w_r0 < r1;
    const int64_t w_r_last = min(w_r0 + 15, r1 - 1);
    const int64_t w_p_min = w_r0 / G + pos_off, w_p_max = w_r_last / G + pos_off;
    // Keys some row of the warp attends, and keys every row attends (no mask needed there).
    const int64_t w_k_min = window > 0 ? w_p_min - window + 1 : 0;
    const int64_t w_k_max = min(w_p_max, k_hi);
    const int64_t w_all_lo = window > 0 ? w_p_max - window + 1 : 0;
    const int64_t w_all_hi = min(w_p_min, k_hi);
    const int64_t ra = w_r0 + g, rb = ra + 8;
    const bool ok_a = ra < r1, ok_b = rb < r1;
    const int64_t p_a = ra / G + pos_off, p_b = rb / G + pos_off;
    const int64_t hi_a = min(p_a, k_hi), hi_b = min(p_b, k_hi);
    const int64_t lo_a = window > 0 ? p_a - window + 1 : 0;
    const int64_t lo_b = window > 0 ? p_b - window + 1 : 0;

    // ---- async loads: each thread copies one 16-byte column `part` of every ROWS_PER_PASS-th row
    const int part = tid % CHUNKS;
    auto load_kv = [&](int it, int stage) {
        const int64_t kt = k_start + (int64_t)it * FA_N;
        T* sK = smem + 2 * stage * TILE;
        T* sV = sK + TILE;
        for (int r = tid / CHUNKS; r < FA_N; r += ROWS_PER_PASS) {
            // Key positions in unsigned 32 bits (the launcher checked MB * BS < 2^31; j >= 0 in
            // the range): 64-bit divisions here would cost more instructions than the MMAs.
            const int64_t j = kt + r;
            int64_t off = 0;
            bool valid = false;
            if (j >= k_lo && j <= k_hi) {
                const unsigned ju = (unsigned)j, page = ju / (unsigned)BS, slot = ju % (unsigned)BS;
                const int32_t blk = bt[page];
                if (blk >= 0 && blk < NB) {
                    valid = true;
                    off = (((int64_t)blk * BS + slot) * Hkv + kvh) * D + part * 8;
                }
            }
            cp_async_16(smem_addr(sK + r * LD + part * 8), k_cache + off, valid);
            cp_async_16(smem_addr(sV + r * LD + part * 8), v_cache + off, valid);
        }
    };
    {
        T* sQ = smem + 2 * TILE;  // stage 1's K space, free until the loop's first prefetch
        for (int r = tid / CHUNKS; r < FA_M; r += ROWS_PER_PASS) {
            const int64_t pr = r0 + r;
            const bool valid = pr < r1;
            const T* src = q;
            if (valid) src = q + ((pr / G) * Hq + (int64_t)kvh * G + pr % G) * D + part * 8;
            cp_async_16(smem_addr(sQ + r * LD + part * 8), src, valid);
        }
    }
    if (n_kv > 0) load_kv(0, 0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // Q fragments (A operand) for the D / 16 k-steps of S = Q K^T: matrices (rows 0-7, cols
    // 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) = a0..a3.
    uint32_t qf[D / 16][4];
    {
        const T* sQ = smem + 2 * TILE;
        const int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            ldmatrix_x4(qf[kk], smem_addr(sQ + row * LD + kk * 16 + (lane >> 4) * 8));
    }
    __syncthreads();  // Q's space is stage 1, which the first iteration's prefetch overwrites

    // Scores in base 2: x = log2(e) * scale * s, or log2(e) * cap * tanh(scale * s / cap).
    const float x_scale = softcap > 0.f ? scale / softcap : scale * LOG2E;
    const float cap2 = softcap * LOG2E;

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY;  // running row maxima (quad-uniform, base 2)
    float l_a = 0.f, l_b = 0.f;              // running row sums, this lane's columns only

    for (int it = 0; it < n_kv; it++) {
        if (it + 1 < n_kv) load_kv(it + 1, (it + 1) & 1);
        cp_async_commit();  // possibly empty: wait_group counts stay uniform
        cp_async_wait<1>();  // tile it has landed (for this thread)...
        __syncthreads();     // ...and for every thread
        const int64_t kt = k_start + (int64_t)it * FA_N;
        if (warp_active && kt <= w_k_max && kt + FA_N - 1 >= w_k_min) {
            const T* sK = smem + 2 * (it & 1) * TILE;
            const T* sV = sK + TILE;

            // S = Q K^T, 16 rows x 64 keys in 8 n-tiles. ldmatrix on K rows (keys) gives lane l
            // key l / 4 and dims 2 (l % 4), +1: the B fragment; matrices i = 0..3 are dims
            // 8 i.. of a 32-dim slab, i.e. (b0, b1) of two k-steps.
            float s[FA_N / 8][4];
#pragma unroll
            for (int n = 0; n < FA_N / 8; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
                const T* kp = sK + (n * 8 + (lane & 7)) * LD + (lane >> 3) * 8;
#pragma unroll
                for (int k2 = 0; k2 < D / 32; k2++) {
                    uint32_t kb[4];
                    ldmatrix_x4(kb, smem_addr(kp + k2 * 32));
                    mma_16816(s[n], qf[2 * k2], kb[0], kb[1], (T*)nullptr);
                    mma_16816(s[n], qf[2 * k2 + 1], kb[2], kb[3], (T*)nullptr);
                }
            }

            // Scale (and soft-cap); mask only a tile not wholly inside every row's key range.
#pragma unroll
            for (int n = 0; n < FA_N / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[n][e] = softcap > 0.f ? cap2 * tanhf(s[n][e] * x_scale) : s[n][e] * x_scale;
            if (!(kt >= w_all_lo && kt + FA_N - 1 <= w_all_hi)) {
                // tile-relative [lo, hi] per row; an invalid row attends nothing
                const int ha = ok_a ? (int)max((int64_t)-1, min(hi_a - kt, (int64_t)FA_N - 1)) : -1;
                const int hb = ok_b ? (int)max((int64_t)-1, min(hi_b - kt, (int64_t)FA_N - 1)) : -1;
                const int la = (int)min((int64_t)FA_N, max((int64_t)0, lo_a - kt));
                const int lb = (int)min((int64_t)FA_N, max((int64_t)0, lo_b - kt));
#pragma unroll
                for (int n = 0; n < FA_N / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int jr = n * 8 + 2 * c + (e & 1);
                        const bool keep = e < 2 ? (jr >= la && jr <= ha) : (jr >= lb && jr <= hb);
                        if (!keep) s[n][e] = -INFINITY;
                    }
            }

            // Online softmax: a row's 64 columns are spread over the 4 lanes of a quad.
            float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
            for (int n = 0; n < FA_N / 8; n++) {
                mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
            }
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
            const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
            // While a row has seen no key its max is -inf: subtract 0 instead, so 2^x gives 0.
            const float base_a = mn_a == -INFINITY ? 0.f : mn_a;
            const float base_b = mn_b == -INFINITY ? 0.f : mn_b;
            const float alpha_a = fast_exp2(m_a - base_a), alpha_b = fast_exp2(m_b - base_b);
            m_a = mn_a;
            m_b = mn_b;
            float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
            for (int n = 0; n < FA_N / 8; n++) {
                s[n][0] = fast_exp2(s[n][0] - base_a);
                s[n][1] = fast_exp2(s[n][1] - base_a);
                s[n][2] = fast_exp2(s[n][2] - base_b);
                s[n][3] = fast_exp2(s[n][3] - base_b);
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

            // O += P V: 4 k-steps of 16 keys. S's C fragments of n-tiles 2 kk, 2 kk + 1 are P's
            // A fragment; ldmatrix.trans on V rows (keys) gives lane l keys 2 (l % 4), +1 of dim
            // l / 4: matrices (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, dims 8-15),
            // (keys 8-15, dims 8-15) = (b0, b1) of two 8-dim n-tiles.
#pragma unroll
            for (int kk = 0; kk < FA_N / 16; kk++) {
                uint32_t a[4];
                a[0] = pack_pair(s[2 * kk][0], s[2 * kk][1], (T*)nullptr);
                a[1] = pack_pair(s[2 * kk][2], s[2 * kk][3], (T*)nullptr);
                a[2] = pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], (T*)nullptr);
                a[3] = pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], (T*)nullptr);
                const T* vp = sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                              (lane >> 4) * 8;
#pragma unroll
                for (int n2 = 0; n2 < D / 16; n2++) {
                    uint32_t vb[4];
                    ldmatrix_x4_trans(vb, smem_addr(vp + n2 * 16));
                    mma_16816(o[2 * n2], a, vb[0], vb[1], (T*)nullptr);
                    mma_16816(o[2 * n2 + 1], a, vb[2], vb[3], (T*)nullptr);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    // Finish the row sums over the quad and write O / l (zeros for a row that saw no key).
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f;
    const float inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    T* oa = out + ((ra / G) * Hq + (int64_t)kvh * G + ra % G) * D;
    T* ob = out + ((rb / G) * Hq + (int64_t)kvh * G + rb % G) * D;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        const int col = n * 8 + 2 * c;
        if (ok_a) *(uint32_t*)(oa + col) = pack_pair(o[n][0] * inv_a, o[n][1] * inv_a, (T*)nullptr);
        if (ok_b) *(uint32_t*)(ob + col) = pack_pair(o[n][2] * inv_b, o[n][3] * inv_b, (T*)nullptr);
    }
}

template <typename T, int D>
int launch_fa2(void* out, const void* q, const void* k_cache, const void* v_cache,
               const int32_t* block_tables, const int32_t* seq_lens,
               const int32_t* query_start_loc, int64_t T_, int64_t B, int64_t Hq, int64_t Hkv,
               int64_t NB, int64_t BS, int64_t MB, float scale, int64_t sliding_window,
               float softcap, cudaStream_t stream) {
    // floor(T G / 64) + B tiles cover every sequence's packed rows (see the header), per KV head.
    const int64_t blocks = (T_ * (Hq / Hkv) / FA_M + B) * Hkv;
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    constexpr int smem = fa_smem_bytes<D>();
    // Above 48 KiB of dynamic shared memory a kernel must opt in, once per process (the engine
    // warms up before it captures graphs, so this never runs inside a capture).
    static const cudaError_t attr = [] {
        const cudaError_t e = cudaFuncSetAttribute(
            prefill_attention_fa2_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) cudaGetLastError();  // do not leave it for the next launcher's status
        return e;
    }();
    if (attr != cudaSuccess) return (int)attr;
    prefill_attention_fa2_kernel<T, D><<<(unsigned)blocks, FA_THREADS, smem, stream>>>(
        (T*)out, (const T*)q, (const T*)k_cache, (const T*)v_cache, block_tables, seq_lens,
        query_start_loc, T_, (int)B, (int)Hq, (int)Hkv, NB, (int)BS, (int)MB, scale,
        sliding_window, softcap);
    return launch_status();
}

template <typename T>
int launch_fa2_dim(void* out, const void* q, const void* k_cache, const void* v_cache,
                   const int32_t* block_tables, const int32_t* seq_lens,
                   const int32_t* query_start_loc, int64_t T_, int64_t B, int64_t Hq, int64_t Hkv,
                   int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                   int64_t sliding_window, float softcap, cudaStream_t stream) {
    // Only the two head sizes most models use get an instantiation (nvcc time in CI).
    if (D == 64)
        return launch_fa2<T, 64>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                 query_start_loc, T_, B, Hq, Hkv, NB, BS, MB, scale,
                                 sliding_window, softcap, stream);
    if (D == 128)
        return launch_fa2<T, 128>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                  query_start_loc, T_, B, Hq, Hkv, NB, BS, MB, scale,
                                  sliding_window, softcap, stream);
    return TAPER_CUDA_ERR_ARG;
}

bool aligned(const void* p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; }

}  // namespace

namespace taper {

int prefill_attention_fa2(void* out, const void* q, const void* k_cache, const void* v_cache,
                          const int32_t* block_tables, const int32_t* seq_lens,
                          const int32_t* query_start_loc, int64_t T, int64_t B, int64_t Hq,
                          int64_t Hkv, int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                          int64_t sliding_window, float softcap, int dtype, cudaStream_t stream) {
    // cp.async moves Q and K/V rows in 16-byte chunks (D a multiple of 8 keeps every row's
    // start aligned when the base is); the output is written in 32-bit pairs.
    if (!aligned(q, 16) || !aligned(k_cache, 16) || !aligned(v_cache, 16) || !aligned(out, 4))
        return TAPER_CUDA_ERR_ARG;
    if (MB * BS > INT32_MAX) return TAPER_CUDA_ERR_ARG;  // key positions are 32-bit in the kernel
    if (dtype == TAPER_DT_BF16)
        return launch_fa2_dim<__nv_bfloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                             query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB,
                                             scale, sliding_window, softcap, stream);
    if (dtype == TAPER_DT_F16)
        return launch_fa2_dim<__half>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB, scale,
                                      sliding_window, softcap, stream);
    return TAPER_CUDA_ERR_ARG;
}

}  // namespace taper

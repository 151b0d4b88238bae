// Prefill attention, FlashAttention-3 style for Hopper (variant 2 of
// taper_cuda_paged_attention_prefill; the contract and the reference kernel are in
// attention_prefill.cu): warp specialization, an mbarrier ring of K/V tiles and wgmma. Only the
// sm_90a compilation pass has a body; the launcher runs it on compute capability 9.0 only.
//
// The schedule is fa2's (attention_prefill_fa2.cu; tests/test_prefill_fa2_schedule.py replays
// it): a block serves one KV head and 64 packed rows (row = token * G + head in the group), the
// tiles of sequence b found by the same binary search, keys in tiles of 64 from the first row's
// window start to the last row's position (tiles past the causal diagonal never loaded), masks
// only on tiles that straddle a warp's causal diagonal, a window edge or the context's end.
//
// Block = two warpgroups:
// - warpgroup 0, the producer, gives its registers away (setmaxnreg.dec) and gathers K and V
//   tiles through the block table with cp.async (16 bytes per copy: the paged rows are scattered
//   and the 128-byte swizzle scatters each row's 16-byte chunks, which neither bulk copies nor a
//   tensor map over one page cover) into a ring of STAGES shared-memory stages. Stage s has a
//   "full" and an "empty" mbarrier (128 arrivals each): the producer waits for `empty` (the
//   consumers are done with the tile that was there), issues tile i, then completes tile i - 1
//   (cp.async.wait_group 1, fence.proxy.async so wgmma's async-proxy reads see the generic-proxy
//   writes, arrive on `full`), so one tile is always in flight behind the one being consumed.
// - warpgroup 1, the consumer (setmaxnreg.inc), holds 64 rows: Q is staged once in shared
//   memory; per tile, S = Q K^T is D / 16 wgmma m64n64k16 from shared memory (both K-major), the
//   scale / soft-cap / mask / online softmax run on the accumulator registers exactly as in fa2
//   (the wgmma accumulator layout is the mma.sync one per warp), P is packed to 16 bits in
//   registers and O += P V is 4 wgmma m64nDk16 with A from registers and V MN-major from shared
//   memory; then the consumers arrive on the stage's `empty` barrier.
// Shared-memory layout and descriptors: cuda/wgmma.cuh (checked by
// tests/test_prefill_fa3_layout.py). Shared memory: Q 64 x D + STAGES x (K + V) 64 x D, 16-bit,
// plus 1 KiB of alignment: 3 stages = 57 KiB at D = 64, 2 stages = 81 KiB at D = 128; two blocks
// per SM.
#include "attention_prefill_fa3.cuh"
#include "attention_prefill_schedule.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace {

using namespace taper;

constexpr int F3_M = 64;            // packed query rows per block (one wgmma M)
constexpr int F3_N = 64;            // keys per tile
constexpr int F3_THREADS = 256;     // producer warpgroup + consumer warpgroup
// (maybe_unused: only the sm_90a pass compiles the kernel body that uses them)
[[maybe_unused]] constexpr int F3_PRODUCER_REGS = 40;
[[maybe_unused]] constexpr int F3_CONSUMER_REGS = 216;  // 128 (40 + 216) = 32768: 2 blocks per SM
[[maybe_unused]] constexpr float LOG2E = 1.4426950408889634f;

template <int D>
constexpr int f3_stages() {
    return D == 64 ? 3 : 2;
}
template <int D>
constexpr int f3_tile_bytes() {
    return F3_N * D * 2;
}
template <int D>
constexpr int f3_smem_bytes() {
    // Q, the ring, 2 STAGES mbarriers; 1024 bytes of slack to align the base for the swizzle.
    return f3_tile_bytes<D>() * (1 + 2 * f3_stages<D>()) + 2 * f3_stages<D>() * 8 + 1024;
}

template <typename T, int D>
__global__ void __launch_bounds__(F3_THREADS, 2)
prefill_attention_fa3_kernel(T* __restrict__ out,                          // (T, Hq, D)
                             const T* __restrict__ q,                      // (T, Hq, D)
                             const T* __restrict__ k_cache,                // (NB, BS, Hkv, D)
                             const T* __restrict__ v_cache,                // (NB, BS, Hkv, D)
                             const int32_t* __restrict__ block_tables,     // (B, MB)
                             const int32_t* __restrict__ seq_lens,         // (B,)
                             const int32_t* __restrict__ query_start_loc,  // (B+1,)
                             int64_t num_tokens, int B, int Hq, int Hkv, int64_t NB, int BS,
                             int MB, float scale, int64_t window, float softcap) {
#if TAPER_SM90A
    constexpr int STAGES = f3_stages<D>();
    constexpr int TILE = f3_tile_bytes<D>();
    constexpr int CHUNKS = D / 8;                  // 16-byte chunks per row
    constexpr int ROWS_PER_PASS = 128 / CHUNKS;    // rows one warpgroup copies per pass
    static_assert(F3_M == F3_N, "Q and K/V tiles share the layout's row count");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Stage s: K at base + (1 + 2 s) TILE, V at base + (2 + 2 s) TILE; Q at base.
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = base;
    const uint32_t bars = base + (1 + 2 * STAGES) * TILE;  // full[s] at 8 s, empty[s] after
    auto sK = [&](int s) { return base + (uint32_t)((1 + 2 * s) * TILE); };
    auto sV = [&](int s) { return base + (uint32_t)((2 + 2 * s) * TILE); };
    auto full = [&](int s) { return bars + 8u * s; };
    auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

    const int G = Hq / Hkv;

    // ---- which (KV head, sequence, packed rows) this block owns, and its keys: fa2's schedule
    PrefillBlock sched;
    if (!prefill_block<F3_M, F3_N>(sched, block_tables, seq_lens, query_start_loc, num_tokens,
                                   B, G, Hkv, BS, MB, window))
        return;  // a surplus tile (block-uniform, before any barrier)
    const int kvh = sched.kvh;
    const int64_t r0 = sched.r0, r1 = sched.r1, pos_off = sched.pos_off;
    const int32_t* bt = sched.bt;
    const int64_t k_lo = sched.k_lo, k_hi = sched.k_hi, k_start = sched.k_start;
    const int n_kv = sched.n_kv;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full(s), 128);
            mbar_init(empty(s), 128);
        }
        mbar_init_fence();
    }
    __syncthreads();  // the last block-wide barrier: the warpgroups part ways here

    const int wg_tid = threadIdx.x & 127;
    const int part = wg_tid % CHUNKS;
    if (threadIdx.x < 128) {
        // ================= producer warpgroup
        setmaxnreg_dec<F3_PRODUCER_REGS>();
        for (int it = 0; it <= n_kv; it++) {
            if (it < n_kv) {
                const int s = it % STAGES;
                if (it >= STAGES) mbar_wait(empty(s), (uint32_t)((it / STAGES - 1) & 1));
                const int64_t kt = k_start + (int64_t)it * F3_N;
                for (int r = wg_tid / CHUNKS; r < F3_N; r += ROWS_PER_PASS) {
                    // key positions in unsigned 32 bits (the launcher checked MB * BS < 2^31)
                    const int64_t j = kt + r;
                    int64_t off = 0;
                    bool valid = false;
                    if (j >= k_lo && j <= k_hi) {
                        const unsigned ju = (unsigned)j, page = ju / (unsigned)BS,
                                       slot = ju % (unsigned)BS;
                        const int32_t blk = bt[page];
                        if (blk >= 0 && blk < NB) {
                            valid = true;
                            off = (((int64_t)blk * BS + slot) * Hkv + kvh) * D + part * 8;
                        }
                    }
                    // zero-filled outside the range: P (0) * V never meets stale NaNs
                    const uint32_t dst = fa3_tile_offset(F3_N, r, part * 8);
                    cp_async_16(sK(s) + dst, k_cache + off, valid);
                    cp_async_16(sV(s) + dst, v_cache + off, valid);
                }
            }
            cp_async_commit();  // possibly empty: the group count stays uniform
            if (it >= 1) {
                cp_async_wait<1>();    // tile it - 1 has landed (this thread's copies)...
                fence_proxy_async();   // ...is visible to wgmma...
                mbar_arrive(full((it - 1) % STAGES));  // ...and is announced
            }
        }
        return;
    }

    // ================= consumer warpgroup: 64 rows, warp w holds rows 16 w .. 16 w + 15
    setmaxnreg_inc<F3_CONSUMER_REGS>();
    const int lane = wg_tid & 31, warp = wg_tid >> 5;
    const int g = lane >> 2, c = lane & 3;

    // Q, gathered row by row (packed row pr = token pr / G, head kvh G + pr % G); rows past r1
    // are zeros.
    for (int r = wg_tid / CHUNKS; r < F3_M; r += ROWS_PER_PASS) {
        const int64_t pr = r0 + r;
        const bool valid = pr < r1;
        const T* src = q;
        if (valid) src = q + ((pr / G) * Hq + (int64_t)kvh * G + pr % G) * D + part * 8;
        cp_async_16(sQ + fa3_tile_offset(F3_M, r, part * 8), src, valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    asm volatile("bar.sync 1, 128;\n" ::: "memory");  // every consumer's Q rows have landed

    // this warp's rows and this lane's two (g and g + 8, "a" and "b"), as in fa2
    const int64_t w_r0 = r0 + warp * 16;
    const bool warp_active = w_r0 < r1;
    const int64_t w_r_last = min(w_r0 + 15, r1 - 1);
    const int64_t w_p_min = w_r0 / G + pos_off, w_p_max = w_r_last / G + pos_off;
    const int64_t w_all_lo = window > 0 ? w_p_max - window + 1 : 0;
    const int64_t w_all_hi = min(w_p_min, k_hi);
    const int64_t ra = w_r0 + g, rb = ra + 8;
    const bool ok_a = ra < r1, ok_b = rb < r1;
    const int64_t p_a = ra / G + pos_off, p_b = rb / G + pos_off;
    const int64_t hi_a = min(p_a, k_hi), hi_b = min(p_b, k_hi);
    const int64_t lo_a = window > 0 ? p_a - window + 1 : 0;
    const int64_t lo_b = window > 0 ? p_b - window + 1 : 0;

    const float x_scale = softcap > 0.f ? scale / softcap : scale * LOG2E;
    const float cap2 = softcap * LOG2E;

    float o[D / 2];  // O accumulators: o[4 n + e] as fa2's o[n][e]
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY;
    float l_a = 0.f, l_b = 0.f;

    for (int it = 0; it < n_kv; it++) {
        const int stage = it % STAGES;
        mbar_wait(full(stage), (uint32_t)((it / STAGES) & 1));
        const int64_t kt = k_start + (int64_t)it * F3_N;

        // S = Q K^T: k-slice kk of both operands starts at column block kk / 4, byte 32 (kk % 4).
        float s[F3_N / 2];
#pragma unroll
        for (int i = 0; i < F3_N / 2; i++) s[i] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const uint32_t koff = (kk / 4) * F3_M * 128 + (kk % 4) * 32;
            wgmma_ss_n64(s, wgmma_desc(sQ + koff, 16, 1024), wgmma_desc(sK(stage) + koff, 16, 1024),
                         (T*)nullptr);
        }
        wgmma_commit();
        wgmma_wait<0>(s);

#pragma unroll
        for (int i = 0; i < F3_N / 2; i++)
            s[i] = softcap > 0.f ? cap2 * tanhf(s[i] * x_scale) : s[i] * x_scale;
        // Mask unless every row of the warp attends every key of the tile (an idle warp's rows
        // attend nothing; it still takes part in the warpgroup's wgmmas).
        if (!(warp_active && kt >= w_all_lo && kt + F3_N - 1 <= w_all_hi)) {
            const int ha = ok_a ? (int)max((int64_t)-1, min(hi_a - kt, (int64_t)F3_N - 1)) : -1;
            const int hb = ok_b ? (int)max((int64_t)-1, min(hi_b - kt, (int64_t)F3_N - 1)) : -1;
            const int la = (int)min((int64_t)F3_N, max((int64_t)0, lo_a - kt));
            const int lb = (int)min((int64_t)F3_N, max((int64_t)0, lo_b - kt));
#pragma unroll
            for (int n = 0; n < F3_N / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int jr = n * 8 + 2 * c + (e & 1);
                    const bool keep = e < 2 ? (jr >= la && jr <= ha) : (jr >= lb && jr <= hb);
                    if (!keep) s[4 * n + e] = -INFINITY;
                }
        }

        // Online softmax (base 2): a row's 64 columns are spread over the 4 lanes of a quad.
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int n = 0; n < F3_N / 8; n++) {
            mx_a = fmaxf(mx_a, fmaxf(s[4 * n], s[4 * n + 1]));
            mx_b = fmaxf(mx_b, fmaxf(s[4 * n + 2], s[4 * n + 3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        const float base_a = mn_a == -INFINITY ? 0.f : mn_a;  // no key yet: 2^-inf = 0
        const float base_b = mn_b == -INFINITY ? 0.f : mn_b;
        const float alpha_a = fast_exp2(m_a - base_a), alpha_b = fast_exp2(m_b - base_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int n = 0; n < F3_N / 8; n++) {
            s[4 * n] = fast_exp2(s[4 * n] - base_a);
            s[4 * n + 1] = fast_exp2(s[4 * n + 1] - base_a);
            s[4 * n + 2] = fast_exp2(s[4 * n + 2] - base_b);
            s[4 * n + 3] = fast_exp2(s[4 * n + 3] - base_b);
            sum_a += s[4 * n] + s[4 * n + 1];
            sum_b += s[4 * n + 2] + s[4 * n + 3];
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[4 * n] *= alpha_a;
            o[4 * n + 1] *= alpha_a;
            o[4 * n + 2] *= alpha_b;
            o[4 * n + 3] *= alpha_b;
        }

        // O += P V: k-slice kk (keys 16 kk ..) takes S's column groups 2 kk, 2 kk + 1 as its A
        // fragment, and V's rows 16 kk .. (MN-major: LBO = the next 64 dims, SBO = 8 keys).
        uint32_t pa[F3_N / 16][4];
#pragma unroll
        for (int kk = 0; kk < F3_N / 16; kk++) {
            pa[kk][0] = pack_pair(s[8 * kk], s[8 * kk + 1], (T*)nullptr);
            pa[kk][1] = pack_pair(s[8 * kk + 2], s[8 * kk + 3], (T*)nullptr);
            pa[kk][2] = pack_pair(s[8 * kk + 4], s[8 * kk + 5], (T*)nullptr);
            pa[kk][3] = pack_pair(s[8 * kk + 6], s[8 * kk + 7], (T*)nullptr);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < F3_N / 16; kk++) {
            const uint64_t vd = wgmma_desc(sV(stage) + kk * 16 * 128, F3_N * 128, 1024);
            if constexpr (D == 64) wgmma_rs_n64(o, pa[kk], vd, (T*)nullptr);
            else wgmma_rs_n128(o, pa[kk], vd, (T*)nullptr);
        }
        wgmma_commit();
        wgmma_wait<0>(o);
        mbar_arrive(empty(stage));  // this stage's operands have been read
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
        if (ok_a)
            *(uint32_t*)(oa + col) = pack_pair(o[4 * n] * inv_a, o[4 * n + 1] * inv_a, (T*)nullptr);
        if (ok_b)
            *(uint32_t*)(ob + col) =
                pack_pair(o[4 * n + 2] * inv_b, o[4 * n + 3] * inv_b, (T*)nullptr);
    }
#else
    __trap();  // not an sm_90a build: the launcher never gets here
#endif
}

template <typename T, int D>
int launch_fa3(void* out, const void* q, const void* k_cache, const void* v_cache,
               const int32_t* block_tables, const int32_t* seq_lens,
               const int32_t* query_start_loc, int64_t T_, int64_t B, int64_t Hq, int64_t Hkv,
               int64_t NB, int64_t BS, int64_t MB, float scale, int64_t sliding_window,
               float softcap, cudaStream_t stream) {
    const int64_t blocks = (T_ * (Hq / Hkv) / F3_M + B) * Hkv;  // fa2's grid
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    constexpr int smem = f3_smem_bytes<D>();
    static const cudaError_t attr = [] {
        const cudaError_t e = cudaFuncSetAttribute(
            prefill_attention_fa3_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) cudaGetLastError();
        return e;
    }();
    if (attr != cudaSuccess) return (int)attr;
    prefill_attention_fa3_kernel<T, D><<<(unsigned)blocks, F3_THREADS, smem, stream>>>(
        (T*)out, (const T*)q, (const T*)k_cache, (const T*)v_cache, block_tables, seq_lens,
        query_start_loc, T_, (int)B, (int)Hq, (int)Hkv, NB, (int)BS, (int)MB, scale,
        sliding_window, softcap);
    return launch_status();
}

template <typename T>
int launch_fa3_dim(void* out, const void* q, const void* k_cache, const void* v_cache,
                   const int32_t* block_tables, const int32_t* seq_lens,
                   const int32_t* query_start_loc, int64_t T_, int64_t B, int64_t Hq, int64_t Hkv,
                   int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                   int64_t sliding_window, float softcap, cudaStream_t stream) {
    if (D == 64)
        return launch_fa3<T, 64>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                 query_start_loc, T_, B, Hq, Hkv, NB, BS, MB, scale,
                                 sliding_window, softcap, stream);
    if (D == 128)
        return launch_fa3<T, 128>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                  query_start_loc, T_, B, Hq, Hkv, NB, BS, MB, scale,
                                  sliding_window, softcap, stream);
    return TAPER_CUDA_ERR_ARG;
}

bool aligned(const void* p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; }

// 1 in the sm_90a code only: an sm_90 device given a build without 90a in TAPER_CUDA_ARCHS
// would run the trapping stub.
__device__ const int fa3_kernel_built = TAPER_SM90A;

// Compute capability 9.0 (H100, H200: the devices sm_90a code runs on), and the code loaded
// for it is the sm_90a build. The symbol is read once per process (a synchronous copy: the
// engine's warm-up gets here before it captures graphs), the device asked on every call.
bool fa3_runs_here() {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    if (major != 9 || minor != 0) return false;
    static const bool built = [] {
        int v = 0;
        if (cudaMemcpyFromSymbol(&v, fa3_kernel_built, sizeof v) != cudaSuccess) {
            cudaGetLastError();
            return false;
        }
        return v == 1;
    }();
    return built;
}

}  // namespace

namespace taper {

int prefill_attention_fa3(void* out, const void* q, const void* k_cache, const void* v_cache,
                          const int32_t* block_tables, const int32_t* seq_lens,
                          const int32_t* query_start_loc, int64_t T, int64_t B, int64_t Hq,
                          int64_t Hkv, int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale,
                          int64_t sliding_window, float softcap, int dtype, cudaStream_t stream) {
    if (!fa3_runs_here()) return TAPER_CUDA_ERR_ARG;
    if (!aligned(q, 16) || !aligned(k_cache, 16) || !aligned(v_cache, 16) || !aligned(out, 4))
        return TAPER_CUDA_ERR_ARG;
    if (MB * BS > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (dtype == TAPER_DT_BF16)
        return launch_fa3_dim<__nv_bfloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                             query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB,
                                             scale, sliding_window, softcap, stream);
    if (dtype == TAPER_DT_F16)
        return launch_fa3_dim<__half>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB, scale,
                                      sliding_window, softcap, stream);
    return TAPER_CUDA_ERR_ARG;
}

}  // namespace taper

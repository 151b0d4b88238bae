// Paged attention for decode: one query row per sequence (T == B) against the paged KV cache
// (NB, BS, Hkv, D). Query b sits at position p = seq_lens[b] - 1 and attends keys
// j in [max(0, p - sliding_window + 1), p] (window 0: all), key j living at cache slot
// block_tables[b, j / BS] * BS + j % BS; query head h reads KV head h / G, G = Hq / Hkv.
// score = scale * q.k, soft-capped (cap * tanh(score / cap)) when softcap > 0; softmax in float.
// An FP8 cache reads back decode(code) * k_scale[kv head] (v_scale for V).
//
// The trick (GQA): one thread block per (sequence, KV head[, partition]) serves all G query heads
// of the group, so every K and V row of the context is read from memory once, not G times. Keys
// go in tiles of 32 (one per lane). The block copies a tile's K and V rows into shared memory with
// 16-byte cp.async, double-buffered (the next tile streams in while this one is computed), then:
//  1. scores: a warp per (quad of query heads, slice of D), lane = key: the lane's K row times
//     the quad's 4 query rows (held in shared memory as float; all lanes read the same q address,
//     a broadcast); the D slices' partial dot products meet in shared memory;
//  2. online softmax: a warp per query head, lane = key: the tile's max, the rescale factor of
//     the running output, the probabilities (base 2, scores pre-multiplied by log2(e));
//  3. P V: each thread owns 4 heads x 8 output dims (32 float registers) over a slice of the
//     tile's keys, rescaled once per tile; the key slices are summed in shared memory at the end.
// Working on quads of heads with zero-padded q rows keeps G a run-time value (any G <= 16, no
// per-G template instances) while every K/V element read from shared memory feeds 4 FMAs.
//
// Split-K (num_splits > 1): partition s of a sequence's keys [lo, hi] is the key range
// [lo + s * chunk, lo + (s + 1) * chunk), chunk = ceil((hi - lo + 1) / num_splits) rounded up to a
// multiple of BS; each writes its unnormalised output, max and sum per (sequence, query head) to
// the workspace and a second kernel merges them (log-sum-exp). An empty partition writes
// (0, -inf, 0); a row with no keys at all (seq_lens[b] <= 0) comes out as zeros.
// The host picks the count (flash-decoding: enough partitions to fill every SM's resident
// block slots when B * Hkv alone cannot; pyx/decode_splits.py).
//
// A device kernel cannot report per-row errors, so instead of rejecting the call as the CPU op
// does it stays in bounds: a context longer than MB * BS is cut to MB * BS keys, and a block id
// outside [0, NB) reads as a zero K/V row.
#include "common.cuh"

#include <type_traits>

namespace {

// 4 warps per block: one per head quad / D slice in the score phase, enough threads to give each
// its 4 x 8 outputs in the P V phase, and small enough that 4 blocks share an SM.
constexpr int kThreads = 128;
constexpr int kMinBlocks = 4;     // blocks per SM for __launch_bounds__: at most 128 registers
constexpr int kTile = 32;         // keys per tile: one per lane in the score and softmax phases
constexpr int kMaxGroup = 16;     // query heads per KV head
constexpr int kMaxSplits = 64;    // partitions per sequence (the merge keeps their weights in smem)
constexpr float kLog2e = 1.4426950408889634f;

// Shapes derived from (D, G, cache element size), shared by the kernel and its launcher.
struct Layout {
    int nch;     // D / 8: 8-element chunks per row
    int hq4;     // quads of query heads, ceil(G / 4)
    int gp;      // 4 * hq4: G padded with zero query rows
    int dp;      // score phase: D slices per key (warps per quad), 4 / hq4 rounded down to 2^k
    int kp;      // P V phase: key slices, 128 / (hq4 * nch) >= 1
    int row;     // bytes of one K or V row in a tile
    int tiles;   // bytes of the K/V tiles, also holding the final (kp, gp, D) reduction
    int q_off, spart_off, p_off, stat_off, total;  // byte offsets into dynamic smem, its size
};

__host__ __device__ inline Layout make_layout(int D, int G, int cache_esize, int stages) {
    Layout L;
    L.nch = D / 8;
    L.hq4 = (G + 3) / 4;
    L.gp = 4 * L.hq4;
    L.dp = L.hq4 == 1 ? 4 : L.hq4 == 2 ? 2 : 1;
    L.kp = kThreads / (L.hq4 * L.nch);
    // Rows padded to an odd number of 16-byte units: in the score phase the 8 lanes of a
    // quarter-warp read the same column of 8 consecutive rows, which then fall in 8 different
    // bank groups (a 16-byte shared load is served a quarter-warp at a time).
    int units = (D * cache_esize + 15) / 16;
    if (units % 2 == 0) units += 1;
    L.row = units * 16;
    const int tiles = stages * 2 * kTile * L.row;
    const int red = L.kp * L.gp * D * (int)sizeof(float);
    L.tiles = tiles > red ? tiles : red;
    L.q_off = L.tiles;
    L.spart_off = L.q_off + L.gp * D * (int)sizeof(float);
    L.p_off = L.spart_off + L.dp * kTile * L.gp * (int)sizeof(float);
    L.stat_off = L.p_off + kTile * L.gp * (int)sizeof(float);
    L.total = L.stat_off + 3 * kMaxGroup * (int)sizeof(float);
    return L;
}

// An f32 cache gets one tile buffer, not two: its 4-byte rows would push the double-buffered
// D = 256, G = 16 case past the 99 KB of shared memory that sm86/sm89 give a block.
template <typename CT> __host__ __device__ constexpr int stages_for() { return sizeof(CT) == 4 ? 1 : 2; }

// ---- asynchronous copies (sm80+): global -> shared without registers, zero-filled past
// src_bytes (0 for keys outside the partition and for block ids outside the cache)

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- kernels

// One block per (sequence b, KV head kvh) and partition (blockIdx.y). T: q/out type; CT: cache
// element type (T, or uint8_t for FP8); kD: head size, 0 for the run-time loop over D.
// nsplit == 1 writes out; nsplit > 1 writes partials to ws: o (B, Hq, nsplit, D), then
// m (B, Hq, nsplit) (base-2 max of scaled scores), then l (B, Hq, nsplit).
// 4 resident blocks (16 warps) per SM keep several tiles of cp.async in flight per SM, more
// than the ~15 KB that Little's law asks of an H100 SM (3.35 TB/s over 132 SMs, ~1 us latency);
// the cap of 128 registers this implies costs no spills for bf16/f16/FP8 caches at the compiled
// head sizes (the f32 test path and the run-time-D loop spill a few bytes).
template <typename T, typename CT, int kD>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    decode_kernel(T* __restrict__ out,                        // (B, Hq, D)
                  float* __restrict__ ws,                     // partials (see above), nsplit > 1
                  const T* __restrict__ q,                    // (B, Hq, D)
                  const CT* __restrict__ k_cache,             // (NB, BS, Hkv, D)
                  const CT* __restrict__ v_cache,             // (NB, BS, Hkv, D)
                  const float* __restrict__ k_scale,          // (Hkv,) FP8 only
                  const float* __restrict__ v_scale,          // (Hkv,) FP8 only
                  const int32_t* __restrict__ block_tables,   // (B, MB)
                  const int32_t* __restrict__ seq_lens,       // (B,)
                  int B, int Hq, int Hkv, int D_rt, int64_t NB, int BS, int MB, float scale,
                  int window, float softcap, int nsplit) {
    constexpr bool kFp8 = std::is_same<CT, uint8_t>::value;
    constexpr int kStages = stages_for<CT>();
    const int D = kD ? kD : D_rt;
    const int G = Hq / Hkv;
    const Layout L = make_layout(D, G, (int)sizeof(CT), kStages);

    extern __shared__ __align__(16) uint8_t smem[];
    float* q_s = reinterpret_cast<float*>(smem + L.q_off);          // (gp, D)
    float* spart = reinterpret_cast<float*>(smem + L.spart_off);    // (dp, kTile, gp)
    float* p_s = reinterpret_cast<float*>(smem + L.p_off);          // (kTile, gp)
    float* alpha_s = reinterpret_cast<float*>(smem + L.stat_off);   // (kMaxGroup,)
    float* m_s = alpha_s + kMaxGroup;                               // (kMaxGroup,)
    float* l_s = m_s + kMaxGroup;                                   // (kMaxGroup,)
    float* o_red = reinterpret_cast<float*>(smem);  // (kp, gp, D), over the tiles after the loop

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x / Hkv, kvh = blockIdx.x % Hkv, split = blockIdx.y;
    const int h0 = kvh * G;

    // This block's keys [start, end).
    const int sl = seq_lens[b];
    int64_t start = 0, end = 0;
    if (sl > 0) {
        const int p = sl - 1;
        const int hi = min(p, MB * BS - 1);
        const int lo = window > 0 ? max(0, p - window + 1) : 0;
        const int64_t n = max(0, hi - lo + 1);
        start = lo;
        end = lo + n;
        if (nsplit > 1) {
            const int64_t chunk = ((n + nsplit - 1) / nsplit + BS - 1) / BS * BS;
            start = min(lo + split * chunk, end);
            end = min(start + chunk, end);
        }
    }
    const int ntiles = (int)((end - start + kTile - 1) / kTile);

    // The group's query rows as float, zero rows for the padding heads; padding heads also keep
    // probability 0 and rescale factor 1 (nothing below writes them).
    for (int i = tid; i < L.gp * D; i += kThreads) {
        const int g = i / D, d = i - g * D;
        q_s[i] = g < G ? taper::to_float(q[((int64_t)b * Hq + h0 + g) * D + d]) : 0.f;
    }
    for (int i = tid; i < kTile * L.gp; i += kThreads)
        if (i % L.gp >= G) p_s[i] = 0.f;
    if (tid < kMaxGroup) alpha_s[tid] = 1.f;

    const float qk_scale = kFp8 ? scale * k_scale[kvh] : scale;
    const int32_t* bt = block_tables + (int64_t)b * MB;
    const int64_t slot_bytes = (int64_t)Hkv * D * (int64_t)sizeof(CT);  // one cache slot
    const int row_bytes = D * (int)sizeof(CT);
    const uint8_t* kc = reinterpret_cast<const uint8_t*>(k_cache) + (int64_t)kvh * row_bytes;
    const uint8_t* vc = reinterpret_cast<const uint8_t*>(v_cache) + (int64_t)kvh * row_bytes;

    // Starts the copy of tile t into buffer `stage`: K rows, then V rows, each L.row apart.
    auto issue = [&](int t, int stage) {
        uint8_t* kd = smem + stage * 2 * kTile * L.row;
        uint8_t* vd = kd + kTile * L.row;
        const int64_t j0 = start + (int64_t)t * kTile;
        if (row_bytes % 16 == 0) {
            const int nu = row_bytes / 16;
#pragma unroll 2
            for (int i = tid; i < kTile * nu; i += kThreads) {
                const int kk = i / nu, u = i - kk * nu;
                const int j = (int)(j0 + kk);
                int64_t off = 0;
                int bytes = 0;
                if (j0 + kk < end) {
                    const int blk = bt[j / BS];
                    if (blk >= 0 && blk < NB) {
                        off = ((int64_t)blk * BS + j % BS) * slot_bytes + u * 16;
                        bytes = 16;
                    }
                }
                cp_async16(kd + kk * L.row + u * 16, kc + off, bytes);
                cp_async16(vd + kk * L.row + u * 16, vc + off, bytes);
            }
        } else {  // only an FP8 cache with D % 16 == 8 (generic head sizes)
            const int nu = row_bytes / 8;
#pragma unroll 2
            for (int i = tid; i < kTile * nu; i += kThreads) {
                const int kk = i / nu, u = i - kk * nu;
                const int j = (int)(j0 + kk);
                int64_t off = 0;
                int bytes = 0;
                if (j0 + kk < end) {
                    const int blk = bt[j / BS];
                    if (blk >= 0 && blk < NB) {
                        off = ((int64_t)blk * BS + j % BS) * slot_bytes + u * 8;
                        bytes = 8;
                    }
                }
                cp_async8(kd + kk * L.row + u * 8, kc + off, bytes);
                cp_async8(vd + kk * L.row + u * 8, vc + off, bytes);
            }
        }
        cp_async_commit();
    };

    // Score phase roles: warp = (D slice sdp, head quad shq), lane = key.
    const int sdp = warp % L.dp, shq = warp / L.dp;
    // P V roles: chunk pc of D, head quad phq, key slice pkp.
    const int pc = tid % L.nch, phq = tid / L.nch % L.hq4, pkp = tid / L.nch / L.hq4;
    const bool pv_on = pkp < L.kp;
    float o[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int e = 0; e < 8; e++) o[i][e] = 0.f;
    // Softmax state of the heads warp + 4 i, the same in every lane of the warp.
    float m_run[4], l_run[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m_run[i] = -INFINITY;
        l_run[i] = 0.f;
    }

    if (kStages == 2 && ntiles > 0) issue(0, 0);
    for (int t = 0; t < ntiles; t++) {
        const int stage = kStages == 2 ? t & 1 : 0;
        if (kStages == 1) {
            if (t > 0) __syncthreads();  // the previous tile's P V is done with the buffer
            issue(t, 0);
        }
        cp_async_wait_all();
        __syncthreads();  // tile t is in smem for every thread; tile t - 1 is fully consumed
        if (kStages == 2 && t + 1 < ntiles) issue(t + 1, stage ^ 1);
        const CT* kt = reinterpret_cast<const CT*>(smem + stage * 2 * kTile * L.row);
        const CT* vt = reinterpret_cast<const CT*>(smem + stage * 2 * kTile * L.row +
                                                   kTile * L.row);
        const int row_el = L.row / (int)sizeof(CT);  // tile row stride in elements
        const int64_t j0 = start + (int64_t)t * kTile;

        // 1. partial scores of key `lane` for the 4 heads of quad shq over D slice sdp
        if (shq < L.hq4) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            const CT* krow = kt + lane * row_el;
#pragma unroll 2
            for (int c = sdp; c < L.nch; c += L.dp) {
                float kf[8];
                taper::load8(krow + 8 * c, kf);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float4* qp = reinterpret_cast<const float4*>(q_s + (4 * shq + i) * D + 8 * c);
                    const float4 a = qp[0], bq = qp[1];
                    acc[i] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] +
                              bq.x * kf[4] + bq.y * kf[5] + bq.z * kf[6] + bq.w * kf[7];
                }
            }
            *reinterpret_cast<float4*>(spart + (sdp * kTile + lane) * L.gp + 4 * shq) =
                make_float4(acc[0], acc[1], acc[2], acc[3]);
        }
        __syncthreads();

        // 2. online softmax of head g = warp + 4 i over the tile's keys (lane = key)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int g = warp + 4 * i;
            if (g >= G) break;  // warp-uniform
            float s = -INFINITY;
            if (j0 + lane < end) {
                float raw = 0.f;
                for (int d = 0; d < L.dp; d++) raw += spart[(d * kTile + lane) * L.gp + g];
                s = raw * qk_scale;
                if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                s *= kLog2e;
            }
            const float mn = fmaxf(m_run[i], taper::warp_max(s));
            const float alpha = mn == -INFINITY ? 1.f : exp2f(m_run[i] - mn);
            const float pr = s == -INFINITY ? 0.f : exp2f(s - mn);
            l_run[i] = l_run[i] * alpha + taper::warp_sum(pr);
            m_run[i] = mn;
            p_s[lane * L.gp + g] = pr;
            if (lane == 0) alpha_s[g] = alpha;
        }
        __syncthreads();

        // 3. o = o * alpha + P V over keys pkp, pkp + kp, ... of the tile (keys past the end
        // have probability 0 and zero-filled rows)
        if (pv_on) {
            const float4 al = *reinterpret_cast<const float4*>(alpha_s + 4 * phq);
            const float a4[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int e = 0; e < 8; e++) o[i][e] *= a4[i];
#pragma unroll 2
            for (int kk = pkp; kk < kTile; kk += L.kp) {
                const float4 p4 = *reinterpret_cast<const float4*>(p_s + kk * L.gp + 4 * phq);
                const float pw[4] = {p4.x, p4.y, p4.z, p4.w};
                float vf[8];
                taper::load8(vt + kk * row_el + 8 * pc, vf);
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int e = 0; e < 8; e++) o[i][e] += pw[i] * vf[e];
            }
        }
    }

    // Sum the key slices and write. No copy is in flight here (the last tile was waited for).
    __syncthreads();  // every thread is done with the tiles, which o_red overlays
    if (pv_on) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4* dst = reinterpret_cast<float4*>(o_red + (pkp * L.gp + 4 * phq + i) * D + 8 * pc);
            dst[0] = make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
            dst[1] = make_float4(o[i][4], o[i][5], o[i][6], o[i][7]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int g = warp + 4 * i;
        if (g < G && lane == 0) {
            m_s[g] = m_run[i];
            l_s[g] = l_run[i];
        }
    }
    __syncthreads();
    const float v_mul = kFp8 ? v_scale[kvh] : 1.f;
    const int64_t rows = (int64_t)B * Hq;
    for (int i = tid; i < G * D; i += kThreads) {
        const int g = i / D, d = i - g * D;
        float acc = 0.f;
        for (int r = 0; r < L.kp; r++) acc += o_red[(r * L.gp + g) * D + d];
        acc *= v_mul;
        const int64_t row = (int64_t)b * Hq + h0 + g;
        if (nsplit == 1) {
            const float l = l_s[g];
            out[row * D + d] = taper::from_float<T>(l > 0.f ? acc / l : 0.f);
        } else {
            const int64_t part = row * nsplit + split;
            ws[part * D + d] = acc;
            if (d == 0) {
                ws[rows * nsplit * D + part] = m_s[g];
                ws[rows * nsplit * (D + 1) + part] = l_s[g];
            }
        }
    }
}

// Merges the nsplit partitions of each (sequence, query head): a block per row of out,
// out = sum_s w_s o_s / sum_s w_s l_s with w_s = 2^(m_s - max m). Rows whose partitions are all
// empty (no keys) come out as zeros. At batch 1 there are only Hq rows but up to 64 partitions
// each, so the partitions of a row are spread over the block too: thread (g, c) sums float4
// column c of partitions g, g + groups, ... (loads unrolled, several in flight per thread), and
// the groups meet in shared memory. A warp per row walking its partitions one after another
// would leave a batch-1 step waiting on ~64 dependent rounds of L2 latency.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(T* __restrict__ out,           // (B, Hq, D)
                 const float* __restrict__ ws,  // o (B, Hq, nsplit, D), m, l (B, Hq, nsplit)
                 int64_t rows, int D, int nsplit) {
    __shared__ float w_s[kMaxSplits];
    __shared__ float inv_s;
    __shared__ float4 red[kThreads];
    const int tid = threadIdx.x;
    const int64_t row = blockIdx.x;
    const float* o = ws + row * nsplit * D;
    const float* m = ws + rows * nsplit * D + row * nsplit;
    const float* l = ws + rows * nsplit * (D + 1) + row * nsplit;
    if (tid < 32) {  // the partitions' weights (kMaxSplits = 64: two per lane)
        const float m0 = tid < nsplit ? m[tid] : -INFINITY;
        const float m1 = tid + 32 < nsplit ? m[tid + 32] : -INFINITY;
        const float mx = taper::warp_max(fmaxf(m0, m1));
        const float w0 = m0 == -INFINITY ? 0.f : exp2f(m0 - mx);
        const float w1 = m1 == -INFINITY ? 0.f : exp2f(m1 - mx);
        float lsum = 0.f;
        if (tid < nsplit) lsum += w0 * l[tid];
        if (tid + 32 < nsplit) lsum += w1 * l[tid + 32];
        w_s[tid] = w0;
        w_s[tid + 32] = w1;
        lsum = taper::warp_sum(lsum);
        if (tid == 0) inv_s = lsum > 0.f ? 1.f / lsum : 0.f;
    }
    __syncthreads();
    const int nvec = D / 4;               // float4 columns (D % 8 == 0, so rows stay aligned)
    const int groups = kThreads / nvec;   // >= 2 for D <= 256
    const int c = tid % nvec, g = tid / nvec;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < groups) {
        const float4* o4 = reinterpret_cast<const float4*>(o) + c;
        // Empty partitions wrote o = 0 and weigh 0: no branch, so the loads can be batched.
#pragma unroll 4
        for (int s = g; s < nsplit; s += groups) {
            const float w = w_s[s];
            const float4 v = o4[(int64_t)s * nvec];
            acc.x += w * v.x;
            acc.y += w * v.y;
            acc.z += w * v.z;
            acc.w += w * v.w;
        }
    }
    red[tid] = acc;
    __syncthreads();
    if (tid < nvec) {
        for (int k = 1; k < groups; k++) {
            const float4 v = red[k * nvec + tid];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        const float inv = inv_s;
        T* dst = out + row * D + 4 * tid;
        dst[0] = taper::from_float<T>(acc.x * inv);
        dst[1] = taper::from_float<T>(acc.y * inv);
        dst[2] = taper::from_float<T>(acc.z * inv);
        dst[3] = taper::from_float<T>(acc.w * inv);
    }
}

// ---- launchers

template <typename T, typename CT, int kD>
int launch_decode(void* out, const void* q, const void* k_cache, const void* v_cache,
                  const float* k_scale, const float* v_scale, const int32_t* block_tables,
                  const int32_t* seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                  int64_t NB, int64_t BS, int64_t MB, float scale, int window, float softcap,
                  int nsplit, float* ws, cudaStream_t stream) {
    const Layout L = make_layout((int)D, (int)(Hq / Hkv), (int)sizeof(CT), stages_for<CT>());
    auto kernel = decode_kernel<T, CT, kD>;
    // Above the default 48 KB a block must opt in to more dynamic shared memory (large D and
    // G, or an f32 cache); this sets a function attribute, no allocation or synchronization.
    if (L.total > 48 * 1024) {
        const cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total);
        if (e != cudaSuccess) {
            cudaGetLastError();  // do not leave it for the next launcher's status
            return (int)e;
        }
    }
    const dim3 grid((unsigned)(B * Hkv), (unsigned)nsplit);
    kernel<<<grid, kThreads, L.total, stream>>>(
        (T*)out, ws, (const T*)q, (const CT*)k_cache, (const CT*)v_cache, k_scale, v_scale,
        block_tables, seq_lens, (int)B, (int)Hq, (int)Hkv, (int)D, NB, (int)BS, (int)MB, scale,
        window, softcap, nsplit);
    int status = taper::launch_status();
    if (status != 0 || nsplit == 1) return status;
    const int64_t rows = B * Hq;
    merge_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>((T*)out, ws, rows, (int)D, nsplit);
    return taper::launch_status();
}

// Resident blocks per SM of the instance launch_decode would run, as the runtime computes it
// from the kernel's registers and this shape's shared memory.
template <typename T, typename CT, int kD>
int decode_occupancy(int64_t D, int64_t G, int* blocks) {
    const Layout L = make_layout((int)D, (int)G, (int)sizeof(CT), stages_for<CT>());
    auto kernel = decode_kernel<T, CT, kD>;
    cudaError_t e = cudaSuccess;
    if (L.total > 48 * 1024)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total);
    if (e == cudaSuccess)
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kThreads, L.total);
    if (e != cudaSuccess) cudaGetLastError();  // do not leave it for the next launcher's status
    return (int)e;
}

template <typename T, typename CT>
int occupancy_head_size(int64_t D, int64_t G, int* blocks) {
    switch (D) {
        case 64: return decode_occupancy<T, CT, 64>(D, G, blocks);
        case 80: return decode_occupancy<T, CT, 80>(D, G, blocks);
        case 96: return decode_occupancy<T, CT, 96>(D, G, blocks);
        case 128: return decode_occupancy<T, CT, 128>(D, G, blocks);
        case 256: return decode_occupancy<T, CT, 256>(D, G, blocks);
        default: return decode_occupancy<T, CT, 0>(D, G, blocks);
    }
}

// Head sizes with their own instances: 64 (Llama-3.2-1B, tiny-256 tests), 80 (Phi-2), 96 (Phi-3),
// 128 (Llama, Mistral, Qwen), 256 (Gemma); 0 is the run-time loop for any other D % 8 == 0.
template <typename T, typename CT>
int dispatch_head_size(int64_t D, void* out, const void* q, const void* k_cache,
                       const void* v_cache, const float* k_scale, const float* v_scale,
                       const int32_t* block_tables, const int32_t* seq_lens, int64_t B,
                       int64_t Hq, int64_t Hkv, int64_t NB, int64_t BS, int64_t MB, float scale,
                       int window, float softcap, int nsplit, float* ws, cudaStream_t stream) {
#define TAPER_DECODE_CASE(KD)                                                                  \
    return launch_decode<T, CT, KD>(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, \
                                    seq_lens, B, Hq, Hkv, D, NB, BS, MB, scale, window,         \
                                    softcap, nsplit, ws, stream)
    switch (D) {
        case 64: TAPER_DECODE_CASE(64);
        case 80: TAPER_DECODE_CASE(80);
        case 96: TAPER_DECODE_CASE(96);
        case 128: TAPER_DECODE_CASE(128);
        case 256: TAPER_DECODE_CASE(256);
        default: TAPER_DECODE_CASE(0);
    }
#undef TAPER_DECODE_CASE
}

inline bool aligned(const void* p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; }

}  // namespace

// Layout of the partials: o (B, Hq, num_splits, D), m and l (B, Hq, num_splits), all float.
extern "C" int64_t taper_cuda_decode_workspace_bytes(int64_t B, int64_t Hq, int64_t D,
                                                     int num_splits) {
    if (num_splits <= 1 || B <= 0 || Hq <= 0 || D <= 0) return 0;
    return B * Hq * (int64_t)num_splits * (D + 2) * (int64_t)sizeof(float);
}

extern "C" int taper_cuda_decode_blocks_per_sm(int64_t Hq, int64_t Hkv, int64_t D, int dtype,
                                               int cache_dtype, int* blocks) {
    if (!blocks || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > kMaxGroup) return TAPER_CUDA_ERR_ARG;
    if (D < 8 || D > 256 || D % 8 != 0) return TAPER_CUDA_ERR_ARG;
    if (cache_dtype != dtype && cache_dtype != TAPER_DT_FP8) return TAPER_CUDA_ERR_ARG;
    *blocks = 0;
    if (cache_dtype == TAPER_DT_FP8) {
        TAPER_DISPATCH_DTYPE(dtype, E, return occupancy_head_size<E, uint8_t>(D, Hq / Hkv, blocks));
    } else {
        TAPER_DISPATCH_DTYPE(dtype, E, return occupancy_head_size<E, E>(D, Hq / Hkv, blocks));
    }
    return TAPER_CUDA_ERR_ARG;
}

extern "C" int taper_cuda_paged_attention_decode(void* out,                    // (B, Hq, D)
                                                 const void* q,                // (B, Hq, D)
                                                 const void* k_cache,          // (NB, BS, Hkv, D)
                                                 const void* v_cache,          // (NB, BS, Hkv, D)
                                                 const float* k_scale,         // (Hkv,) FP8
                                                 const float* v_scale,         // (Hkv,) FP8
                                                 const int32_t* block_tables,  // (B, MB)
                                                 const int32_t* seq_lens,      // (B,)
                                                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                                 int64_t NB, int64_t BS, int64_t MB, float scale,
                                                 int64_t sliding_window, float softcap, int dtype,
                                                 int cache_dtype, int num_splits, void* workspace,
                                                 int64_t workspace_bytes, taper_stream_t stream) {
    if (B < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > kMaxGroup) return TAPER_CUDA_ERR_ARG;
    if (D < 8 || D > 256 || D % 8 != 0) return TAPER_CUDA_ERR_ARG;
    if (NB < 1 || BS < 1 || MB < 1 || MB * BS > INT32_MAX || sliding_window < 0) return TAPER_CUDA_ERR_ARG;
    if (B * Hkv > INT32_MAX || B * Hq > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (num_splits < 1 || num_splits > kMaxSplits) return TAPER_CUDA_ERR_ARG;
    if (cache_dtype != dtype && cache_dtype != TAPER_DT_FP8) return TAPER_CUDA_ERR_ARG;
    const bool fp8 = cache_dtype == TAPER_DT_FP8;
    if (fp8 && (!k_scale || !v_scale)) return TAPER_CUDA_ERR_ARG;
    if (num_splits > 1 &&
        (!workspace || !aligned(workspace, 16) ||
         workspace_bytes < taper_cuda_decode_workspace_bytes(B, Hq, D, num_splits)))
        return TAPER_CUDA_ERR_ARG;
    if (B == 0) return TAPER_CUDA_OK;
    if (!out || !q || !k_cache || !v_cache || !block_tables || !seq_lens) return TAPER_CUDA_ERR_ARG;
    // cp.async moves 16-byte units (8 for an FP8 row of D % 16 == 8 bytes) into shared memory.
    if (!aligned(k_cache, 16) || !aligned(v_cache, 16)) return TAPER_CUDA_ERR_ARG;
    // A window wider than any context is no window.
    const int window = sliding_window > INT32_MAX ? 0 : (int)sliding_window;
    float* ws = num_splits > 1 ? (float*)workspace : nullptr;
    const cudaStream_t st = (cudaStream_t)stream;
    if (fp8) {
        TAPER_DISPATCH_DTYPE(dtype, E,
                             return dispatch_head_size<E, uint8_t>(
                                 D, out, q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                 seq_lens, B, Hq, Hkv, NB, BS, MB, scale, window, softcap,
                                 num_splits, ws, st));
    } else {
        TAPER_DISPATCH_DTYPE(dtype, E,
                             return dispatch_head_size<E, E>(
                                 D, out, q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                 seq_lens, B, Hq, Hkv, NB, BS, MB, scale, window, softcap,
                                 num_splits, ws, st));
    }
    return TAPER_CUDA_ERR_ARG;
}

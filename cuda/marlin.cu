// W4A16 GEMM on the Marlin layout: out (M, N) = x (M, K) @ W.T, with W (N, K) held as int4
// codes, float32 group scales and optional uint8 zeros (pyx/weights/marlin.py defines and
// documents the layout; it is the CPU reference of the repack here), plus the repack itself from
// the canonical int4 layout that pyx/weights/int4.py keeps for GPTQ, AWQ and compressed-tensors.
//
// The trick (Marlin, Frantar et al.): the codes are stored in the order in which mma.sync
// m16n8k16 consumes its B operand, so that one lane's 16-byte load brings exactly the 32 codes
// of its B fragments for a 16 (k) x 64 (n) tile, and the warp's 32 loads are one contiguous
// 512-byte read. The codes are dequantized in registers, right before the MMA, and never exist
// as 16-bit weights in memory. Word j of lane l = 4c + t holds the B registers of n8 blocks 2j
// and 2j + 1: nibbles (p, p + 4) are register h = p % 2 of block 2j + p / 2, the two codes at
// k = 2t + 8h and 2t + 8h + 1 of column c (the low half holds the lower k).
//
// variant 0 (the reference, the default): a block of V0_WARPS warps owns one 16 x 64 output
// tile and splits K between its warps (warp w takes k-steps w, w + V0_WARPS, ...); each warp
// loads its A fragment straight from global memory (the block's warps share it through L1),
// its B words from the Marlin tiles, dequantizes to the activation type as
// round(scale * (code - zero)) in float (the CPU reference's float weight, rounded once), runs
// 8 MMAs per k-step, and the warps' accumulators are summed through shared memory. No pipeline,
// no workspace: a GPU run must time it before anything tuned replaces it. Any M (rows past M
// read zeros and are not written), any N (columns past N are the layout's padding, not written).
//
// variant 1 (the published design, behind the switch until a GPU run verifies it): a block owns
// an (MB*16) x (NB*64) output tile, one warp per (WM-th of the m16 blocks, 64-column n-tile).
// K is cut into k-tiles of 64 (4 mma k-steps), streamed through a STAGES-deep shared-memory ring
// by cp.async.cg 16-byte copies: A rows (zero-filled past M), the B Marlin tiles (already in
// fragment order: each lane later reads its uint4 with one conflict-free 16-byte shared load, no
// ldmatrix, no shuffles), and the group's scales and zeros. The codes are dequantized in
// registers with the magic-number trick: (w >> 4p) & 0x000f000f | 0x64006400 is the f16 pair
// 1024 + code (0x43004300: the bf16 pair 128 + code), from which an exact subtraction gives
// code - zero and one multiply by the scale (rounded to the activation type once per k-tile)
// gives the B register. This is one rounding more than variant 0 when the float32 scale is not
// exactly representable in the activation type (bf16 activations with f16 checkpoint scales):
// B may differ from round(scale * (code - zero)) by one unit in the last place.
// For M <= 16 and too few output tiles to fill the GPU, K is split over gridDim.z blocks
// ("global reduce"): every k-slice stores its float partial tile in the workspace, and the last
// block of each output tile (an atomic counter in the workspace) sums the slices in slice order
// (deterministic whichever block is last), writes the output and resets its counter. The
// launcher also zeroes the counters on the stream first (cudaMemsetAsync, graph-capturable),
// because the caller's workspace is shared with other ops and holds garbage.
// Needs K % 64 == 0, G % 64 == 0 (G = K per channel included), x, qweight, scales, zeros and the
// workspace 16-byte aligned; otherwise TAPER_CUDA_ERR_ARG (the caller falls back to variant 0).
//
// A third kernel, Marlin v2 (striped partitioning of the (column, k-tile) sequence across the
// SMs, ldmatrix A tiles, lop3 dequantization), was removed after the first GPU window: on an
// H200 (2026-11-28, bench.kernels qgemm rows) it ran at 0.65-0.93x variant 0 on Llama-3-8B's
// gate_up and down at M 1 and 16.
#include <string.h>

#include <algorithm>

#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int TILE_K = 16;       // one mma k-step
constexpr int TILE_N = 64;       // 8 n8 blocks: one lane's 16-byte load of codes
constexpr int V0_WARPS = 8;      // warps splitting K in one block
constexpr int V0_THREADS = V0_WARPS * 32;
constexpr int REPACK_THREADS = 256;

// ---- kernels: repack (one thread per output word or group entry, grid-stride)

// Code k of a row in the canonical layout of pyx/int4_kernels.h: in each run of 32 codes, byte
// j holds code j (low nibble) and code 16 + j (high nibble).
__device__ __forceinline__ uint32_t canonical_code(const uint8_t* __restrict__ row,  // (K/2)
                                                   int64_t k) {
    const uint8_t b = row[(k >> 5) * 16 + (k & 15)];
    return (k & 31) < 16 ? (b & 15u) : (b >> 4);
}

__global__ void marlin_repack_codes_kernel(const uint8_t* __restrict__ qs,  // (N, K/2)
                                           uint32_t* __restrict__ qweight,  // (K/16, Np*2)
                                           int64_t N, int64_t K, int64_t Np) {
    const int64_t words = (K / TILE_K) * Np * 2;
    for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w < words;
         w += (int64_t)gridDim.x * blockDim.x) {
        const int64_t kt = w / (Np * 2), rem = w - kt * Np * 2;
        const int64_t nt = rem >> 7;
        const int lane = (int)(rem >> 2) & 31, j = (int)rem & 3;
        const int c = lane >> 2, t = lane & 3;
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = i >> 2, b = (i >> 1) & 1, h = i & 1;
            const int64_t k = kt * TILE_K + 2 * t + 8 * h + e;
            const int64_t n = nt * TILE_N + 8 * (2 * j + b) + c;
            const uint32_t code = n < N ? canonical_code(qs + n * (K / 2), k) : 8u;
            word |= code << (4 * i);
        }
        qweight[w] = word;
    }
}

// Entry (g, pos) of the permuted (K/G, Np) arrays: pos = 64 nt + 8c + blk holds column
// 64 nt + 8 blk + c; padded columns get scale 0 and zero 8.
__global__ void marlin_repack_groups_kernel(const float* __restrict__ scales,  // (N, K/G)
                                            const float* __restrict__ zeros,   // (N, K/G) or NULL
                                            float* __restrict__ m_scales,      // (K/G, Np)
                                            uint8_t* __restrict__ m_zeros,     // (K/G, Np) or NULL
                                            int64_t N, int64_t ng, int64_t Np) {
    const int64_t total = ng * Np;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t g = i / Np, pos = i - g * Np;
        const int64_t r = pos & 63;
        const int64_t col = (pos - r) + 8 * (r & 7) + (r >> 3);
        m_scales[i] = col < N ? scales[col * ng + g] : 0.f;
        if (m_zeros) m_zeros[i] = col < N ? (uint8_t)__float2int_rn(zeros[col * ng + g]) : 8;
    }
}

// ---- kernels: GEMM variant 0

// pack_pair and mma_16816 (mma.sync m16n8k16 with 16-bit inputs, sm_80 and up, unchanged on
// sm_90a, so one kernel serves both targets): cuda/mma.cuh.
using taper::mma_16816;
using taper::pack_pair;

// Two consecutive activations (4-byte aligned: K is even and the launcher checked x).
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* p) {
    return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// c = lane / 4 and t = lane % 4:
//   A (16x16): a0 = (row c, k 2t, 2t+1), a1 = (row c+8, same k), a2 = (row c, k 2t+8, 2t+9),
//              a3 = (row c+8, k 2t+8, 2t+9); the lower k sits in the low half.
//   B (16x8):  b0 = (k 2t, 2t+1, col c), b1 = (k 2t+8, 2t+9, col c).
//   C (16x8):  c0, c1 = (row c, cols 2t, 2t+1), c2, c3 = (row c+8, cols 2t, 2t+1).
// The warp's 64 columns are 8 n8 blocks blk; the lane's scales and zeros for its column c of
// each block are 8 contiguous entries of the permuted arrays.
template <typename T>
__global__ void __launch_bounds__(V0_THREADS)
marlin_gemm_simple_kernel(const T* __restrict__ x,             // (M, K)
                          const uint4* __restrict__ qweight,   // (K/16, Np/64, 32 lanes) words x4
                          const float* __restrict__ scales,    // (K/G, Np)
                          const uint8_t* __restrict__ zeros,   // (K/G, Np) or NULL
                          T* __restrict__ out,                 // (M, N)
                          int M, int N, int Np, int K, int G) {
    __shared__ float red[V0_WARPS - 1][32][32];  // [warp - 1][accumulator][lane]: no conflicts
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = lane >> 2, t = lane & 3;
    const int nt = blockIdx.x, ntiles = Np / TILE_N;
    const int KT = K / TILE_K;
    const int mtiles = (M + 15) / 16;

    for (int mt = blockIdx.y; mt < mtiles; mt += gridDim.y) {
        const int64_t r0 = (int64_t)mt * 16 + c, r1 = r0 + 8;
        const bool ok0 = r0 < M, ok1 = r1 < M;
        const T* x0 = x + (ok0 ? r0 : 0) * (int64_t)K + 2 * t;
        const T* x1 = x + (ok1 ? r1 : 0) * (int64_t)K + 2 * t;

        float acc[8][4];
#pragma unroll
        for (int b = 0; b < 8; b++) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
        float s[8], z[8];
        int cur_g = -1;

        for (int kt = warp; kt < KT; kt += V0_WARPS) {
            const int k0 = kt * TILE_K;
            const int g = k0 / G;  // G is a multiple of 16: a k-step never straddles groups
            if (g != cur_g) {
                const int64_t at = (int64_t)g * Np + nt * TILE_N + 8 * c;
                const float4 s0 = __ldg(reinterpret_cast<const float4*>(scales + at));
                const float4 s1 = __ldg(reinterpret_cast<const float4*>(scales + at) + 1);
                s[0] = s0.x, s[1] = s0.y, s[2] = s0.z, s[3] = s0.w;
                s[4] = s1.x, s[5] = s1.y, s[6] = s1.z, s[7] = s1.w;
                if (zeros) {
                    const uint2 zz = __ldg(reinterpret_cast<const uint2*>(zeros + at));
#pragma unroll
                    for (int b = 0; b < 8; b++)
                        z[b] = (float)(((b < 4 ? zz.x : zz.y) >> (8 * (b & 3))) & 255u);
                } else {
#pragma unroll
                    for (int b = 0; b < 8; b++) z[b] = 8.f;
                }
                cur_g = g;
            }
            uint32_t a[4];
            a[0] = ok0 ? load_pair(x0 + k0) : 0u;
            a[1] = ok1 ? load_pair(x1 + k0) : 0u;
            a[2] = ok0 ? load_pair(x0 + k0 + 8) : 0u;
            a[3] = ok1 ? load_pair(x1 + k0 + 8) : 0u;
            const uint4 q = __ldg(qweight + ((int64_t)kt * ntiles + nt) * 32 + lane);
            const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    const int blk = 2 * j + b;
                    uint32_t breg[2];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int p = 2 * b + h;  // nibbles p (lower k) and p + 4
                        const float lo = (float)((words[j] >> (4 * p)) & 15u);
                        const float hi = (float)((words[j] >> (4 * p + 16)) & 15u);
                        breg[h] = pack_pair((lo - z[blk]) * s[blk], (hi - z[blk]) * s[blk],
                                            (T*)nullptr);
                    }
                    mma_16816(acc[blk], a, breg[0], breg[1], (T*)nullptr);
                }
            }
        }

        // Sum the warps' partial tiles: warps 1.. park theirs, warp 0 adds and stores.
        if (warp > 0) {
#pragma unroll
            for (int i = 0; i < 32; i++) red[warp - 1][i][lane] = acc[i >> 2][i & 3];
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int w = 0; w < V0_WARPS - 1; w++) {
#pragma unroll
                for (int i = 0; i < 32; i++) acc[i >> 2][i & 3] += red[w][i][lane];
            }
#pragma unroll
            for (int blk = 0; blk < 8; blk++) {
                const int col = nt * TILE_N + blk * 8 + 2 * t;
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    if (col + i >= N) continue;
                    if (ok0) out[r0 * N + col + i] = taper::from_float<T>(acc[blk][i]);
                    if (ok1) out[r1 * N + col + i] = taper::from_float<T>(acc[blk][2 + i]);
                }
            }
        }
        __syncthreads();  // red is reused by the next m-tile
    }
}


// ---- kernels: GEMM variant 1 (cp.async pipeline, in-register magic-number dequantization)

constexpr int V1_KT = 64;              // k per k-tile (one pipeline stage): 4 mma k-steps
constexpr int V1_KSTEPS = V1_KT / TILE_K;
constexpr int V1_A_STRIDE = V1_KT + 8;  // halves per A row in shared memory (144 bytes)

// Instantiated tile shapes (the explicit list; chosen by M in pick_v1_config):
//   config 0, M <= 16:      16 x 256 tile, MB 1, NB 4, WM 1: 4 warps, each a 16 x 64 tile,
//                           4 stages (47 KB); K split across blocks (global reduce) when the
//                           16 x 256 tiles alone do not give every SM a block.
//   config 1, 16 < M <= 64: 64 x 128 tile, MB 4, NB 2, WM 2: 4 warps, each 32 x 64, 4 stages
//                           (56 KB).
//   config 2, M > 64:       128 x 128 tile, MB 8, NB 2, WM 4: 8 warps, each 32 x 64, 4 stages
//                           (93 KB).
// Each of them exists for bf16 and f16 activations.
template <int MB, int NB, int WM, int STAGES, int MIN_BLOCKS>
struct V1Shape {
    static constexpr int kMB = MB, kNB = NB, kStages = STAGES, kMinBlocks = MIN_BLOCKS;
    static constexpr int THREADS = 32 * WM * NB;
    static constexpr int MW = MB / WM;  // m16 blocks per warp
    static constexpr int A_BYTES = MB * 16 * V1_A_STRIDE * 2;
    static constexpr int B_BYTES = V1_KSTEPS * NB * 512;
    static constexpr int S_BYTES = NB * 64 * 4;
    static constexpr int Z_BYTES = NB * 64;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + S_BYTES + Z_BYTES;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
    static constexpr int TILE_FLOATS = MB * 16 * NB * 64;  // one partial tile in the workspace
    static_assert(MB % WM == 0, "warps split the m16 blocks evenly");
    static_assert(A_BYTES % 16 == 0 && B_BYTES % 16 == 0 && S_BYTES % 16 == 0 &&
                  Z_BYTES % 16 == 0, "every cp.async destination is 16-byte aligned");
    static_assert(TILE_FLOATS == THREADS * MW * 32, "one tile is every thread's accumulators");
};
// MIN_BLOCKS (launch bounds) lets ptxas use up to 65536 / (THREADS * MIN_BLOCKS) registers:
// the small tile keeps 4 blocks per SM for latency hiding, the large one needs ~144 registers.
using V1Small = V1Shape<1, 4, 1, 4, 4>;
using V1Mid = V1Shape<4, 2, 2, 4, 2>;
using V1Large = V1Shape<8, 2, 4, 4, 1>;

// 16-byte asynchronous global -> shared copy that bypasses L1 (.cg: every byte is used once per
// block); src_bytes 0 zero-fills the destination without reading (rows past M).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t as_u32(__half2 v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

// Per-column dequantization constants of one group, and the magic-number dequantization of one
// B register (two codes, the lower k in the low half).
template <typename T> struct Dequant;
template <> struct Dequant<__half> {
    using T2 = __half2;
    // zb = 1024 + zero (exact in f16 for zero <= 1023), s = the scale rounded to f16.
    __device__ __forceinline__ static void prepare(float scale, float zero, T2& s, T2& zb) {
        s = __float2half2_rn(scale);
        zb = __float2half2_rn(1024.f + zero);
    }
    __device__ __forceinline__ static uint32_t b_reg(uint32_t w, int p, T2 s, T2 zb) {
        // The low nibble of each half as the mantissa of 1024 (0x6400): the f16 1024 + code.
        uint32_t u = ((w >> (4 * p)) & 0x000f000fu) | 0x64006400u;
        __half2 h;
        memcpy(&h, &u, 4);
        return as_u32(__hmul2(__hsub2(h, zb), s));  // (code - zero) exact, then one rounding
    }
};
template <> struct Dequant<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    // bf16 has 8 significant bits: 128 + code is exact, 128 + zero is not for zero > 127, so the
    // bias and the zero are subtracted one after the other (each exact: integers below 256).
    __device__ __forceinline__ static void prepare(float scale, float zero, T2& s, T2& z) {
        s = __float2bfloat162_rn(scale);
        z = __float2bfloat162_rn(zero);
    }
    __device__ __forceinline__ static uint32_t b_reg(uint32_t w, int p, T2 s, T2 z) {
        uint32_t u = ((w >> (4 * p)) & 0x000f000fu) | 0x43004300u;  // bf16 128 + code
        __nv_bfloat162 h;
        memcpy(&h, &u, 4);
        const __nv_bfloat162 bias = __float2bfloat162_rn(128.f);
        return as_u32(__hmul2(__hsub2(__hsub2(h, bias), z), s));
    }
};

// One block: output tile (blockIdx.y, blockIdx.x) of (MB*16) x (NB*64), k-tiles
// [KTt * z / S, KTt * (z + 1) / S) of the gridDim.z = S slices. Warp w owns n-tile w % NB and
// m16 blocks (w / NB) * MW .. + MW - 1 of the tile.
template <typename T, typename Sh>
__global__ void __launch_bounds__(Sh::THREADS, Sh::kMinBlocks)
marlin_gemm_v1_kernel(const T* __restrict__ x,             // (M, K)
                      const uint4* __restrict__ qweight,   // (K/16, Np/64, 32 lanes) words x4
                      const float* __restrict__ scales,    // (K/G, Np)
                      const uint8_t* __restrict__ zeros,   // (K/G, Np) or NULL
                      T* __restrict__ out,                 // (M, N)
                      unsigned* __restrict__ counters,     // (gridDim.y * gridDim.x) if S > 1
                      float* __restrict__ partials,        // (tiles, S, TILE_FLOATS) if S > 1
                      int M, int N, int Np, int K, int G) {
    constexpr int MB = Sh::kMB, NB = Sh::kNB, STAGES = Sh::kStages, MW = Sh::MW;
    constexpr int THREADS = Sh::THREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    using D = Dequant<T>;
    using T2 = typename D::T2;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = lane >> 2, t = lane & 3;
    const int wn = warp % NB, wm = warp / NB;
    const int ntiles = Np / TILE_N;
    const int nt0 = blockIdx.x * NB;           // first n-tile of the block
    const int m0 = blockIdx.y * MB * 16;       // first row of the block
    const bool warp_valid = nt0 + wn < ntiles;  // the last block's trailing n-tiles may not exist
    const int KTt = K / V1_KT, S = gridDim.z, slice = blockIdx.z;
    const int kt_begin = (int)((int64_t)KTt * slice / S);
    const int kt_end = (int)((int64_t)KTt * (slice + 1) / S);
    const int nk = kt_end - kt_begin;

    // Issue the copies of k-tile kt into ring stage st (all threads, then one commit by caller).
    auto load_stage = [&](int st, int kt) {
        unsigned char* base = smem + st * Sh::STAGE_BYTES;
        T* sA = reinterpret_cast<T*>(base);
        uint4* sB = reinterpret_cast<uint4*>(base + Sh::A_BYTES);
        float* sS = reinterpret_cast<float*>(base + Sh::A_BYTES + Sh::B_BYTES);
        uint8_t* sZ = base + Sh::A_BYTES + Sh::B_BYTES + Sh::S_BYTES;
        const int k0 = kt * V1_KT;
        // A: MB*16 rows of 8 16-byte chunks; rows past M are zero-filled from a valid address.
        for (int i = tid; i < MB * 16 * 8; i += THREADS) {
            const int r = i >> 3, ch = i & 7;
            const int row = m0 + r;
            const T* src = x + (row < M ? (int64_t)row * K + k0 + ch * 8 : 0);
            cp_async16(sA + r * V1_A_STRIDE + ch * 8, src, row < M ? 16 : 0);
        }
        // B: 4 k-steps x NB tiles x 32 lanes of 16 bytes; each k-step's NB tiles are contiguous.
        for (int i = tid; i < V1_KSTEPS * NB * 32; i += THREADS) {
            const int ks = i / (NB * 32), rem = i - ks * (NB * 32);
            if (nt0 + rem / 32 < ntiles)
                cp_async16(sB + i, qweight + ((int64_t)(kt * V1_KSTEPS + ks) * ntiles + nt0) * 32 +
                                       rem, 16);
        }
        // The k-tile's group (G is a multiple of 64: a k-tile never straddles groups).
        const int64_t gofs = (int64_t)(k0 / G) * Np + (int64_t)nt0 * TILE_N;
        for (int i = tid; i < NB * 16; i += THREADS)
            if (nt0 + i / 16 < ntiles) cp_async16(sS + i * 4, scales + gofs + i * 4, 16);
        if (zeros != nullptr)
            for (int i = tid; i < NB * 4; i += THREADS)
                if (nt0 + i / 4 < ntiles) cp_async16(sZ + i * 16, zeros + gofs + i * 16, 16);
    };

    float acc[MW][8][4];
#pragma unroll
    for (int mi = 0; mi < MW; mi++)
#pragma unroll
        for (int b = 0; b < 8; b++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mi][b][e] = 0.f;

    // Prologue: STAGES - 1 k-tiles in flight. One commit per stage whether or not it loaded
    // anything, so that "wait until at most STAGES - 2 groups are pending" always means "k-tile
    // i has landed" in iteration i.
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < nk) load_stage(st, kt_begin + st);
        cp_async_commit();
    }

    for (int i = 0; i < nk; i++) {
        cp_async_wait<STAGES - 2>();
        // Makes every thread's copies of k-tile i visible, and guarantees every warp finished
        // computing k-tile i - 1, whose stage the prefetch below overwrites.
        __syncthreads();
        if (i + STAGES - 1 < nk) load_stage((i + STAGES - 1) % STAGES, kt_begin + i + STAGES - 1);
        cp_async_commit();

        if (warp_valid) {
            const unsigned char* base = smem + (i % STAGES) * Sh::STAGE_BYTES;
            const uint32_t* sA = reinterpret_cast<const uint32_t*>(base);
            const uint4* sB = reinterpret_cast<const uint4*>(base + Sh::A_BYTES);
            const float* sS = reinterpret_cast<const float*>(base + Sh::A_BYTES + Sh::B_BYTES);
            const uint8_t* sZ = base + Sh::A_BYTES + Sh::B_BYTES + Sh::S_BYTES;
            // The lane's 8 columns (one per n8 block): 8 scales and 8 zeros, contiguous.
            T2 s2[8], z2[8];
            {
                const float4 sa = *reinterpret_cast<const float4*>(sS + wn * 64 + 8 * c);
                const float4 sb = *reinterpret_cast<const float4*>(sS + wn * 64 + 8 * c + 4);
                const float sv[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
                uint2 zz = make_uint2(0x08080808u, 0x08080808u);
                if (zeros != nullptr) zz = *reinterpret_cast<const uint2*>(sZ + wn * 64 + 8 * c);
#pragma unroll
                for (int b = 0; b < 8; b++)
                    D::prepare(sv[b], (float)(((b < 4 ? zz.x : zz.y) >> (8 * (b & 3))) & 255u),
                               s2[b], z2[b]);
            }
#pragma unroll
            for (int ks = 0; ks < V1_KSTEPS; ks++) {
                const uint4 q = sB[(ks * NB + wn) * 32 + lane];  // one 16-byte load, no conflicts
                const uint32_t words[4] = {q.x, q.y, q.z, q.w};
                uint32_t breg[8][2];
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int b = 0; b < 2; b++)
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            breg[2 * j + b][h] =
                                D::b_reg(words[j], 2 * b + h, s2[2 * j + b], z2[2 * j + b]);
#pragma unroll
                for (int mi = 0; mi < MW; mi++) {
                    // A fragment from the padded rows: word (row * 36 + ks * 8 + t), banks
                    // 4c + t for the 32 lanes, so the four 4-byte loads are conflict-free.
                    const int r = (wm * MW + mi) * 16 + c;
                    const uint32_t* a0p = sA + r * (V1_A_STRIDE / 2) + ks * 8 + t;
                    const uint32_t* a1p = a0p + 8 * (V1_A_STRIDE / 2);
                    const uint32_t a[4] = {a0p[0], a1p[0], a0p[4], a1p[4]};
#pragma unroll
                    for (int blk = 0; blk < 8; blk++)
                        mma_16816(acc[mi][blk], a, breg[blk][0], breg[blk][1], (T*)nullptr);
                }
            }
        }
    }
    cp_async_wait<0>();  // nothing is left in flight when the block exits (only empty groups)

    if (S > 1) {
        // Global reduce: park this slice's partial tile (coalesced: register r of thread tid
        // at r * THREADS + tid), then the last of the S blocks of this tile sums them.
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float* part = partials + (int64_t)tile * S * Sh::TILE_FLOATS;
#pragma unroll
        for (int mi = 0; mi < MW; mi++)
#pragma unroll
            for (int b = 0; b < 8; b++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    __stcg(part + (int64_t)slice * Sh::TILE_FLOATS +
                               ((mi * 8 + b) * 4 + e) * THREADS + tid,
                           acc[mi][b][e]);
        __threadfence();  // the partials are visible device-wide before the counter moves
        __syncthreads();
        __shared__ int s_last;
        if (tid == 0) {
            const unsigned prev = atomicAdd(counters + tile, 1u);
            s_last = prev == (unsigned)(S - 1);
            if (s_last) atomicExch(counters + tile, 0u);  // ready for the next launch
        }
        __syncthreads();
        if (!s_last) return;
        __threadfence();  // acquire: the other slices' partials, read through L2 (__ldcg)
        // Fixed order s = 0 .. S-1 whichever block came last: deterministic sums.
#pragma unroll
        for (int mi = 0; mi < MW; mi++)
#pragma unroll
            for (int b = 0; b < 8; b++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float sum = 0.f;
                    for (int s = 0; s < S; s++)
                        sum += s == slice ? acc[mi][b][e]
                                          : __ldcg(part + (int64_t)s * Sh::TILE_FLOATS +
                                                   ((mi * 8 + b) * 4 + e) * THREADS + tid);
                    acc[mi][b][e] = sum;
                }
    }

    if (!warp_valid) return;
#pragma unroll
    for (int mi = 0; mi < MW; mi++) {
        const int r0 = m0 + (wm * MW + mi) * 16 + c, r1 = r0 + 8;
#pragma unroll
        for (int blk = 0; blk < 8; blk++) {
            const int col = (nt0 + wn) * TILE_N + blk * 8 + 2 * t;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (col + e >= N) continue;
                if (r0 < M) out[(int64_t)r0 * N + col + e] = taper::from_float<T>(acc[mi][blk][e]);
                if (r1 < M)
                    out[(int64_t)r1 * N + col + e] = taper::from_float<T>(acc[mi][blk][2 + e]);
            }
        }
    }
}

// ---- launchers (host helpers)

template <typename T>
void launch_gemm_simple(const void* x, const uint32_t* qweight, const float* scales,
                        const uint8_t* zeros, void* out, int64_t M, int64_t N, int64_t Np,
                        int64_t K, int64_t G, cudaStream_t stream) {
    // grid.y is capped at 65535 m-tiles; the kernel strides over the rest.
    const dim3 grid((unsigned)(Np / TILE_N), (unsigned)std::min<int64_t>((M + 15) / 16, 65535));
    marlin_gemm_simple_kernel<T><<<grid, V0_THREADS, 0, stream>>>(
        (const T*)x, reinterpret_cast<const uint4*>(qweight), scales, zeros, (T*)out, (int)M,
        (int)N, (int)Np, (int)K, (int)G);
}

bool aligned(const void* p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

bool bad_shape(int64_t N, int64_t K, int64_t G) {
    return N < 0 || K <= 0 || G <= 0 || K % TILE_K || G % TILE_K || K % G;
}


// Variant 1's launch plan, shared by the workspace query and the launch so that the two agree.
struct V1Plan {
    int config;         // 0, 1, 2: V1Small, V1Mid, V1Large
    int gx, gy, S;      // grid: n-blocks, m-blocks, k-slices
    int64_t counter_bytes, partial_bytes;
};

int v1_sm_count() {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();  // a failed query must not show up as the next launch's status
        return 1;            // no split: the plan stays valid, only slower
    }
    return sms;
}

V1Plan v1_plan(int64_t M, int64_t N, int64_t K) {
    V1Plan p{};
    const int64_t ntiles = taper::ceil_div(N, TILE_N);
    int mb, nb, tile_floats;
    if (M <= 16) {
        p.config = 0, mb = V1Small::kMB, nb = V1Small::kNB, tile_floats = V1Small::TILE_FLOATS;
    } else if (M <= 64) {
        p.config = 1, mb = V1Mid::kMB, nb = V1Mid::kNB, tile_floats = V1Mid::TILE_FLOATS;
    } else {
        p.config = 2, mb = V1Large::kMB, nb = V1Large::kNB, tile_floats = V1Large::TILE_FLOATS;
    }
    p.gx = (int)taper::ceil_div(ntiles, nb);
    p.gy = (int)taper::ceil_div(M, 16 * mb);
    p.S = 1;
    if (p.config == 0) {
        // Split K until every SM has a block, keeping at least 4 k-tiles (one pipeline's depth)
        // per slice and at most 16 slices (the last block's sum reads S partial tiles).
        const int64_t blocks = (int64_t)p.gx * p.gy, KTt = K / V1_KT;
        const int64_t want = taper::ceil_div(v1_sm_count(), blocks);
        p.S = (int)std::max<int64_t>(1, std::min<int64_t>({want, KTt / 4, 16}));
    }
    if (p.S > 1) {
        p.counter_bytes = taper::ceil_div((int64_t)p.gx * p.gy * 4, 256) * 256;
        p.partial_bytes = (int64_t)p.gx * p.gy * p.S * tile_floats * 4;
    }
    return p;
}

bool v1_shape_ok(int64_t K, int64_t G) { return K % V1_KT == 0 && G % V1_KT == 0; }

template <typename T, typename Sh>
int launch_gemm_v1(const void* x, const uint32_t* qweight, const float* scales,
                   const uint8_t* zeros, void* out, int64_t M, int64_t N, int64_t Np, int64_t K,
                   int64_t G, const V1Plan& p, void* workspace, cudaStream_t stream) {
    // Above 48 KB of dynamic shared memory a kernel must opt in, once per process (the engine
    // warms up before it captures graphs, so this never runs inside a capture).
    static const cudaError_t attr = cudaFuncSetAttribute(
        marlin_gemm_v1_kernel<T, Sh>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        Sh::SMEM_BYTES);
    if (attr != cudaSuccess) return (int)attr;
    unsigned* counters = nullptr;
    float* partials = nullptr;
    if (p.S > 1) {
        counters = static_cast<unsigned*>(workspace);
        partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + p.counter_bytes);
        // The workspace is shared with other ops: the counters start from zero on the stream.
        const cudaError_t e = cudaMemsetAsync(counters, 0, p.counter_bytes, stream);
        if (e != cudaSuccess) return (int)e;
    }
    const dim3 grid((unsigned)p.gx, (unsigned)p.gy, (unsigned)p.S);
    marlin_gemm_v1_kernel<T, Sh><<<grid, Sh::THREADS, Sh::SMEM_BYTES, stream>>>(
        (const T*)x, reinterpret_cast<const uint4*>(qweight), scales, zeros, (T*)out, counters,
        partials, (int)M, (int)N, (int)Np, (int)K, (int)G);
    return taper::launch_status();
}

template <typename T>
int launch_v1_for(const void* x, const uint32_t* qweight, const float* scales,
                  const uint8_t* zeros, void* out, int64_t M, int64_t N, int64_t Np, int64_t K,
                  int64_t G, const V1Plan& p, void* workspace, cudaStream_t stream) {
    switch (p.config) {
        case 0: return launch_gemm_v1<T, V1Small>(x, qweight, scales, zeros, out, M, N, Np, K, G,
                                                  p, workspace, stream);
        case 1: return launch_gemm_v1<T, V1Mid>(x, qweight, scales, zeros, out, M, N, Np, K, G,
                                                p, workspace, stream);
        default: return launch_gemm_v1<T, V1Large>(x, qweight, scales, zeros, out, M, N, Np, K,
                                                   G, p, workspace, stream);
    }
}

unsigned grid_for(int64_t work) {
    return (unsigned)std::min<int64_t>(taper::ceil_div(work, REPACK_THREADS), 1 << 20);
}

}  // namespace

// ---- launchers

extern "C" int taper_cuda_marlin_repack(const uint8_t* qs,      // (N, K/2) packed codes
                                        const float* scales,    // (N, K/G)
                                        const float* zeros,     // (N, K/G), or NULL
                                        uint32_t* qweight,      // (K/16, Np*2)
                                        float* m_scales,        // (K/G, Np)
                                        uint8_t* m_zeros,       // (K/G, Np), or NULL
                                        int64_t N, int64_t K, int64_t group_size,
                                        taper_stream_t stream) {
    if (bad_shape(N, K, group_size) || (zeros == nullptr) != (m_zeros == nullptr))
        return TAPER_CUDA_ERR_ARG;
    if (N == 0) return TAPER_CUDA_OK;
    const int64_t Np = taper::ceil_div(N, TILE_N) * TILE_N, ng = K / group_size;
    marlin_repack_codes_kernel<<<grid_for((K / TILE_K) * Np * 2), REPACK_THREADS, 0,
                                 (cudaStream_t)stream>>>(qs, qweight, N, K, Np);
    const int status = taper::launch_status();
    if (status != 0) return status;
    marlin_repack_groups_kernel<<<grid_for(ng * Np), REPACK_THREADS, 0, (cudaStream_t)stream>>>(
        scales, zeros, m_scales, m_zeros, N, ng, Np);
    return taper::launch_status();
}

extern "C" int64_t taper_cuda_marlin_workspace_bytes(int64_t M, int64_t N, int64_t K,
                                                     int variant) {
    // variant 0 needs none; variant 1 needs counters and partial tiles only when it splits K.
    if (M <= 0 || N <= 0 || K <= 0 || K % V1_KT) return 0;
    if (variant == 1) {
        const V1Plan p = v1_plan(M, N, K);
        return p.counter_bytes + p.partial_bytes;
    }
    return 0;
}

extern "C" int taper_cuda_marlin_gemm(const void* x,            // (M, K) dtype
                                      const uint32_t* qweight,  // (K/16, Np*2)
                                      const float* scales,      // (K/G, Np)
                                      const uint8_t* zeros,     // (K/G, Np), or NULL
                                      void* out,                // (M, N) dtype
                                      int64_t M, int64_t N, int64_t K, int64_t group_size,
                                      int dtype, int variant, void* workspace,
                                      int64_t workspace_bytes, taper_stream_t stream) {
    if (variant < 0 || variant > 1) return TAPER_CUDA_ERR_ARG;
    if (M < 0 || bad_shape(N, K, group_size) || M > INT32_MAX || N > INT32_MAX - TILE_N ||
        K > INT32_MAX)
        return TAPER_CUDA_ERR_ARG;
    if (M == 0 || N == 0) return TAPER_CUDA_OK;
    // 4-byte pairs of activations, 16-byte code loads, 32-byte scale loads, 8-byte zero loads.
    if (!aligned(x, 4) || !aligned(qweight, 16) || !aligned(scales, 16) ||
        (zeros && !aligned(zeros, 8)))
        return TAPER_CUDA_ERR_ARG;
    const int64_t Np = taper::ceil_div(N, TILE_N) * TILE_N;
    const cudaStream_t s = (cudaStream_t)stream;
    if (variant == 1) {
        // 16-byte cp.async sources everywhere (x rows are 16-byte aligned since K % 64 == 0).
        if (dtype != TAPER_DT_BF16 && dtype != TAPER_DT_F16) return TAPER_CUDA_ERR_ARG;
        if (!v1_shape_ok(K, group_size) || !aligned(x, 16) || !aligned(scales, 16) ||
            (zeros && !aligned(zeros, 16)) || (M + 127) / 128 > 65535)
            return TAPER_CUDA_ERR_ARG;
        const V1Plan p = v1_plan(M, N, K);
        const int64_t need = p.counter_bytes + p.partial_bytes;
        if (need > 0 && (workspace == nullptr || workspace_bytes < need || !aligned(workspace, 16)))
            return TAPER_CUDA_ERR_ARG;
        if (dtype == TAPER_DT_BF16)
            return launch_v1_for<__nv_bfloat16>(x, qweight, scales, zeros, out, M, N, Np, K,
                                                group_size, p, workspace, s);
        return launch_v1_for<__half>(x, qweight, scales, zeros, out, M, N, Np, K, group_size, p,
                                     workspace, s);
    }
    switch (dtype) {
        case TAPER_DT_BF16:
            launch_gemm_simple<__nv_bfloat16>(x, qweight, scales, zeros, out, M, N, Np, K,
                                              group_size, s);
            break;
        case TAPER_DT_F16:
            launch_gemm_simple<__half>(x, qweight, scales, zeros, out, M, N, Np, K, group_size, s);
            break;
        default: return TAPER_CUDA_ERR_ARG;  // tensor cores take 16-bit activations
    }
    return taper::launch_status();
}

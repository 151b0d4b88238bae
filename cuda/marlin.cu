// W4A16 GEMM on the Marlin layout: out (M, N) = x (M, K) @ W.T, with W (N, K) held as int4
// codes, float32 group scales and optional uint8 zeros (engine/marlin.py defines and documents
// the layout; it is the CPU reference of the repack here), plus the repack itself from the
// canonical int4 layout that engine/quant_int4.py keeps for GPTQ, AWQ and compressed-tensors.
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
// variant 1 (multi-stage cp.async pipeline, global-reduce workspace for small M) is not written
// yet: the launcher returns TAPER_CUDA_ERR_ARG for it.
#include <string.h>

#include <algorithm>

#include "common.cuh"

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

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16*) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half*) {
    const __half2 v = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

// c += a (16x16, row major) * b (16x8, column major), f32 accumulators. mma.sync m16n8k16 with
// 16-bit inputs exists from sm_80 on and runs unchanged on sm_90a (Hopper keeps the warp-level
// MMA path beside wgmma), so one kernel serves both targets. Not volatile: it has no side
// effects, so the compiler may move the next k-step's loads above it.
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0,
                                          uint32_t b1, __nv_bfloat16*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // only sm_80 and sm_90a are compiled
#endif
}
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0,
                                          uint32_t b1, __half*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

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
                        breg[h] = pack2((lo - z[blk]) * s[blk], (hi - z[blk]) * s[blk],
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
    (void)M, (void)N, (void)K, (void)variant;
    return 0;  // variant 0 needs none; variant 1 is not written yet
}

extern "C" int taper_cuda_marlin_gemm(const void* x,            // (M, K) dtype
                                      const uint32_t* qweight,  // (K/16, Np*2)
                                      const float* scales,      // (K/G, Np)
                                      const uint8_t* zeros,     // (K/G, Np), or NULL
                                      void* out,                // (M, N) dtype
                                      int64_t M, int64_t N, int64_t K, int64_t group_size,
                                      int dtype, int variant, void* workspace,
                                      int64_t workspace_bytes, taper_stream_t stream) {
    (void)workspace, (void)workspace_bytes;
    if (variant != 0) return TAPER_CUDA_ERR_ARG;  // variant 1: not written yet
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

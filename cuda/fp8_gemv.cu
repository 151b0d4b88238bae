// FP8 block-scaled weights kept in FP8 for small M (issue 12, item 2; ABI in
// cutlass_ext/taper_cutlass.h): out (M, N) = x (M, K) W^T, W e4m3 codes (N, K) with one float
// scale per 128 x 128 block (the FP8 checkpoints' "block" kind), M <= 64, any sm80+ device.
//
// The trick: at small M a linear layer is a stream of its weight bytes, so the kernel reads each
// code once, from HBM, with 16-byte loads, and keeps them FP8 all the way to the registers (half
// the bytes of the dequantized bf16 weights cuBLAS would read). A warp owns kRows consecutive
// weight rows; lane j reads codes [16 j, 16 j + 16) of each row, then the next 512, ... (a warp
// load is 512 contiguous bytes per row); the codes are decoded to float in registers (exact) and
// each 16-code slice is dotted with the matching slice of kTile activation rows (L1/L2 hits: all
// warps of the device read the same few KB of x), fp32 accumulation. A 16-code slice never
// crosses a 128-column scale block (K % 128 == 0), and kRows divides 128, so the slice's partial
// dot product is multiplied by one block scale, shared by the warp's rows, before it is
// accumulated: scales applied in the kernel, never a dequantized copy. Activation rows come in
// tiles of kTile (registers: kTile x kRows accumulators); for M > kTile the warp walks its rows
// again per tile, re-reading them from L2 (they were read a moment before), so HBM still sees
// each weight byte once.
//
// The same arithmetic as the CPU path (dequantize to float, then an f32 GEMM) up to float
// rounding: sum_k x * (code * s) there, s * sum_{k in block} x * code here.
#include "common.cuh"
#include "../cutlass_ext/taper_cutlass.h"

namespace {

// 8 warps per block: 16 rows per block, so N = 4096 gives 256 blocks, about 2 per H100 SM, each
// SM then has 2 x 256 threads x 2 rows x 16 B = 16 KB of weight loads in flight per K step,
// what Little's law asks of an SM at ~25 GB/s per SM and ~600 ns of latency.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 2;          // weight rows per warp: each activation slice loaded feeds 2 rows
constexpr int kSlice = 16;        // codes per lane per step: one 16-byte load per row
constexpr int kBlock = 128;       // scale block edge
constexpr int kMaxM = 64;

// 16 e4m3 codes (one 16-byte load) as floats, element i from byte i (little endian).
__device__ __forceinline__ void decode16(const uint4 u, float f[16]) {
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const __nv_fp8x2_storage_t pair =
            (__nv_fp8x2_storage_t)(words[i / 2] >> (16 * (i & 1)) & 0xffffu);
        const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

// ---- kernels

// Warp w of block b owns rows n0 = (b * kWarps + w) * kRows and n0 + 1; activation rows are
// taken kTile at a time (kTile = 1, 2, 4 or 8: the smallest power of two >= M, at most 8).
template <typename T, int kTile>
__global__ void __launch_bounds__(kThreads)
    fp8_gemv_kernel(T* __restrict__ out,                // (M, N)
                    const T* __restrict__ x,            // (M, K)
                    const uint8_t* __restrict__ w,      // (N, K) e4m3
                    const float* __restrict__ scales,   // (ceil(N / 128), K / 128)
                    int M, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * kWarps + warp) * kRows;
    if (n0 >= N) return;  // whole warps leave; only warp shuffles follow
    const bool second = n0 + 1 < N;
    // n0 is even and 128 is a multiple of kRows: both rows share a row of scale blocks.
    const float* srow = scales + (int64_t)(n0 / kBlock) * (K / kBlock);
    const uint8_t* w0 = w + (int64_t)n0 * K;
    const uint8_t* w1 = second ? w0 + K : w0;  // a missing second row re-reads the first

    for (int m0 = 0; m0 < M; m0 += kTile) {
        float acc[kTile][kRows];
#pragma unroll
        for (int i = 0; i < kTile; i++)
#pragma unroll
            for (int r = 0; r < kRows; r++) acc[i][r] = 0.f;

#pragma unroll 2
        for (int k = lane * kSlice; k < K; k += 32 * kSlice) {
            float wf[kRows][kSlice];
            decode16(__ldg(reinterpret_cast<const uint4*>(w0 + k)), wf[0]);
            decode16(__ldg(reinterpret_cast<const uint4*>(w1 + k)), wf[1]);
            const float s = __ldg(srow + k / kBlock);
#pragma unroll
            for (int i = 0; i < kTile; i++) {
                if (m0 + i >= M) break;  // warp-uniform
                const T* xr = x + (int64_t)(m0 + i) * K + k;
                float xf[kSlice];
                taper::load8(xr, xf);
                taper::load8(xr + 8, xf + 8);
#pragma unroll
                for (int r = 0; r < kRows; r++) {
                    float d = 0.f;
#pragma unroll
                    for (int e = 0; e < kSlice; e++) d += xf[e] * wf[r][e];
                    acc[i][r] += s * d;
                }
            }
        }

#pragma unroll
        for (int i = 0; i < kTile; i++) {
            if (m0 + i >= M) break;
#pragma unroll
            for (int r = 0; r < kRows; r++) {
                const float v = taper::warp_sum(acc[i][r]);
                if (lane == r && (r == 0 || second))
                    out[(int64_t)(m0 + i) * N + n0 + r] = taper::from_float<T>(v);
            }
        }
    }
}

// ---- launchers

template <typename T, int kTile>
int launch(void* out, const void* x, const uint8_t* w, const float* scales, int64_t M, int64_t N,
           int64_t K, cudaStream_t stream) {
    const int64_t rows_per_block = (int64_t)kWarps * kRows;
    fp8_gemv_kernel<T, kTile><<<(unsigned)taper::ceil_div(N, rows_per_block), kThreads, 0,
                                stream>>>((T*)out, (const T*)x, w, scales, (int)M, (int)N,
                                          (int)K);
    return taper::launch_status();
}

template <typename T>
int dispatch_tile(void* out, const void* x, const uint8_t* w, const float* scales, int64_t M,
                  int64_t N, int64_t K, cudaStream_t stream) {
    if (M == 1) return launch<T, 1>(out, x, w, scales, M, N, K, stream);
    if (M == 2) return launch<T, 2>(out, x, w, scales, M, N, K, stream);
    if (M <= 4) return launch<T, 4>(out, x, w, scales, M, N, K, stream);
    return launch<T, 8>(out, x, w, scales, M, N, K, stream);
}

}  // namespace

extern "C" int taper_cuda_fp8_gemv(const void* x,         // (M, K) dtype
                                   const uint8_t* w,      // (N, K) e4m3
                                   const float* scales,   // (ceil(N / 128), K / 128)
                                   void* out,             // (M, N) dtype
                                   int64_t M, int64_t N, int64_t K, int dtype,
                                   taper_stream_t stream) {
    if (M < 0 || M > kMaxM || N < 1 || K < kBlock || K % kBlock != 0) return TAPER_CUDA_ERR_ARG;
    if (N > INT32_MAX / 2 || M * K > INT32_MAX || M * N > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    if (M == 0) return TAPER_CUDA_OK;
    if (!x || !w || !scales || !out) return TAPER_CUDA_ERR_ARG;
    // 16-byte loads of codes (rows are K % 128 == 0 bytes apart) and of activations.
    if (!taper::aligned16(x) || !taper::aligned16(w)) return TAPER_CUDA_ERR_ARG;
    const cudaStream_t st = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, E, return dispatch_tile<E>(out, x, w, scales, M, N, K, st));
    return TAPER_CUDA_ERR_ARG;
}

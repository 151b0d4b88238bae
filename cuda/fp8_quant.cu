// FP8 (OCP e4m3fn) conversions around the FP8 linear (issue 6, item 2; ABI in
// cutlass_ext/taper_cutlass.h, which says when each is used):
//  - dequantize: block-scaled e4m3 weights (N, K) to the activation dtype, once at load, for
//    GPUs without the sm90a FP8 GEMM (the linear is then the ordinary cuBLAS GEMM);
//  - quantize per token group: activations (M, K) to e4m3 codes with one float scale per token
//    and group of 128 columns, the A operand of the sm90a block-scaled GEMM.
//
// The trick, such as it is: both are memory-bound elementwise passes, so the only care is in the
// arithmetic matching the CPU's conventions exactly. Decoding is exact in float and the scale is
// applied with one float multiply (then one rounding to bf16/f16), as pyx/fp8_kernels.c does
// before its f32 GEMM. The quantizer divides with __fdiv_rn (IEEE, whatever the fast-math
// flags) both for amax / 448 and for x / scale, and encodes with taper::fp8_encode (round to
// nearest even, saturate to +-448, NaN kept), so tests/reference.py reproduces it bit for bit.
#include "common.cuh"
#include "../cutlass_ext/taper_cutlass.h"

namespace {

constexpr float kE4m3Max = 448.f;  // largest finite e4m3fn value

// 256 threads = 8 warps per block for both kernels: enough to keep loads in flight for a pass
// that does a few operations per byte, and small enough for the tail block to waste little.
constexpr int kThreads = 256;

// ---- kernels

// One thread per element; a block of kThreads consecutive elements of the row-major (N, K)
// matrix. Byte loads of the codes are coalesced (a warp reads 32 consecutive bytes).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fp8_dequantize_kernel(const uint8_t* __restrict__ w,     // (N, K) e4m3
                          const float* __restrict__ scales,  // (ceil(N / bn), ceil(K / bk))
                          T* __restrict__ out,               // (N, K)
                          int64_t N, int64_t K, int64_t bn, int64_t bk, int64_t KB) {
    const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (i >= N * K) return;
    const int64_t n = i / K, k = i - n * K;
    const float s = scales[(n / bn) * KB + k / bk];
    out[i] = taper::from_float<T>(taper::fp8_decode(w[i]) * s);
}

// One warp per (token, group): lane j handles columns j, j + 32, ... of the group. Pass 1 takes
// the group's max |x| (fmaxf ignores NaN), pass 2 re-reads the group (an L1/L2 hit: a group is
// at most a few hundred bytes) and writes the codes; lane 0 writes the scale.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fp8_quantize_group_kernel(const T* __restrict__ x,      // (M, K)
                              uint8_t* __restrict__ q,      // (M, K) e4m3
                              float* __restrict__ scales,   // (M, K / group)
                              int64_t num_groups, int64_t group) {
    const int64_t g = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
    if (g >= num_groups) return;  // whole warps leave together: no shuffle is left half-empty
    const int lane = threadIdx.x & 31;
    // Groups tile each row exactly (K % group == 0), so group g is elements [g*group, (g+1)*group)
    // of the flat (M, K) matrix and scales is (M * K / group,) in the same order.
    const T* xg = x + g * group;
    uint8_t* qg = q + g * group;
    float amax = 0.f;
    for (int64_t j = lane; j < group; j += 32) amax = fmaxf(amax, fabsf(taper::to_float(xg[j])));
    amax = taper::warp_max(amax);
    float s = __fdiv_rn(amax, kE4m3Max);
    s = s > 0.f ? s : 1.f;  // all-zero group (or amax / 448 underflowed): codes 0, scale 1
    for (int64_t j = lane; j < group; j += 32)
        qg[j] = taper::fp8_encode(__fdiv_rn(taper::to_float(xg[j]), s));
    if (lane == 0) scales[g] = s;
}

}  // namespace

// ---- launchers

extern "C" int taper_cuda_fp8_dequantize(const uint8_t* w, const float* scales, void* out,
                                         int64_t N, int64_t K, int64_t bn, int64_t bk, int dtype,
                                         taper_stream_t stream) {
    if (N < 0 || K < 0 || bn < 1 || bk < 1) return TAPER_CUDA_ERR_ARG;
    if (N == 0 || K == 0) return TAPER_CUDA_OK;
    const int64_t blocks = taper::ceil_div(N * K, kThreads);
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;  // grid.x limit: N * K >= 2^39
    const int64_t KB = taper::ceil_div(K, bk);
    cudaStream_t s = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, T,
        fp8_dequantize_kernel<T><<<(unsigned)blocks, kThreads, 0, s>>>(
            w, scales, static_cast<T*>(out), N, K, bn, bk, KB));
    return taper::launch_status();
}

extern "C" int taper_cuda_fp8_dequantize_blockwise(const uint8_t* w, const float* scales,
                                                   void* out, int64_t N, int64_t K, int dtype,
                                                   taper_stream_t stream) {
    return taper_cuda_fp8_dequantize(w, scales, out, N, K, 128, 128, dtype, stream);
}

extern "C" int taper_cuda_fp8_quantize_per_token_group(const void* x, uint8_t* q, float* scales,
                                                       int64_t M, int64_t K, int64_t group,
                                                       int dtype, taper_stream_t stream) {
    if (M < 0 || K < 0 || group < 1 || K % group) return TAPER_CUDA_ERR_ARG;
    if (M == 0 || K == 0) return TAPER_CUDA_OK;
    const int64_t num_groups = M * (K / group);
    const int64_t blocks = taper::ceil_div(num_groups, kThreads / 32);
    if (blocks > INT32_MAX) return TAPER_CUDA_ERR_ARG;
    cudaStream_t s = (cudaStream_t)stream;
    TAPER_DISPATCH_DTYPE(dtype, T,
        fp8_quantize_group_kernel<T><<<(unsigned)blocks, kThreads, 0, s>>>(
            static_cast<const T*>(x), q, scales, num_groups, group));
    return taper::launch_status();
}

// Shared device helpers for cuda/*.cu: element loads and stores in float for the three
// activation types, FP8 e4m3 encode/decode, warp reductions, and the launch-status helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "taper_cuda.h"

namespace taper {

// ---- element types: every kernel computes in float and templates on the stored type

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}

// FP8 e4m3fn (DESIGN.md section 5): round to nearest even, saturate finite values to +-448,
// keep NaN. __NV_SATFINITE saturates +-inf to +-448 too, which is the contract.
__device__ __forceinline__ uint8_t fp8_encode(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float fp8_decode(uint8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

// ---- reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; `scratch` holds 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// ---- launch status

// The status of the launch just made: a configuration error shows here, not at the launch.
inline int launch_status() { return (int)cudaGetLastError(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace taper

// Calls F<T>(args...) for the activation type code `dtype`; an unknown code is an argument error.
#define TAPER_DISPATCH_DTYPE(dtype, T, ...)                        \
    switch (dtype) {                                               \
        case TAPER_DT_F32: { using T = float; __VA_ARGS__; break; }          \
        case TAPER_DT_BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
        case TAPER_DT_F16: { using T = __half; __VA_ARGS__; break; }         \
        default: return TAPER_CUDA_ERR_ARG;                        \
    }

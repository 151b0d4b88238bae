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

// ---- vector access: 16-byte loads and stores where the launcher found the pointers aligned

inline bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// N elements loaded or stored with one instruction; A is the alignment the access may assume.
template <typename T, int N, int A = sizeof(T) * N>
struct alignas(A) Pack {
    T v[N];
};

// N floats: float4 loads when N is a multiple of 4 (the launcher checked the alignment).
template <int N>
__device__ __forceinline__ void load_f32(const float* p, float (&w)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int j = 0; j < N; j += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + j);
            w[j] = f.x, w[j + 1] = f.y, w[j + 2] = f.z, w[j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; j++) w[j] = p[j];
    }
}

// 8 consecutive elements at p (16-byte aligned; 8-byte for e4m3 codes) as floats.
__device__ __forceinline__ void load8(const float* p, float f[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float f[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}
__device__ __forceinline__ void load8(const __half* p, float f[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 x = __half22float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

// e4m3 codes, element i in byte i (little endian); the scale is applied by the caller.
__device__ __forceinline__ void load8(const uint8_t* p, float f[8]) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t w = i < 2 ? u.x : u.y;
        const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(w >> (16 * (i & 1)) & 0xffffu);
        const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

// ---- tensor cores

// c += a (16x16, row major) * b (16x8, column major), f32 accumulators. mma.sync m16n8k16 with
// 16-bit inputs exists from sm_80 on and runs unchanged on sm_90a (Hopper keeps the warp-level
// MMA path beside wgmma), so one kernel serves both targets.
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // launchers never run mma kernels below sm_80 (they are not compiled for it)
#endif
}
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1,
                                          __half*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
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

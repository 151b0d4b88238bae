// Warp-level tensor-core helpers shared by the prefill attention kernels
// (attention_prefill_fa2.cu, _fa3.cu), the MoE grouped GEMM (moe.cu) and the W4A16 GEMM
// (marlin.cu): mma.sync m16n8k16 on bf16/f16 with f32 accumulators, ldmatrix, cp.async, and
// 16-bit pair packing. All of them exist from sm_80 on and run unchanged on sm_90a
// (Hopper keeps the warp-level MMA path beside wgmma); below sm_80 they trap, and the launchers
// never run them there (Taper compiles for sm_80 and up).
#pragma once

#include "common.cuh"

namespace taper {

__device__ __forceinline__ uint32_t pack_pair(float lo, float hi, __nv_bfloat16*) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) is the low half
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi, __half*) {
    __half2 v = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

// c += a (16x16, row major) * b (16x8, column major), f32 accumulators.
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16*) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
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

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// Four 8x8 16-bit matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix
// i, and register i receives matrix i in the mma fragment layout (lane l: row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1). The .trans form transposes each matrix on the way.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#else
    __trap();
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#else
    __trap();
#endif
}

// 16 bytes global -> shared without passing through registers; with `valid` false nothing is
// read and the 16 bytes are zero-filled (src-size 0), so `src` only has to be some valid pointer.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
#else
    __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// 2^x by the SFU (ex2.approx, flush-to-zero): 2^-inf = +0, as the online softmax needs.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace taper

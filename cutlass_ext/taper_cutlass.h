/* Taper FP8 kernels (issue 6, item 2): the C ABI of cutlass_ext/fp8_block_gemm.cu and
 * cuda/fp8_quant.cu, in the style of cuda/taper_cuda.h (whose status codes, dtype codes and
 * taper_stream_t it uses). Launchers take device pointers, sizes, a workspace where they need
 * one and a stream; they return 0, TAPER_CUDA_ERR_ARG for arguments or a device they cannot run
 * with, or a cudaError_t. They never allocate and never synchronize.
 *
 * FP8 here is OCP e4m3fn (DESIGN.md section 5), one code per byte; a value is
 * decode(code) * scale. Weights (N, K) carry one float scale per 128 x 128 block,
 * scales (ceil(N/128), ceil(K/128)) row-major (pyx/weights/fp8.py's "block" kind, DeepSeek-V3 /
 * Qwen3-FP8); activations (M, K) carry one float scale per token and group of 128 columns,
 * scales (M, K/128) row-major (taper_cuda_fp8_quantize_per_token_group makes them).
 *
 * Which path runs the FP8 linear:
 *  - sm90a (H100/H200, compute capability exactly 9.0): quantize the activations per token
 *    group, then taper_cutlass_fp8_block_gemm (FP8 tensor cores, both scales applied in the main
 *    loop, bf16 out).
 *  - sm80 / sm86 / sm89 (and sm90 shapes the CUTLASS kernel refuses): the weights are decoded once,
 *    at load, to the activation dtype with taper_cuda_fp8_dequantize_blockwise and the linear is
 *    the ordinary cuBLAS GEMM. The simple choice: it costs 2 bytes per weight instead of 1, which
 *    the FP8 checkpoints that fit such a GPU at bf16 allow (an 8B model is 16 GB in bf16), and
 *    cuBLAS's bf16 GEMM is then as fast as the device goes. Decoding the codes in the GEMM's main
 *    loop (Marlin-style, 1 byte per weight read at decode) is the tuned alternative, not done.
 */
#ifndef TAPER_CUTLASS_H
#define TAPER_CUTLASS_H

#include <stdint.h>

#include "taper_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- cutlass_ext/fp8_block_gemm.cu: sm90a only.
 *
 * out[m, n] = sum over k blocks kb of a_scales[m, kb] * b_scales[n / 128, kb]
 *                                     * sum_{k in kb} decode(a[m, k]) * decode(b[n, k]),
 * float accumulation (each 128-deep block's wgmma sum is promoted to a float accumulator and
 * scaled there), rounded once to bf16.
 * Requirements, else TAPER_CUDA_ERR_ARG: the current device has compute capability 9.0 and
 * this library was built for sm_90a; K > 0 and K % 128 == 0 (the activation groups, and no
 * partial K tile, which the block-scaled main loop does not handle); N % 8 == 0 (16-byte rows of
 * out for TMA); M, N, K < 2^31; a, b and out 16-byte aligned (TMA), the scales 4-byte aligned;
 * workspace_bytes at least taper_cutlass_fp8_block_gemm_workspace_bytes(M, N, K). Any M >= 1,
 * and N need not be a multiple of 128: TMA zero-fills the partial tiles' loads and clips their
 * stores. M == 0 or N == 0 returns 0 without launching. */

/* Bytes of workspace for (M, N, K) on the current device; 0 with the data-parallel tile
 * scheduler compiled today (kept in the ABI so that a split-K / stream-K schedule can need one). */
int64_t taper_cutlass_fp8_block_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K);

int taper_cutlass_fp8_block_gemm(const uint8_t* a,         // (M, K) e4m3 activations
                                 const float* a_scales,    // (M, K / 128)
                                 const uint8_t* b,         // (N, K) e4m3 weight
                                 const float* b_scales,    // (ceil(N / 128), K / 128)
                                 void* out,                // (M, N) bf16
                                 int64_t M, int64_t N, int64_t K, void* workspace,
                                 int64_t workspace_bytes, taper_stream_t stream);

/* ---- cuda/fp8_quant.cu: any sm80+ device */

/* out[n, k] = dtype(decode(w[n, k]) * scales[n / bn, k / bk]): the float product (exact
 * decode, one rounding) rounded to nearest even to dtype (F32, BF16 or F16), i.e. the float32
 * of tests/reference.py fp8_block_dequantize, then cast. scales is (ceil(N / bn), ceil(K / bk))
 * row-major: bn = bk = 128 for block weights, bn = 1 and bk = K for per-channel ones. */
int taper_cuda_fp8_dequantize(const uint8_t* w,      // (N, K) e4m3
                              const float* scales,   // (ceil(N / bn), ceil(K / bk))
                              void* out,             // (N, K) dtype
                              int64_t N, int64_t K, int64_t bn, int64_t bk, int dtype,
                              taper_stream_t stream);

/* taper_cuda_fp8_dequantize with 128 x 128 blocks. */
int taper_cuda_fp8_dequantize_blockwise(const uint8_t* w,     // (N, K) e4m3
                                        const float* scales,  // (ceil(N / 128), ceil(K / 128))
                                        void* out,            // (N, K) dtype
                                        int64_t N, int64_t K, int dtype, taper_stream_t stream);

/* Per token and group of `group` columns (K % group == 0, else TAPER_CUDA_ERR_ARG):
 * amax = max |x| over the group, NaN ignored; s = amax / 448 in float (IEEE division), and
 * s = 1 where that is not > 0 (an all-zero group, or amax / 448 underflowing); scales[m, g] = s;
 * q = e4m3(x / s) (IEEE division, round to nearest even, saturated to +-448, NaN kept).
 * tests/reference.py fp8_quantize_per_token_group is the reference, bit for bit. */
int taper_cuda_fp8_quantize_per_token_group(const void* x,  // (M, K) dtype
                                            uint8_t* q,     // (M, K) e4m3
                                            float* scales,  // (M, K / group)
                                            int64_t M, int64_t K, int64_t group, int dtype,
                                            taper_stream_t stream);

/* ---- cuda/fp8_gemv.cu: any sm80+ device, small M (the weights stay e4m3 at rest and in flight)
 *
 * out (M, N) = x (M, K) W^T for 0 <= M <= 64 with W e4m3 codes (N, K) and 128 x 128 block scales
 * (ceil(N / 128), K / 128): each code read once with 16-byte loads, decoded in registers, the
 * block scale applied to each 16-code partial dot product, float accumulation, out rounded to
 * dtype (F32, BF16 or F16, as x). K % 128 == 0 and x, w 16-byte aligned, else
 * TAPER_CUDA_ERR_ARG. Reference: tests/reference.py fp8_block_dequantize, then x W^T. */
int taper_cuda_fp8_gemv(const void* x,        // (M, K) dtype
                        const uint8_t* w,     // (N, K) e4m3
                        const float* scales,  // (ceil(N / 128), K / 128)
                        void* out,            // (M, N) dtype
                        int64_t M, int64_t N, int64_t K, int dtype, taper_stream_t stream);

#ifdef __cplusplus
}
#endif

#endif

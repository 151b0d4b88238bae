/* Taper FP8 weight kernels: out = x @ dequant(W).T (+ bias) with W kept as OCP e4m3 codes and one
 * f32 scale per (bn x bk) block of W, the layout of FP8 block-wise checkpoints (DeepSeek-V3,
 * Qwen3-FP8: `weight_scale_inv` with bn = bk = 128). Per-channel scales are bn = 1, bk = K; a
 * per-tensor scale is stored per channel. Activations stay f32; accumulation is f32.
 *
 * Same conventions as cpu_kernels.h: raw pointers, sizes and a thread count in, an int status out
 * (TAPER_OK / TAPER_ERR_*), shapes validated by the Cython caller (pyx/fp8.pyx), ISA path an
 * argument (TAPER_ISA_*).
 */
#ifndef TAPER_FP8_KERNELS_H
#define TAPER_FP8_KERNELS_H

#include <stdint.h>

#include "cpu_kernels.h"  // status codes and ISA ids only

int taper_fp8_isa_supported(int isa);

/* W's block scales apply per (row block n / bn, column block k / bk); N % bn == 0, bk >= 1
 * (a last, shorter column block when K % bk != 0). */
int taper_fp8_linear(int isa,
                     const float* x,      // (T, K)
                     const uint8_t* w,    // (N, K) e4m3 codes
                     const float* scale,  // (N / bn, ceil(K / bk))
                     int64_t bn, int64_t bk,
                     const float* bias,   // (N,) or NULL
                     float* out,          // (T, N)
                     int64_t T, int64_t K, int64_t N,
                     int batch_invariant,  // != 0: the packed GEMM for every T (row bits independent of T)
                     int nthreads);

/* dst = decode(src) with the ISA path's decoder (exposed for tests over all 256 codes). */
int taper_fp8_decode(int isa, const uint8_t* src, float* dst, int64_t n);
/* dst = e4m3(src): round to nearest even, saturating to +-448, NaN -> NaN. */
void taper_fp8_encode(const float* src, uint8_t* dst, int64_t n);

#endif

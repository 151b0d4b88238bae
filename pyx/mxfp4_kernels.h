/* Taper MXFP4 (OCP microscaling FP4) dequantization: the GPT-OSS checkpoints' expert weights,
 * unpacked once at load into the checkpoint's float dtype (engine/loader/quant_mxfp4.py says the
 * layout). Same conventions as cpu_kernels.h: raw pointers, sizes and a thread count in, an int
 * status out; shapes validated by the Cython caller (pyx/mxfp4.pyx).
 */
#ifndef TAPER_MXFP4_KERNELS_H
#define TAPER_MXFP4_KERNELS_H

#include <stdint.h>

#include "cpu_kernels.h"  // status codes and dtype ids only

/* out[e, 32 g + j, r] = E2M1(code j of blocks[e, r, g]) * 2^(scales[e, r, g] - 127), computed in
 * f32 (exact: a code has 2 significant bits) and stored as out_dtype (TAPER_F32 / TAPER_BF16 /
 * TAPER_F16, the last rounded to nearest even). Scale 255 (E8M0's NaN) is read as 2^128, as
 * transformers' ldexp reads it: +-0.5 * 2^128 is finite, larger codes inf, zero zero. */
int taper_mxfp4_dequantize(const uint8_t* blocks,   // (E, R, G, 16)
                           const uint8_t* scales,   // (E, R, G)
                           int64_t E, int64_t R, int64_t G,
                           int out_dtype, void* out, // (E, 32 G, R)
                           int nthreads);

#endif

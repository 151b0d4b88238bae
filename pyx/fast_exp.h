/* fast_expf: a float exp that vectorizes in `omp simd` loops (libm's expf does not without
 * -ffast-math). Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a degree-6 Taylor polynomial
 * (truncation error < 2e-7 relative) and 2^n built in the exponent bits. Shared by the row
 * kernels (cpu_kernels.c) and MLA's decode attention (mla_kernels.c). */
#ifndef TAPER_FAST_EXP_H
#define TAPER_FAST_EXP_H

#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : x;  // also maps -inf to ~1.6e-38 (never a NaN)
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504f;
    float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest via the 1.5 * 2^23 trick
    float r = x - n * 0.693145752f - n * 1.42860677e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f +
              r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, 4);
    return p;
}

#endif

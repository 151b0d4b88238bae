/* MXFP4 dequantization (pyx/mxfp4_kernels.h). One (expert, block column) pair a task: its 32
 * output rows are written as 32 sequential streams over R, which keeps the transpose
 * cache-friendly without a scratch matrix. */
#include "mxfp4_kernels.h"

#include <math.h>
#include <string.h>

// E2M1 codes 0..15: sign bit 8, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 (transformers' FP4_VALUES)
static const float FP4_VALUES[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
#define BLOCK 32
#define E8M0_BIAS 127

static inline void store(int dtype, void* out, int64_t i, float v) {
    if (dtype == TAPER_F32) {
        ((float*)out)[i] = v;
    } else if (dtype == TAPER_BF16) {
        // a code times a power of two has its low 16 bits zero (normal or subnormal, inf, the
        // ldexp NaN): truncation is exact, so it equals round-to-nearest-even
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        ((uint16_t*)out)[i] = (uint16_t)(bits >> 16);
    } else {
        _Float16 h = (_Float16)v;  // round to nearest even, overflow to inf, as NumPy's astype
        memcpy((uint16_t*)out + i, &h, sizeof h);
    }
}

int taper_mxfp4_dequantize(const uint8_t* blocks, const uint8_t* scales, int64_t E, int64_t R,
                           int64_t G, int out_dtype, void* out, int nthreads) {
    if (E < 0 || R < 0 || G < 0 || nthreads < 1) return TAPER_ERR_ARG;
    if (out_dtype != TAPER_F32 && out_dtype != TAPER_BF16 && out_dtype != TAPER_F16)
        return TAPER_ERR_ARG;
    const int64_t K = G * BLOCK, tasks = E * G;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t e = t / G, g = t % G;
        const int64_t first = (e * K + g * BLOCK) * R;   // out[e, 32 g, 0]
        for (int64_t r = 0; r < R; r++) {
            const int64_t block = (e * R + r) * G + g;
            const uint8_t* codes = blocks + block * (BLOCK / 2);
            // code * 2^(s - 127) as transformers' ldexp: through 2^(s - 128), finite for every
            // s (2^-128 up to 2^127), then * 2, so that s = 255 keeps 0.5 * 2^128 finite and a
            // zero code zero; every product is exact short of overflow
            const float half = ldexpf(1.0f, (int)scales[block] - E8M0_BIAS - 1);
            for (int j = 0; j < BLOCK / 2; j++) {   // the low nibble is the even element
                const float lo = FP4_VALUES[codes[j] & 0x0F], hi = FP4_VALUES[codes[j] >> 4];
                store(out_dtype, out, first + (2 * j) * R + r, lo * half * 2.0f);
                store(out_dtype, out, first + (2 * j + 1) * R + r, hi * half * 2.0f);
            }
        }
    }
    return TAPER_OK;
}

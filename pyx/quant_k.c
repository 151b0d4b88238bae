/* ggml's K quants, Q2_K Q3_K Q4_K Q5_K Q6_K, and Q8_K, the activation format their dot products
 * take. A super-block holds 256 elements in 16 groups of 16 (Q2_K, Q3_K, Q6_K) or 8 groups of 32
 * (Q4_K, Q5_K); each group has a small integer scale (and for Q2/Q4/Q5 a minimum) that is itself
 * quantized against one or two f16 super-block scales.
 *
 * Per type: a scalar dequantizer (ggml's dequantize_row_*, the test oracle; same float operations
 * in the same order, so results are bit-identical), llama.cpp's reference quantizer without an
 * importance matrix (quantize_row_*_ref: make_qkx2_quants / make_q3_quants / make_qx_quants; the
 * float expressions keep ggml's evaluation order, which is what makes the output byte-identical
 * to llama.cpp's), and vec_dot against a Q8_K row.
 *
 * The vec_dot trick: every weight quant is unpacked to an unsigned byte u (0..2^b-1), so one
 * integer product sum P_g = sum(u * q8) per group serves every type; the signed types (Q3_K:
 * u - 4, Q6_K: u - 32) and the minimum terms (Q2/Q4/Q5) are corrected with Q8_K's bsums (sums of
 * q8 per 16 elements). All of that is exact int32 arithmetic per super-block; floats enter once
 * per super-block in `kacc`, in the same order on every ISA, so the AVX2 and AVX-512 bodies
 * (maddubs + madd, as ggml's AVX2 path; no VNNI) return exactly the scalar body's value.
 * Ranges: u <= 63 and |q8| <= 127, so maddubs' int16 pair sums (<= 16002) never saturate, and
 * every int32 partial sum of a super-block stays below 2^29.
 *
 * x86 only (immintrin.h; the scale decoders read bytes as little-endian words).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant_internal.h"

#define QK_K TAPER_QK_K
#define KMIN(a, b) ((a) < (b) ? (a) : (b))
#define KMAX(a, b) ((a) > (b) ? (a) : (b))
#define INLINE static inline __attribute__((always_inline))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define GROUP_MAX_EPS 1e-15f  /* ggml's threshold for an all-zero group */

typedef taper_block_q2_K bq2_K;
typedef taper_block_q3_K bq3_K;
typedef taper_block_q4_K bq4_K;
typedef taper_block_q5_K bq5_K;
typedef taper_block_q6_K bq6_K;
typedef taper_block_q8_K bq8_K;

#define H2F(h) taper_half_to_float(h)
#define F2H(f) taper_float_to_half(f)

// ----------------------------------------------------------------------------
// ---- helpers shared by the quantizers

/* Round to nearest, ties to even, by ggml's magic-number trick rather than lrintf: identical for
 * |f| < 2^22, and outside that range (garbage in) it gives the same garbage as llama.cpp. */
static inline int nearest_int(float f) {
    float v = f + 12582912.f;  /* 1.5 * 2^23: the integer lands in the low mantissa bits */
    int i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* Q6_K's group quantizer (ggml's make_qx_quants with rmse_type 1 and no importance weights):
 * symmetric levels in [-nmax, nmax-1], weights x^2, the scale refined over 18 nearby inverse
 * scales by least squares. L gets level + nmax. Returns the scale (negative when the largest
 * magnitude is negative: the extreme element is mapped to -nmax, the side with one more level). */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = KMAX(-nmax, KMIN(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * x[i]);
            l = KMAX(-nmax, KMIN(nmax - 1, l));
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {  /* better weighted fit */
            for (int i = 0; i < n; i++) {
                const int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + KMAX(-nmax, KMIN(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's group quantizer (ggml's make_q3_quants with do_rmse): start from the max-magnitude
 * scale, then up to 5 passes of coordinate descent, each level moved to its best value given the
 * others if that lowers the x^2-weighted error. L gets level + nmax. */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = KMAX(-nmax, KMIN(nmax - 1, l));
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = nearest_int(x[i] * sl2 / slx);
                new_l = KMAX(-nmax, KMIN(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    /* sumlx^2 / suml2 is the explained energy: keep the move if it grows */
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Q2/Q4/Q5_K's group quantizer (ggml's make_qkx2_quants): levels 0..nmax with a scale and a
 * minimum (min <= 0, returned negated in *the_min), searching nstep+1 inverse scales around
 * nmax / (max - min) and fitting scale and min to each candidate by weighted least squares;
 * the error is |diff| (use_mad) or diff^2, weighted. Laux is scratch of n bytes. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              int use_mad) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        const float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)KMAX(0, KMIN(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    if (nstep < 1) {
        *the_min = -min;
        return scale;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * (x[i] - min));
            l = KMAX(0, KMIN(nmax, l));
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {  /* the fit wants a positive offset: pin min to 0 instead */
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; i++) L[i] = Laux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* Q4_K/Q5_K's 12 scale bytes: 8 six-bit scales and 8 six-bit mins. Groups 0-3 keep theirs in
 * the low 6 bits of bytes 0-3 (scale) and 4-7 (min); groups 4-7 keep the low 4 bits in the two
 * nibbles of bytes 8-11 and the top 2 bits in the spare top bits of bytes 0-7. */
static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* The same 16 bytes as 8 scales then 8 mins, four groups per 32-bit word (x86 is little-endian:
 * byte k of word w is scale byte 4w + k), without the branch per group. */
static inline void k4_scales(const uint8_t *packed, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a[3];
    memcpy(a, packed, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const uint32_t s[2] = {a[0] & low6, (a[2] & low4) | (((a[0] >> 6) & low2) << 4)};
    const uint32_t m[2] = {a[1] & low6, ((a[2] >> 4) & low4) | (((a[1] >> 6) & low2) << 4)};
    memcpy(sc, s, 8);
    memcpy(mn, m, 8);
}

/* Q3_K's 12 scale bytes: 16 six-bit scales stored +32. Low nibbles: bytes 0-7 (groups 0-7 in
 * the low nibble, 8-15 in the high one); top 2 bits: bytes 8-11, group j at bits 2*(j/4).
 * Decoded four groups per 32-bit word as in k4_scales. */
static inline void q3_K_scales_u(const uint8_t *s, uint32_t o[4]) {  /* +32, 4 per word */
    uint32_t a[3];
    memcpy(a, s, 12);
    const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
    o[0] = (a[0] & low4) | (((a[2] >> 0) & low2) << 4);
    o[1] = (a[1] & low4) | (((a[2] >> 2) & low2) << 4);
    o[2] = ((a[0] >> 4) & low4) | (((a[2] >> 4) & low2) << 4);
    o[3] = ((a[1] >> 4) & low4) | (((a[2] >> 6) & low2) << 4);
}

static inline void q3_K_scales(const uint8_t *s, int8_t out[16]) {
    uint32_t o[4];
    uint8_t u[16];
    q3_K_scales_u(s, o);
    memcpy(u, o, 16);
    for (int j = 0; j < 16; j++) out[j] = (int8_t)(u[j] - 32);
}

// ----------------------------------------------------------------------------
// ---- Q2_K: 2-bit levels, 16 groups of 16 with a 4-bit scale and a 4-bit min each

static void quantize_q2_K(const float *x, void *dst, int64_t n) {
    bq2_K *y = dst;
    uint8_t L[QK_K], Laux[16];
    float weights[16], mins[QK_K / 16], scales[QK_K / 16];
    const float q4scale = 15.f;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float max_scale = 0, max_min = 0;  /* the min is subtracted, so scales are >= 0 */
        for (int j = 0; j < QK_K / 16; j++) {
            for (int l = 0; l < 16; l++) weights[l] = fabsf(x[16 * j + l]);
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux,
                                         -0.5f, 0.1f, 15, 1);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = q4scale / max_scale;
            for (int j = 0; j < QK_K / 16; j++) y[i].scales[j] = (uint8_t)nearest_int(iscale * scales[j]);
            y[i].d = F2H(max_scale / q4scale);
        } else {
            for (int j = 0; j < QK_K / 16; j++) y[i].scales[j] = 0;
            y[i].d = F2H(0.f);
        }
        if (max_min > 0) {
            const float iscale = q4scale / max_min;
            for (int j = 0; j < QK_K / 16; j++)
                y[i].scales[j] |= (uint8_t)(nearest_int(iscale * mins[j]) << 4);
            y[i].dmin = F2H(max_min / q4scale);
        } else {
            y[i].dmin = F2H(0.f);
        }
        /* requantize against the rounded scales; a group whose scale rounded to 0 keeps the
           levels make_qkx2_quants chose (ggml does the same, and they dequantize to -min) */
        for (int j = 0; j < QK_K / 16; j++) {
            const float d = H2F(y[i].d) * (y[i].scales[j] & 0xF);
            if (!d) continue;
            const float dm = H2F(y[i].dmin) * (y[i].scales[j] >> 4);
            for (int ii = 0; ii < 16; ii++) {
                const int l = nearest_int((x[16 * j + ii] + dm) / d);
                L[16 * j + ii] = (uint8_t)KMAX(0, KMIN(3, l));
            }
        }
        /* byte l of each 32-byte half holds elements l, l+32, l+64, l+96 of its 128 */
        for (int j = 0; j < QK_K; j += 128)
            for (int l = 0; l < 32; l++)
                y[i].qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) |
                                               (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
}

static void dequantize_q2_K(const void *src, float *y, int64_t n) {
    const bq2_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = H2F(x[i].d), min = H2F(x[i].dmin);
        const uint8_t *q = x[i].qs;
        int is = 0;
        for (int h = 0; h < QK_K; h += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++) {
                    const uint8_t sc = x[i].scales[is++];
                    const float dl = d * (sc & 0xF), ml = min * (sc >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * ((q[16 * half + l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/* element e of the super-block as an unsigned level: chunk c = e / 32 is shift 2*(c%4) of the
   32 bytes qs[32*(c/4) ...] */
static void unpack_q2_K(const bq2_K *b, uint8_t *u) {
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < 32; l++) u[32 * c + l] = (b->qs[32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
}

// ----------------------------------------------------------------------------
// ---- Q3_K: 3-bit signed levels (-4..3), 16 groups of 16 with a signed 6-bit scale

static void quantize_q3_K(const float *x, void *dst, int64_t n) {
    bq3_K *y = dst;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < QK_K / 16; j++) {
            scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
            const float scale = fabsf(scales[j]);
            if (scale > amax) { amax = scale; max_scale = scales[j]; }
        }
        memset(y[i].scales, 0, 12);
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < QK_K / 16; j++) {
                int8_t l = (int8_t)nearest_int(iscale * scales[j]);
                l = (int8_t)(KMAX(-32, KMIN(31, l)) + 32);
                if (j < 8) y[i].scales[j] = l & 0xF;
                else y[i].scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
                l >>= 4;
                y[i].scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
            }
            y[i].d = F2H(1 / iscale);
        } else {
            y[i].d = F2H(0.f);
        }
        int8_t sc[16];
        q3_K_scales(y[i].scales, sc);
        for (int j = 0; j < QK_K / 16; j++) {
            const float d = H2F(y[i].d) * sc[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++) {
                const int l = nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(KMAX(-4, KMIN(3, l)) + 4);
            }
        }
        /* bit 2 of the level goes to hmask: element e at byte e % 32, bit e / 32 */
        memset(y[i].hmask, 0, QK_K / 8);
        for (int j = 0; j < QK_K; j++) {
            if (L[j] > 3) {
                y[i].hmask[j % 32] |= (uint8_t)(1 << (j / 32));
                L[j] -= 4;
            }
        }
        for (int j = 0; j < QK_K; j += 128)
            for (int l = 0; l < 32; l++)
                y[i].qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) |
                                               (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
}

static void dequantize_q3_K(const void *src, float *y, int64_t n) {
    const bq3_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d_all = H2F(x[i].d);
        int8_t sc[16];
        q3_K_scales(x[i].scales, sc);
        const uint8_t *q = x[i].qs, *hm = x[i].hmask;
        int is = 0;
        uint8_t m = 1;
        for (int h = 0; h < QK_K; h += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
                for (int half = 0; half < 2; half++) {
                    const float dl = d_all * sc[is++];
                    for (int l = 16 * half; l < 16 * half + 16; l++)
                        *y++ = dl * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
            }
        }
    }
}

/* unsigned level 0..7 = stored 2 bits + 4 * hmask bit; the value is u - 4 */
static void unpack_q3_K(const bq3_K *b, uint8_t *u) {
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < 32; l++)
            u[32 * c + l] = (uint8_t)(((b->qs[32 * (c / 4) + l] >> (2 * (c % 4))) & 3) |
                                      (((b->hmask[l] >> c) & 1) << 2));
}

// ----------------------------------------------------------------------------
// ---- Q4_K and Q5_K: 4/5-bit levels, 8 groups of 32 with a 6-bit scale and a 6-bit min

/* The part the two share: per-group fits, the packed 6-bit scales and mins, and the levels
   requantized against the rounded scales. nmax is 15 or 31; the search ranges are ggml's. */
static void quantize_k4_scales(const float *x, int nmax, float rmin, int nstep, taper_half *dd,
                               taper_half *dmin, uint8_t *packed, uint8_t *L) {
    uint8_t Laux[32];
    float weights[32], mins[QK_K / 32], scales[QK_K / 32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; j++) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = KMIN(63, ls);
        lm = KMIN(63, lm);
        if (j < 4) {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            packed[j - 4] |= (uint8_t)((ls >> 4) << 6);
            packed[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *dd = F2H(max_scale / 63.f);
    *dmin = F2H(max_min / 63.f);
    for (int j = 0; j < QK_K / 32; j++) {
        uint8_t sc, m;
        get_scale_min_k4(j, packed, &sc, &m);
        const float d = H2F(*dd) * sc;
        if (!d) continue;
        const float dm = H2F(*dmin) * m;
        for (int ii = 0; ii < 32; ii++) {
            const int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)KMAX(0, KMIN(nmax, l));
        }
    }
}

static void quantize_q4_K(const float *x, void *dst, int64_t n) {
    bq4_K *y = dst;
    uint8_t L[QK_K];
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        memset(y[i].scales, 0, 12);
        quantize_k4_scales(x, 15, -1.f, 20, &y[i].d, &y[i].dmin, y[i].scales, L);
        /* 32 bytes per 64 elements: element l in the low nibble, l + 32 in the high one */
        for (int j = 0; j < QK_K; j += 64)
            for (int l = 0; l < 32; l++)
                y[i].qs[j / 2 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
    }
}

static void quantize_q5_K(const float *x, void *dst, int64_t n) {
    bq5_K *y = dst;
    uint8_t L[QK_K];
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        memset(y[i].scales, 0, 12);
        quantize_k4_scales(x, 31, -0.5f, 15, &y[i].d, &y[i].dmin, y[i].scales, L);
        /* low nibbles as Q4_K; bit 4 of element e goes to qh[e % 32], bit e / 32 */
        memset(y[i].qh, 0, QK_K / 8);
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; l++) {
                int l1 = L[j + l], l2 = L[j + l + 32];
                if (l1 > 15) { l1 -= 16; y[i].qh[l] |= (uint8_t)(1 << (j / 32)); }
                if (l2 > 15) { l2 -= 16; y[i].qh[l] |= (uint8_t)(2 << (j / 32)); }
                y[i].qs[j / 2 + l] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

static void dequantize_q4_K(const void *src, float *y, int64_t n) {
    const bq4_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = H2F(x[i].d), min = H2F(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int is = 0; is < 8; is += 2, q += 32) {
            uint8_t sc, m;
            get_scale_min_k4(is + 0, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            get_scale_min_k4(is + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

static void dequantize_q5_K(const void *src, float *y, int64_t n) {
    const bq5_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = H2F(x[i].d), min = H2F(x[i].dmin);
        const uint8_t *ql = x[i].qs, *qh = x[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int is = 0; is < 8; is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            get_scale_min_k4(is + 0, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            get_scale_min_k4(is + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

static void unpack_q4_K(const bq4_K *b, uint8_t *u) {
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < 32; l++) u[32 * c + l] = (b->qs[32 * (c / 2) + l] >> (4 * (c % 2))) & 0xF;
}

static void unpack_q5_K(const bq5_K *b, uint8_t *u) {
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < 32; l++)
            u[32 * c + l] = (uint8_t)(((b->qs[32 * (c / 2) + l] >> (4 * (c % 2))) & 0xF) |
                                      (((b->qh[l] >> c) & 1) << 4));
}

// ----------------------------------------------------------------------------
// ---- Q6_K: 6-bit signed levels (-32..31), 16 groups of 16 with an int8 scale

static void quantize_q6_K(const float *x, void *dst, int64_t n) {
    bq6_K *y = dst;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < QK_K / 16; ib++) {
            const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
            scales[ib] = scale;
            if (fabsf(scale) > max_abs_scale) { max_abs_scale = fabsf(scale); max_scale = scale; }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -128.f / max_scale;
        y[i].d = F2H(1 / iscale);
        for (int ib = 0; ib < QK_K / 16; ib++)
            y[i].scales[ib] = (int8_t)KMIN(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < QK_K / 16; j++) {
            const float d = H2F(y[i].d) * y[i].scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++) {
                const int l = nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(KMAX(-32, KMIN(31, l)) + 32);
            }
        }
        /* per 128 elements: ql[l] = e l | e l+64 << 4, ql[l+32] = e l+32 | e l+96 << 4, and the
           top 2 bits of e l, l+32, l+64, l+96 in qh[l] at bits 0, 2, 4, 6 */
        uint8_t *ql = y[i].ql, *qh = y[i].qh;
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                const uint8_t a = (uint8_t)L[j + l], b = (uint8_t)L[j + l + 32];
                const uint8_t c = (uint8_t)L[j + l + 64], e = (uint8_t)L[j + l + 96];
                ql[l] = (uint8_t)((a & 0xF) | ((c & 0xF) << 4));
                ql[l + 32] = (uint8_t)((b & 0xF) | ((e & 0xF) << 4));
                qh[l] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
            }
        }
    }
}

static void dequantize_q6_K(const void *src, float *y, int64_t n) {
    const bq6_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = H2F(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int h = 0; h < QK_K; h += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                /* (d * scale) * q, ggml's association */
                y[l + 0] = d * sc[is + 0] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

/* ---- dequantize, AVX2 (the batched-decode chunks and prefill panels of quant_kernels.c; AVX-512
 * machines run it too): the scalar bodies above, eight lanes at a time, bit-identical to them
 * (an exact int -> float, then the same products and differences in the same order). */

/* 8 codes (bytes at q, >> shift, & mask) -> floats times d minus m, stored at y. */
AVX2_TARGET static inline void k_dequant8(const uint8_t *q, int shift, int mask, float d, float m,
                                          float *y) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    v = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(mask));
    const __m256 f = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(v));
    _mm256_storeu_ps(y, _mm256_sub_ps(f, _mm256_set1_ps(m)));
}

AVX2_TARGET static void dequantize_q4_K_avx2(int isa, const void *src, float *y, int64_t n) {
    (void)isa;
    const bq4_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = H2F(x[i].d), min = H2F(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int is = 0; is < 8; is += 2, q += 32, y += 64) {
            uint8_t sc, m;
            get_scale_min_k4(is + 0, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            get_scale_min_k4(is + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l += 8) {
                k_dequant8(q + l, 0, 0xF, d1, m1, y + l);
                k_dequant8(q + l, 4, 0xF, d2, m2, y + 32 + l);
            }
        }
    }
}

/* 8 Q6_K values: low nibble (ql >> lshift) with 2 high bits (qh >> hshift), minus 32, times the
 * sub-block's d * scale (ggml's association, as dequantize_q6_K). */
AVX2_TARGET static inline void q6_dequant8(const uint8_t *ql, int lshift, const uint8_t *qh,
                                           int hshift, float ds, float *y) {
    const __m256i l = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ql));
    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qh));
    const __m256i q = _mm256_sub_epi32(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(l, lshift), _mm256_set1_epi32(0xF)),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, hshift),
                                                           _mm256_set1_epi32(3)), 4)),
        _mm256_set1_epi32(32));
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_set1_ps(ds), _mm256_cvtepi32_ps(q)));
}

AVX2_TARGET static void dequantize_q6_K_avx2(int isa, const void *src, float *y, int64_t n) {
    (void)isa;
    const bq6_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = H2F(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int h = 0; h < QK_K; h += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l += 8) {
                const int is = l / 16;
                q6_dequant8(ql + l, 0, qh + l, 0, d * sc[is + 0], y + l);
                q6_dequant8(ql + l + 32, 0, qh + l, 2, d * sc[is + 2], y + l + 32);
                q6_dequant8(ql + l, 4, qh + l, 4, d * sc[is + 4], y + l + 64);
                q6_dequant8(ql + l + 32, 4, qh + l, 6, d * sc[is + 6], y + l + 96);
            }
        }
    }
}

/* unsigned level 0..63; the value is u - 32 */
static void unpack_q6_K(const bq6_K *b, uint8_t *u) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        uint8_t *o = u + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
            o[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
            o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
}

// ----------------------------------------------------------------------------
// ---- Q8_K: the activation format (float d, int8 levels, sums of 16)

static void quantize_q8_K(const float *x, void *dst, int64_t n) {
    bq8_K *y = dst;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float max = 0, amax = 0;
        for (int j = 0; j < QK_K; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!amax) {  /* ggml leaves bsums unset here; zero them so output is deterministic */
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        /* -127 (not -128): ggml's choice, which also keeps |q| <= 127 for maddubs */
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) y[i].qs[j] = (int8_t)KMIN(127, nearest_int(iscale * x[j]));
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int ii = 0; ii < 16; ii++) sum += y[i].qs[j * 16 + ii];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

static void dequantize_q8_K(const void *src, float *y, int64_t n) {
    const bq8_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++)
        for (int j = 0; j < QK_K; j++) *y++ = x[i].d * x[i].qs[j];
}

// ----------------------------------------------------------------------------
// ---- vec_dot: integer parts per super-block (scalar / AVX2 / AVX-512), floats in kacc

/* The only float arithmetic of every vec_dot body, once per super-block and in this order on
   every ISA: acc + ((dx * d) * isum - (dx * dmin) * summs), as ggml's `sumf += ...`; the block's
   term first, so the loop-carried chain is one add. setup.py's -std=c11 keeps FP contraction
   off, so the AVX targets do not fuse this into FMAs and stay bit-identical to the scalar body. */
INLINE float kacc(float acc, float dx, float d, float dmin, int32_t isum, int32_t summs) {
    return acc + ((dx * d) * (float)isum - (dx * dmin) * (float)summs);
}

/* sum over the 16 groups of 16 of coef[g] * bsums[g] (the min and level-offset terms) */
INLINE int32_t bsum_dot16(const int16_t *bsums, const int8_t *coef) {
    int32_t s = 0;
    for (int g = 0; g < 16; g++) s += bsums[g] * coef[g];
    return s;
}

/* same for 8 groups of 32: coef[g] covers bsums 2g and 2g+1 */
INLINE int32_t bsum_dot8(const int16_t *bsums, const uint8_t *coef) {
    int32_t s = 0;
    for (int g = 0; g < 16; g++) s += bsums[g] * coef[g / 2];
    return s;
}

/* P_g = sum of u * q8 over group g of `size` elements */
INLINE int32_t group_dot(const uint8_t *u, const int8_t *q8, int size) {
    int32_t s = 0;
    for (int l = 0; l < size; l++) s += u[l] * q8[l];
    return s;
}

/* Integer parts of one super-block, scalar: isum (levels times scales, offsets removed) and
   summs (the minimum term, before d_min). These are the reference for the SIMD bodies. */
INLINE void ints_q2_K_scalar(const bq2_K *b, const bq8_K *a, int32_t *isum, int32_t *summs) {
    uint8_t u[QK_K];
    int8_t mn[16];
    unpack_q2_K(b, u);
    int32_t s = 0;
    for (int g = 0; g < 16; g++) {
        s += (b->scales[g] & 0xF) * group_dot(u + 16 * g, a->qs + 16 * g, 16);
        mn[g] = (int8_t)(b->scales[g] >> 4);
    }
    *isum = s;
    *summs = bsum_dot16(a->bsums, mn);
}

INLINE void ints_q3_K_scalar(const bq3_K *b, const bq8_K *a, int32_t *isum, int32_t *summs) {
    uint8_t u[QK_K];
    int8_t sc[16];
    unpack_q3_K(b, u);
    q3_K_scales(b->scales, sc);
    int32_t s = 0;
    for (int g = 0; g < 16; g++) s += sc[g] * group_dot(u + 16 * g, a->qs + 16 * g, 16);
    *isum = s - 4 * bsum_dot16(a->bsums, sc);  /* levels are u - 4 */
    *summs = 0;
}

INLINE void ints_q4_K_scalar(const bq4_K *b, const bq8_K *a, int32_t *isum, int32_t *summs) {
    uint8_t u[QK_K], sc[8], mn[8];
    unpack_q4_K(b, u);
    k4_scales(b->scales, sc, mn);
    int32_t s = 0;
    for (int g = 0; g < 8; g++) s += sc[g] * group_dot(u + 32 * g, a->qs + 32 * g, 32);
    *isum = s;
    *summs = bsum_dot8(a->bsums, mn);
}

INLINE void ints_q5_K_scalar(const bq5_K *b, const bq8_K *a, int32_t *isum, int32_t *summs) {
    uint8_t u[QK_K], sc[8], mn[8];
    unpack_q5_K(b, u);
    k4_scales(b->scales, sc, mn);
    int32_t s = 0;
    for (int g = 0; g < 8; g++) s += sc[g] * group_dot(u + 32 * g, a->qs + 32 * g, 32);
    *isum = s;
    *summs = bsum_dot8(a->bsums, mn);
}

INLINE void ints_q6_K_scalar(const bq6_K *b, const bq8_K *a, int32_t *isum, int32_t *summs) {
    uint8_t u[QK_K];
    unpack_q6_K(b, u);
    int32_t s = 0;
    for (int g = 0; g < 16; g++) s += b->scales[g] * group_dot(u + 16 * g, a->qs + 16 * g, 16);
    *isum = s - 32 * bsum_dot16(a->bsums, b->scales);  /* levels are u - 32 */
    *summs = 0;
}

// ---- AVX2: one 32-byte chunk (32 elements) per maddubs; scales as int16 for madd

AVX2_TARGET INLINE int32_t hsum_i32_avx2(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* For the 16-group types, chunk c covers groups 2c (low 128-bit lane) and 2c+1 (high lane).
   `s16` holds the 16 scales as int16; this returns s[2c] across the low lane and s[2c+1]
   across the high one (a byte shuffle, lane-local, of the half that holds them). */
AVX2_TARGET INLINE __m256i scale_pair_avx2(__m256i s16, int c) {
    const __m256i half = c < 4 ? _mm256_permute2x128_si256(s16, s16, 0x00)
                               : _mm256_permute2x128_si256(s16, s16, 0x11);
    const int k = c & 3;
    const __m256i ctrl = _mm256_set_m128i(_mm_set1_epi16((short)(((4 * k + 3) << 8) | (4 * k + 2))),
                                          _mm_set1_epi16((short)(((4 * k + 1) << 8) | (4 * k))));
    return _mm256_shuffle_epi8(half, ctrl);
}

/* For Q4_K/Q5_K: s8 holds the 8 scales as int16 in both lanes; scale j across the vector. */
AVX2_TARGET INLINE __m256i scale_one_avx2(__m256i s8, int j) {
    return _mm256_shuffle_epi8(s8, _mm256_set1_epi16((short)(((2 * j + 1) << 8) | (2 * j))));
}

/* 8 unsigned bytes as int16, each twice (coefficients of the 16 bsums for 32-element groups) */
AVX2_TARGET INLINE __m256i dup8_avx2(const uint8_t *p) {
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v));
}

/* Q3_K's 16 scales (minus 32) as int8 in an xmm */
AVX2_TARGET INLINE __m128i q3_K_scales_sse(const uint8_t *s) {
    uint32_t o[4];
    q3_K_scales_u(s, o);
    const __m128i v = _mm_set_epi32((int)o[3], (int)o[2], (int)o[1], (int)o[0]);
    return _mm_sub_epi8(v, _mm_set1_epi8(32));
}

AVX2_TARGET INLINE __m256i bsums_avx2(const bq8_K *a) {
    return _mm256_loadu_si256((const __m256i *)a->bsums);
}

/* accumulate sum(u * q8) of one chunk, times its scale vector, into 8 int32 lanes */
AVX2_TARGET INLINE __m256i chunk_avx2(__m256i acc, __m256i u, const int8_t *q8, __m256i sv) {
    const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)q8));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sv));
}

AVX2_TARGET INLINE void ints_q2_K_avx2(const bq2_K *b, const bq8_K *a, int32_t *isum,
                                       int32_t *summs) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i sb = _mm_loadu_si128((const __m128i *)b->scales), m4 = _mm_set1_epi8(0xF);
    const __m256i s16 = _mm256_cvtepu8_epi16(_mm_and_si128(sb, m4));
    const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sb, 4), m4));
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            const int c = 4 * h + s;
            const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m3);
            acc = chunk_avx2(acc, u, a->qs + 32 * c, scale_pair_avx2(s16, c));
        }
    }
    *isum = hsum_i32_avx2(acc);
    *summs = hsum_i32_avx2(_mm256_madd_epi16(bsums_avx2(a), mn16));
}

AVX2_TARGET INLINE void ints_q3_K_avx2(const bq3_K *b, const bq8_K *a, int32_t *isum,
                                       int32_t *summs) {
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i s16 = _mm256_cvtepi8_epi16(q3_K_scales_sse(b->scales));
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b->hmask);
    /* levels are u - 4: start from -4 * sum_g s_g * bsum_g */
    __m256i acc = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_madd_epi16(bsums_avx2(a), _mm256_slli_epi16(s16, 2)));
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            const int c = 4 * h + s;
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hm, c), one);
            const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m3),
                                              _mm256_slli_epi16(hi, 2));
            acc = chunk_avx2(acc, u, a->qs + 32 * c, scale_pair_avx2(s16, c));
        }
    }
    *isum = hsum_i32_avx2(acc);
    *summs = 0;
}

AVX2_TARGET INLINE void ints_q4_K_avx2(const bq4_K *b, const bq8_K *a, int32_t *isum,
                                       int32_t *summs) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    uint8_t sc[8], mn[8];
    k4_scales(b->scales, sc, mn);
    const __m256i s8 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
        acc = chunk_avx2(acc, _mm256_and_si256(q, m4), a->qs + 64 * j, scale_one_avx2(s8, 2 * j));
        acc = chunk_avx2(acc, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), a->qs + 64 * j + 32,
                         scale_one_avx2(s8, 2 * j + 1));
    }
    *isum = hsum_i32_avx2(acc);
    *summs = hsum_i32_avx2(_mm256_madd_epi16(bsums_avx2(a), dup8_avx2(mn)));
}

AVX2_TARGET INLINE void ints_q5_K_avx2(const bq5_K *b, const bq8_K *a, int32_t *isum,
                                       int32_t *summs) {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    uint8_t sc[8], mn[8];
    k4_scales(b->scales, sc, mn);
    const __m256i s8 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4);
        acc = chunk_avx2(acc, _mm256_or_si256(_mm256_and_si256(q, m4), h0), a->qs + 64 * j,
                         scale_one_avx2(s8, 2 * j));
        acc = chunk_avx2(acc, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h1),
                         a->qs + 64 * j + 32, scale_one_avx2(s8, 2 * j + 1));
    }
    *isum = hsum_i32_avx2(acc);
    *summs = hsum_i32_avx2(_mm256_madd_epi16(bsums_avx2(a), dup8_avx2(mn)));
}

AVX2_TARGET INLINE void ints_q6_K_avx2(const bq6_K *b, const bq8_K *a, int32_t *isum,
                                       int32_t *summs) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
    /* levels are u - 32: start from -32 * sum_g s_g * bsum_g (|32 s| <= 4096 fits int16) */
    __m256i acc = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_madd_epi16(bsums_avx2(a), _mm256_slli_epi16(s16, 5)));
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        /* the top two bits of chunk k sit at bits 2k, 2k+1 of qh: move them to bits 4, 5 */
        const __m256i u0 = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                           _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        const __m256i u1 = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        const __m256i u2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                           _mm256_and_si256(qh, m30));
        const __m256i u3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        const int8_t *q8 = a->qs + 128 * h;
        acc = chunk_avx2(acc, u0, q8, scale_pair_avx2(s16, 4 * h + 0));
        acc = chunk_avx2(acc, u1, q8 + 32, scale_pair_avx2(s16, 4 * h + 1));
        acc = chunk_avx2(acc, u2, q8 + 64, scale_pair_avx2(s16, 4 * h + 2));
        acc = chunk_avx2(acc, u3, q8 + 96, scale_pair_avx2(s16, 4 * h + 3));
    }
    *isum = hsum_i32_avx2(acc);
    *summs = 0;
}

// ---- AVX-512: two chunks (64 elements) per maddubs; the low 256 bits hold the first chunk.
// The bsum terms are 16 int16, one ymm: they use the AVX2 helpers above.

/* int16 vector: a in the low 256 bits, b in the high 256 */
AVX512_TARGET INLINE __m512i pair16_512(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

/* the 32 bytes at p in both halves */
AVX512_TARGET INLINE __m512i bcast256_512(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* Spread int16 scales so that 128-bit lane k of the result holds s[base + k * step] (8 copies):
   for the 16-group types chunks 2t, 2t+1 cover groups 4t..4t+3 (base 4t, step 1); for the
   32-group types, chunks 2t, 2t+1 are groups 2t, 2t+1 (base 2t, each twice: step 1/2). */
AVX512_TARGET INLINE __m512i spread_512(__m512i s16, int i0, int i1, int i2, int i3) {
    const long long r = 0x0001000100010001LL;
    const __m512i idx = _mm512_set_epi64(r * i3, r * i3, r * i2, r * i2, r * i1, r * i1, r * i0, r * i0);
    return _mm512_permutexvar_epi16(idx, s16);
}

AVX512_TARGET INLINE __m512i chunk2_512(__m512i acc, __m512i u, const int8_t *q8, __m512i sv) {
    const __m512i p = _mm512_maddubs_epi16(u, _mm512_loadu_si512((const void *)q8));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sv));
}

/* the 16 int32 lanes folded to 8, plus `extra` (the bsum term), summed */
AVX512_TARGET INLINE int32_t hsum_512(__m512i acc, __m256i extra) {
    const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    return hsum_i32_avx2(_mm256_add_epi32(v, extra));
}

AVX512_TARGET INLINE void ints_q2_K_avx512(const bq2_K *b, const bq8_K *a, int32_t *isum,
                                           int32_t *summs) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i sb = _mm_loadu_si128((const __m128i *)b->scales), m4 = _mm_set1_epi8(0xF);
    const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sb, m4)));
    const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sb, 4), m4));
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i q = bcast256_512(b->qs + 32 * h);
#pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {  /* chunks 4h+2t, 4h+2t+1: shifts 4t and 4t+2 */
            const int g = 8 * h + 4 * t;
            const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(q, pair16_512(4 * t, 4 * t + 2)), m3);
            acc = chunk2_512(acc, u, a->qs + 128 * h + 64 * t, spread_512(s16, g, g + 1, g + 2, g + 3));
        }
    }
    *isum = hsum_512(acc, _mm256_setzero_si256());
    *summs = hsum_i32_avx2(_mm256_madd_epi16(bsums_avx2(a), mn16));
}

AVX512_TARGET INLINE void ints_q3_K_avx512(const bq3_K *b, const bq8_K *a, int32_t *isum,
                                           int32_t *summs) {
    const __m512i m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m256i s16y = _mm256_cvtepi8_epi16(q3_K_scales_sse(b->scales));
    const __m512i s16 = _mm512_castsi256_si512(s16y);
    const __m512i hm = bcast256_512(b->hmask);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i q = bcast256_512(b->qs + 32 * h);
#pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {
            const int c = 4 * h + 2 * t, g = 2 * c;
            const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(hm, pair16_512(c, c + 1)), one);
            const __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(q, pair16_512(4 * t, 4 * t + 2)), m3);
            const __m512i u = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 2));
            acc = chunk2_512(acc, u, a->qs + 32 * c, spread_512(s16, g, g + 1, g + 2, g + 3));
        }
    }
    /* levels are u - 4 */
    const __m256i off = _mm256_madd_epi16(bsums_avx2(a), _mm256_slli_epi16(s16y, 2));
    *isum = hsum_512(acc, _mm256_sub_epi32(_mm256_setzero_si256(), off));
    *summs = 0;
}

AVX512_TARGET INLINE void ints_q4_K_avx512(const bq4_K *b, const bq8_K *a, int32_t *isum,
                                           int32_t *summs) {
    const __m512i m4 = _mm512_set1_epi8(0xF), shifts = pair16_512(0, 4);
    uint8_t sc[8], mn[8];
    k4_scales(b->scales, sc, mn);
    const __m512i s8 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {  /* chunks 2j (low nibbles) and 2j+1 (high) of one 32 bytes */
        const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(bcast256_512(b->qs + 32 * j), shifts), m4);
        acc = chunk2_512(acc, u, a->qs + 64 * j, spread_512(s8, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1));
    }
    *isum = hsum_512(acc, _mm256_setzero_si256());
    *summs = hsum_i32_avx2(_mm256_madd_epi16(bsums_avx2(a), dup8_avx2(mn)));
}

AVX512_TARGET INLINE void ints_q5_K_avx512(const bq5_K *b, const bq8_K *a, int32_t *isum,
                                           int32_t *summs) {
    const __m512i m4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1), shifts = pair16_512(0, 4);
    uint8_t sc[8], mn[8];
    k4_scales(b->scales, sc, mn);
    const __m512i s8 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
    const __m512i qh = bcast256_512(b->qh);
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(bcast256_512(b->qs + 32 * j), shifts), m4);
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, pair16_512(2 * j, 2 * j + 1)), one);
        const __m512i u = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
        acc = chunk2_512(acc, u, a->qs + 64 * j, spread_512(s8, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1));
    }
    *isum = hsum_512(acc, _mm256_setzero_si256());
    *summs = hsum_i32_avx2(_mm256_madd_epi16(bsums_avx2(a), dup8_avx2(mn)));
}

AVX512_TARGET INLINE void ints_q6_K_avx512(const bq6_K *b, const bq8_K *a, int32_t *isum,
                                           int32_t *summs) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(3);
    const __m256i s16y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
    const __m512i s16 = _mm512_castsi256_si512(s16y);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        /* 64 bytes of ql are chunks 4h (low 32 bytes) and 4h+1 (high 32) in their low nibbles,
           chunks 4h+2 and 4h+3 in their high nibbles; qh bits 2k, 2k+1 belong to chunk 4h+k */
        const __m512i ql = _mm512_loadu_si512((const void *)(b->ql + 64 * h));
        const __m512i qh = bcast256_512(b->qh + 32 * h);
        const __m512i h01 = _mm512_and_si512(_mm512_srlv_epi16(qh, pair16_512(0, 2)), m3);
        const __m512i h23 = _mm512_and_si512(_mm512_srlv_epi16(qh, pair16_512(4, 6)), m3);
        const __m512i u01 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(h01, 4));
        const __m512i u23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                            _mm512_slli_epi16(h23, 4));
        const int g = 8 * h;
        acc = chunk2_512(acc, u01, a->qs + 128 * h, spread_512(s16, g, g + 1, g + 2, g + 3));
        acc = chunk2_512(acc, u23, a->qs + 128 * h + 64, spread_512(s16, g + 4, g + 5, g + 6, g + 7));
    }
    /* levels are u - 32 */
    const __m256i off = _mm256_madd_epi16(bsums_avx2(a), _mm256_slli_epi16(s16y, 5));
    *isum = hsum_512(acc, _mm256_sub_epi32(_mm256_setzero_si256(), off));
    *summs = 0;
}

/* One vec_dot per type and ISA: walk the super-blocks, take the integer parts, fold them into
   the float sum with kacc. The SIMD bodies read the f16 scales with F16C (exact, as the scalar
   conversion). Q3_K and Q6_K have no minimum: their summs is 0. */
#define K_VEC_DOT(T, isa_name, TARGET, HALF)                                                   \
    TARGET static float vec_dot_##T##_##isa_name(int64_t n, const void *w, const void *xq) {   \
        const b##T *b = w;                                                                     \
        const bq8_K *a = xq;                                                                   \
        float acc = 0;                                                                         \
        for (int64_t i = 0; i < n / QK_K; i++) {                                               \
            int32_t isum, summs;                                                               \
            ints_##T##_##isa_name(&b[i], &a[i], &isum, &summs);                                \
            acc = kacc(acc, a[i].d, HALF(b[i].d), K_DMIN_##T(b[i], HALF), isum, summs);        \
        }                                                                                      \
        return acc;                                                                            \
    }

/* Two activation rows at once (act_split's hi and lo, quant_kernels.c): the integer bodies are
   inlined twice on the same block, so the compiler unpacks its weights once for both. */
#define K_VEC_DOT2(T, isa_name, TARGET, HALF)                                                  \
    TARGET static float vec_dot2_##T##_##isa_name(int64_t n, const void *w, const void *xq,    \
                                                  const void *xq2) {                           \
        const b##T *b = w;                                                                     \
        const bq8_K *a = xq, *a2 = xq2;                                                        \
        float acc = 0, acc2 = 0;                                                               \
        for (int64_t i = 0; i < n / QK_K; i++) {                                               \
            int32_t isum, summs, isum2, summs2;                                                \
            ints_##T##_##isa_name(&b[i], &a[i], &isum, &summs);                                \
            ints_##T##_##isa_name(&b[i], &a2[i], &isum2, &summs2);                             \
            const float d = HALF(b[i].d), dmin = K_DMIN_##T(b[i], HALF);                       \
            acc = kacc(acc, a[i].d, d, dmin, isum, summs);                                     \
            acc2 = kacc(acc2, a2[i].d, d, dmin, isum2, summs2);                                \
        }                                                                                      \
        return acc + acc2;                                                                     \
    }

#define K_DMIN_q2_K(blk, HALF) HALF((blk).dmin)
#define K_DMIN_q3_K(blk, HALF) 0.0f
#define K_DMIN_q4_K(blk, HALF) HALF((blk).dmin)
#define K_DMIN_q5_K(blk, HALF) HALF((blk).dmin)
#define K_DMIN_q6_K(blk, HALF) 0.0f
#define F16C_H2F(h) _cvtsh_ss(h)

#define K_VEC_DOT_ALL(T)                                                         \
    K_VEC_DOT(T, scalar, , H2F)                                                  \
    K_VEC_DOT(T, avx2, AVX2_TARGET, F16C_H2F)                                    \
    K_VEC_DOT(T, avx512, AVX512_TARGET, F16C_H2F)                                \
    static float vec_dot_##T(int isa, int64_t n, const void *w, const void *xq) { \
        switch (isa) {                                                           \
            case TAPER_ISA_AVX512: return vec_dot_##T##_avx512(n, w, xq);        \
            case TAPER_ISA_AVX2: return vec_dot_##T##_avx2(n, w, xq);            \
            default: return vec_dot_##T##_scalar(n, w, xq);                      \
        }                                                                        \
    }                                                                            \
    K_VEC_DOT2(T, scalar, , H2F)                                                 \
    K_VEC_DOT2(T, avx2, AVX2_TARGET, F16C_H2F)                                   \
    K_VEC_DOT2(T, avx512, AVX512_TARGET, F16C_H2F)                               \
    static float vec_dot2_##T(int isa, int64_t n, const void *w, const void *xq, \
                              const void *xq2) {                                 \
        switch (isa) {                                                           \
            case TAPER_ISA_AVX512: return vec_dot2_##T##_avx512(n, w, xq, xq2);  \
            case TAPER_ISA_AVX2: return vec_dot2_##T##_avx2(n, w, xq, xq2);      \
            default: return vec_dot2_##T##_scalar(n, w, xq, xq2);               \
        }                                                                        \
    }

K_VEC_DOT_ALL(q2_K)
K_VEC_DOT_ALL(q3_K)
K_VEC_DOT_ALL(q4_K)
K_VEC_DOT_ALL(q5_K)
K_VEC_DOT_ALL(q6_K)

// ----------------------------------------------------------------------------
// ---- unpackers for the int8 prefill GEMM (quant_gemm.c): the same integers as ints_*_scalar

static void k_unpack_q2_K(const void *blk, taper_k_unpacked *o) {
    const bq2_K *b = blk;
    unpack_q2_K(b, o->u);
    for (int k = 0; k < QK_K / 2; k++) o->sc[k] = b->scales[k / 8] & 0xF;
    for (int g = 0; g < 16; g++) o->mn[g] = b->scales[g] >> 4;
    o->d = H2F(b->d);
    o->dmin = H2F(b->dmin);
}

static void k_unpack_q3_K(const void *blk, taper_k_unpacked *o) {
    const bq3_K *b = blk;
    int8_t sc[16];
    unpack_q3_K(b, o->u);
    q3_K_scales(b->scales, sc);
    for (int k = 0; k < QK_K / 2; k++) o->sc[k] = sc[k / 8];
    for (int g = 0; g < 16; g++) o->mn[g] = (int16_t)(-4 * sc[g]);  /* levels are u - 4 */
    o->d = H2F(b->d);
    o->dmin = 0.0f;
}

/* int8_min_t (the traits below): the int8 GEMM against the vec_dot loop, 896x4864, one Zen 4
   core (shared machine), ms: Q4_K T=4 0.53 vs 0.65, T=16 1.30 vs 2.30 (the float32 chunks),
   Q6_K T=4 0.54 vs 0.65, Q5_K T=4 0.61 vs 0.83, T=2 about 0.5 vs 0.33 for all three; Q2_K and
   Q3_K, whose unpackers are scalar, lose at T=4 (1.8-2.0 vs 0.6-0.8) and are even at T=16, so
   they take it only past the loop's range (T > 32), where it is 1.1-1.7x faster (T=64, 256). */
/* The unpackers of the types that matter most run once per weight block per prefill matmul, an
   overhead that the token rows share: AVX2 bodies (the GEMM runs on AVX-512 CPUs only), the same
   bytes as unpack_q4_K / unpack_q5_K / unpack_q6_K. */
AVX2_TARGET INLINE void k_scales_32(const uint8_t sc[8], const uint8_t mn[8], taper_k_unpacked *o) {
    for (int g = 0; g < 8; g++)
        _mm256_storeu_si256((__m256i *)(o->sc + 16 * g), _mm256_set1_epi16(sc[g]));
    for (int g = 0; g < 16; g++) o->mn[g] = mn[g / 2];
}

AVX2_TARGET static void k_unpack_q4_K(const void *blk, taper_k_unpacked *o) {
    const bq4_K *b = blk;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
        _mm256_storeu_si256((__m256i *)(o->u + 64 * j), _mm256_and_si256(q, m4));
        _mm256_storeu_si256((__m256i *)(o->u + 64 * j + 32),
                            _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    }
    k4_scales(b->scales, sc, mn);
    k_scales_32(sc, mn, o);
    o->d = H2F(b->d);
    o->dmin = H2F(b->dmin);
}

AVX2_TARGET static void k_unpack_q5_K(const void *blk, taper_k_unpacked *o) {
    const bq5_K *b = blk;
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j));
        /* chunk c = 2j, 2j + 1 takes bit c of qh as its bit 4 */
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one);
        _mm256_storeu_si256((__m256i *)(o->u + 64 * j),
                            _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(h0, 4)));
        _mm256_storeu_si256((__m256i *)(o->u + 64 * j + 32),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                            _mm256_slli_epi16(h1, 4)));
    }
    k4_scales(b->scales, sc, mn);
    k_scales_32(sc, mn, o);
    o->d = H2F(b->d);
    o->dmin = H2F(b->dmin);
}

AVX2_TARGET static void k_unpack_q6_K(const void *blk, taper_k_unpacked *o) {
    const bq6_K *b = blk;
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        uint8_t *u = o->u + 128 * h;
        /* bits 2k, 2k+1 of qh are the top two bits of the k-th 32 elements */
#define Q6_HI(k) _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * (k)), m3), 4)
        _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(_mm256_and_si256(l0, m4), Q6_HI(0)));
        _mm256_storeu_si256((__m256i *)(u + 32), _mm256_or_si256(_mm256_and_si256(l1, m4), Q6_HI(1)));
        _mm256_storeu_si256((__m256i *)(u + 64),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), Q6_HI(2)));
        _mm256_storeu_si256((__m256i *)(u + 96),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), Q6_HI(3)));
#undef Q6_HI
    }
    for (int g = 0; g < 16; g++) {
        _mm_storeu_si128((__m128i *)(o->sc + 8 * g), _mm_set1_epi16(b->scales[g]));
        o->mn[g] = (int16_t)(-32 * b->scales[g]);  /* levels are u - 32 */
    }
    o->d = H2F(b->d);
    o->dmin = 0.0f;
}

// ----------------------------------------------------------------------------
// ---- traits

static const taper_quant_traits K_TRAITS[] = {
    {TAPER_Q2_K, QK_K, sizeof(bq2_K), TAPER_Q8_K, dequantize_q2_K, quantize_q2_K, vec_dot_q2_K, vec_dot2_q2_K,
     NULL, k_unpack_q2_K, 0, 33},
    {TAPER_Q3_K, QK_K, sizeof(bq3_K), TAPER_Q8_K, dequantize_q3_K, quantize_q3_K, vec_dot_q3_K, vec_dot2_q3_K,
     NULL, k_unpack_q3_K, 1, 33},
    {TAPER_Q4_K, QK_K, sizeof(bq4_K), TAPER_Q8_K, dequantize_q4_K, quantize_q4_K, vec_dot_q4_K, vec_dot2_q4_K,
     dequantize_q4_K_avx2, k_unpack_q4_K, 0, 4},
    {TAPER_Q5_K, QK_K, sizeof(bq5_K), TAPER_Q8_K, dequantize_q5_K, quantize_q5_K, vec_dot_q5_K, vec_dot2_q5_K,
     NULL, k_unpack_q5_K, 0, 4},
    {TAPER_Q6_K, QK_K, sizeof(bq6_K), TAPER_Q8_K, dequantize_q6_K, quantize_q6_K, vec_dot_q6_K, vec_dot2_q6_K,
     dequantize_q6_K_avx2, k_unpack_q6_K, 1, 4},
    {TAPER_Q8_K, QK_K, sizeof(bq8_K), TAPER_Q8_K, dequantize_q8_K, quantize_q8_K, NULL, NULL},
};

const taper_quant_traits *taper_k_traits(int type) {
    for (size_t i = 0; i < sizeof K_TRAITS / sizeof K_TRAITS[0]; i++)
        if (K_TRAITS[i].type == type) return &K_TRAITS[i];
    return NULL;
}

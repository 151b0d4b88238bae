/* ggml's legacy block types, Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (32 elements per block, one f16 scale, and
 * for the _1 types an f16 minimum), and the activation formats their dot products take: Q8_0 for
 * the symmetric types, Q8_1 (Q8_0 plus s = d * sum(qs)) for the ones with a minimum.
 *
 * The trick (ggml's): a weight block times an activation block is one integer dot product of 32
 * small ints scaled by d_w * d_x; for the _1 types the minimum contributes m_w * d_x * sum(q_x),
 * which Q8_1 carries precomputed as s, so the inner loop never touches floats.
 *
 * Per type: a scalar dequantizer (ggml's dequantize_row_*, the test oracle), a quantizer
 * byte-identical to the gguf package's NumPy one (gguf/quants.py, which matches ggml's
 * quantize_row_*_ref), and vec_dot with a scalar body and AVX2 / AVX-512 bodies compiled with
 * target attributes (no -march=native in the build) and picked by the caller's `isa`.
 *
 * Nibble layout of every 4/5-bit type: byte j of qs holds element j in its low nibble and element
 * j + 16 in its high nibble; bit j of qh (little-endian u32) is bit 4 of element j.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant_internal.h"

#define QK TAPER_QK
#define INLINE static inline __attribute__((always_inline))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

typedef taper_block_q4_0 bq4_0;
typedef taper_block_q4_1 bq4_1;
typedef taper_block_q5_0 bq5_0;
typedef taper_block_q5_1 bq5_1;
typedef taper_block_q8_0 bq8_0;
typedef taper_block_q8_1 bq8_1;

static inline float h2f(taper_half h) { return taper_half_to_float(h); }

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);  /* qh is not 4-byte aligned inside the packed blocks */
    return v;
}

// ----------------------------------------------------------------------------
// ---- quantizers (byte-identical to gguf.quants; every float op is float32, in NumPy's order)
//
// The build is ISO C11, where GCC does not contract a*b+c into an FMA, and these functions carry
// no FMA target, so `x * id + 8.5f` rounds twice exactly as NumPy's two ufuncs do.

/* roundf (half away from zero), which gguf's np_roundf and ggml's roundf both are, without libm:
 * baseline x86-64 has no SSE4.1 round, and a libm call per element would not vectorize. Exact
 * for |v| < 2^23 (truncation is exact there and a - t is exact); quantizers keep |v| <= 127.x. */
static inline float round_away(float v) {
    const float a = fabsf(v);
    float t = (float)(int32_t)a;
    t += (a - t >= 0.5f) ? 1.0f : 0.0f;
    return copysignf(t, v);
}

/* Signed value of largest magnitude, first one on ties: NumPy's abs(x).argmax() then take. The
 * sign matters: d = max / -8 is negative for a positive max, and an all-(+0.0) block gives
 * d = -0.0, stored as f16 0x8000, as gguf does. */
static inline float signed_absmax(const float *x) {
    float amax = fabsf(x[0]), max = x[0];
    for (int j = 1; j < QK; j++) {
        const float a = fabsf(x[j]);
        if (a > amax) { amax = a; max = x[j]; }
    }
    return max;
}

static inline void min_max(const float *x, float *mn, float *mx) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < QK; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    *mn = lo;
    *mx = hi;
}

static void quantize_q4_0(const float *src, void *dst, int64_t n) {
    bq4_0 *y = dst;
    for (int64_t i = 0; i < n / QK; i++, src += QK) {
        const float d = signed_absmax(src) / -8.0f;  /* max maps to -8, the end with one more code */
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK];
        for (int j = 0; j < QK; j++) {
            /* x*id is in [-8, 8] up to rounding, so the sum is >= 0 and truncation is floor */
            const int v = (int)(src[j] * id + 8.5f);
            q[j] = (uint8_t)(v > 15 ? 15 : v);
        }
        y[i].d = taper_float_to_half(d);
        for (int j = 0; j < QK / 2; j++) y[i].qs[j] = (uint8_t)(q[j] | (q[j + QK / 2] << 4));
    }
}

static void quantize_q4_1(const float *src, void *dst, int64_t n) {
    bq4_1 *y = dst;
    for (int64_t i = 0; i < n / QK; i++, src += QK) {
        float mn, mx;
        min_max(src, &mn, &mx);
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK];
        for (int j = 0; j < QK; j++) {
            const int v = (int)((src[j] - mn) * id + 0.5f);
            q[j] = (uint8_t)(v > 15 ? 15 : v);
        }
        y[i].d = taper_float_to_half(d);
        y[i].m = taper_float_to_half(mn);
        for (int j = 0; j < QK / 2; j++) y[i].qs[j] = (uint8_t)(q[j] | (q[j + QK / 2] << 4));
    }
}

/* Low nibbles into qs (element j and j + 16 share byte j), bit 4 of element j into bit j of qh. */
static inline void pack5(const uint8_t *q, uint8_t *qs, uint8_t *qh) {
    uint32_t h = 0;
    for (int j = 0; j < QK; j++) h |= (uint32_t)(q[j] >> 4) << j;
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)((q[j] & 0x0F) | (q[j + QK / 2] << 4));
    memcpy(qh, &h, 4);
}

static void quantize_q5_0(const float *src, void *dst, int64_t n) {
    bq5_0 *y = dst;
    for (int64_t i = 0; i < n / QK; i++, src += QK) {
        const float d = signed_absmax(src) / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK];
        for (int j = 0; j < QK; j++) {
            const int v = (int)(src[j] * id + 16.5f);
            q[j] = (uint8_t)(v > 31 ? 31 : v);
        }
        y[i].d = taper_float_to_half(d);
        pack5(q, y[i].qs, y[i].qh);
    }
}

static void quantize_q5_1(const float *src, void *dst, int64_t n) {
    bq5_1 *y = dst;
    for (int64_t i = 0; i < n / QK; i++, src += QK) {
        float mn, mx;
        min_max(src, &mn, &mx);
        const float d = (mx - mn) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK];
        for (int j = 0; j < QK; j++) {
            const int v = (int)((src[j] - mn) * id + 0.5f);
            q[j] = (uint8_t)(v > 31 ? 31 : v);
        }
        y[i].d = taper_float_to_half(d);
        y[i].m = taper_float_to_half(mn);
        pack5(q, y[i].qs, y[i].qh);
    }
}

/* One 32-element block to int8 with d = amax / 127; returns sum(qs) for Q8_1. Written as three
 * flat loops over 32 floats so GCC vectorizes them: this runs on every activation row. */
static inline int quantize_block_8(const float *x, int8_t *qs, float *d_out) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        const int v = (int)round_away(x[j] * id);
        qs[j] = (int8_t)v;
        sum += v;
    }
    *d_out = d;
    return sum;
}

static void quantize_q8_0(const float *src, void *dst, int64_t n) {
    bq8_0 *y = dst;
    for (int64_t i = 0; i < n / QK; i++, src += QK) {
        float d;
        quantize_block_8(src, y[i].qs, &d);
        y[i].d = taper_float_to_half(d);
    }
}

/* ggml's quantize_row_q8_1_ref: s is the unrounded d times the integer sum, then stored as f16. */
static void quantize_q8_1(const float *src, void *dst, int64_t n) {
    bq8_1 *y = dst;
    for (int64_t i = 0; i < n / QK; i++, src += QK) {
        float d;
        const int sum = quantize_block_8(src, y[i].qs, &d);
        y[i].d = taper_float_to_half(d);
        y[i].s = taper_float_to_half((float)sum * d);
    }
}

// ----------------------------------------------------------------------------
// ---- dequantizers: the scalar reference (ggml's dequantize_row_*)

static void dequantize_q4_0(const void *src, float *y, int64_t n) {
    const bq4_0 *x = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        const float d = h2f(x[i].d);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = (float)((x[i].qs[j] & 0x0F) - 8) * d;
            y[j + QK / 2] = (float)((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void dequantize_q4_1(const void *src, float *y, int64_t n) {
    const bq4_1 *x = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        const float d = h2f(x[i].d), m = h2f(x[i].m);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = (float)(x[i].qs[j] & 0x0F) * d + m;
            y[j + QK / 2] = (float)(x[i].qs[j] >> 4) * d + m;
        }
    }
}

static void dequantize_q5_0(const void *src, float *y, int64_t n) {
    const bq5_0 *x = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        const float d = h2f(x[i].d);
        const uint32_t qh = load_u32(x[i].qh);
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (float)(((x[i].qs[j] & 0x0F) | h0) - 16) * d;
            y[j + QK / 2] = (float)(((x[i].qs[j] >> 4) | h1) - 16) * d;
        }
    }
}

static void dequantize_q5_1(const void *src, float *y, int64_t n) {
    const bq5_1 *x = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        const float d = h2f(x[i].d), m = h2f(x[i].m);
        const uint32_t qh = load_u32(x[i].qh);
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (float)((x[i].qs[j] & 0x0F) | h0) * d + m;
            y[j + QK / 2] = (float)((x[i].qs[j] >> 4) | h1) * d + m;
        }
    }
}

static void dequantize_q8_0(const void *src, float *y, int64_t n) {
    const bq8_0 *x = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        const float d = h2f(x[i].d);
        for (int j = 0; j < QK; j++) y[j] = (float)x[i].qs[j] * d;
    }
}

static void dequantize_q8_1(const void *src, float *y, int64_t n) {
    const bq8_1 *x = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        const float d = h2f(x[i].d);
        for (int j = 0; j < QK; j++) y[j] = (float)x[i].qs[j] * d;
    }
}

// ----------------------------------------------------------------------------
// ---- vec_dot, scalar: the reference the SIMD bodies are tested against

static float dot_q4_0_scalar(int64_t n, const bq4_0 *x, const bq8_0 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++) {
            sumi += ((x[i].qs[j] & 0x0F) - 8) * y[i].qs[j];
            sumi += ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + QK / 2];
        }
        sumf += (float)sumi * (h2f(x[i].d) * h2f(y[i].d));
    }
    return sumf;
}

static float dot_q4_1_scalar(int64_t n, const bq4_1 *x, const bq8_1 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++) {
            sumi += (x[i].qs[j] & 0x0F) * y[i].qs[j];
            sumi += (x[i].qs[j] >> 4) * y[i].qs[j + QK / 2];
        }
        sumf += (float)sumi * (h2f(x[i].d) * h2f(y[i].d)) + h2f(x[i].m) * h2f(y[i].s);
    }
    return sumf;
}

static float dot_q5_0_scalar(int64_t n, const bq5_0 *x, const bq8_0 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const uint32_t qh = load_u32(x[i].qh);
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            sumi += (((x[i].qs[j] & 0x0F) | h0) - 16) * y[i].qs[j];
            sumi += (((x[i].qs[j] >> 4) | h1) - 16) * y[i].qs[j + QK / 2];
        }
        sumf += (float)sumi * (h2f(x[i].d) * h2f(y[i].d));
    }
    return sumf;
}

static float dot_q5_1_scalar(int64_t n, const bq5_1 *x, const bq8_1 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        const uint32_t qh = load_u32(x[i].qh);
        int sumi = 0;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            sumi += ((x[i].qs[j] & 0x0F) | h0) * y[i].qs[j];
            sumi += ((x[i].qs[j] >> 4) | h1) * y[i].qs[j + QK / 2];
        }
        sumf += (float)sumi * (h2f(x[i].d) * h2f(y[i].d)) + h2f(x[i].m) * h2f(y[i].s);
    }
    return sumf;
}

static float dot_q8_0_scalar(int64_t n, const bq8_0 *x, const bq8_0 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int sumi = 0;
        for (int j = 0; j < QK; j++) sumi += x[i].qs[j] * y[i].qs[j];
        sumf += (float)sumi * (h2f(x[i].d) * h2f(y[i].d));
    }
    return sumf;
}

// ----------------------------------------------------------------------------
// ---- vec_dot, SIMD: one always-inline body per ISA, specialised per weight type by constant
// folding of `t` (the VEC_DOT dispatchers below pass literals)
//
// What differs between the types: how a block's bytes become 32 codes (nibbles, nibbles + qh bit,
// or plain int8), whether the codes are signed (Q4_0 Q5_0 Q8_0, against Q8_0) or unsigned with
// a minimum (Q4_1 Q5_1, against Q8_1, whose s brings m_w * d_x * sum(q_x)).

static inline int has_min(int t) { return t == TAPER_Q4_1 || t == TAPER_Q5_1; }

static inline int w_size(int t) {
    switch (t) {
        case TAPER_Q4_0: return sizeof(bq4_0);
        case TAPER_Q4_1: return sizeof(bq4_1);
        case TAPER_Q5_0: return sizeof(bq5_0);
        case TAPER_Q5_1: return sizeof(bq5_1);
        default: return sizeof(bq8_0);
    }
}

/* Every block starts with its f16 d, and the _1 blocks (and Q8_1) follow it with the f16 m (s):
 * one 32-bit word holds both, and a zero high half stands for "no minimum". */
static inline uint32_t scale_word(int with_min, const uint8_t *block) {
    uint16_t d;
    memcpy(&d, block, 2);
    return with_min ? load_u32(block) : d;
}

/* maddubs multiplies unsigned by signed bytes into saturating i16 pairs; weight codes are at most
 * 31 unsigned or |q| <= 128 signed (via the sign trick) against |y| <= 127, so a pair stays within
 * 2 * 128 * 127 = 32512 and never saturates. madd with ones widens to i32. */

AVX2_TARGET INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 packed bytes -> 32 bytes: low nibbles (elements 0..15), then high nibbles (16..31). */
AVX2_TARGET INLINE __m256i avx2_nibbles(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* Bit j of qh -> 0xFF in byte j: byte j gets qh's byte j / 8 by a shuffle (both 128-bit lanes hold
 * the broadcast u32), then tests its own bit j % 8. */
AVX2_TARGET INLINE __m256i avx2_bits(const uint8_t *qh) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(qh)), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}

/* One weight block -> 32 codes in element order, signed for the _0 types. Q5_0's q - 16 needs no
 * subtract: where bit 4 is clear, OR-ing 0xF0 into the nibble gives nibble - 16 as an int8. */
AVX2_TARGET INLINE __m256i avx2_codes(int t, const uint8_t *b) {
    switch (t) {
        case TAPER_Q4_0:
            return _mm256_sub_epi8(avx2_nibbles(((const bq4_0 *)b)->qs), _mm256_set1_epi8(8));
        case TAPER_Q4_1: return avx2_nibbles(((const bq4_1 *)b)->qs);
        case TAPER_Q5_0: {
            const bq5_0 *x = (const bq5_0 *)b;
            return _mm256_or_si256(avx2_nibbles(x->qs), _mm256_andnot_si256(
                avx2_bits(x->qh), _mm256_set1_epi8((char)0xF0)));
        }
        case TAPER_Q5_1: {
            const bq5_1 *x = (const bq5_1 *)b;
            return _mm256_or_si256(avx2_nibbles(x->qs), _mm256_and_si256(
                avx2_bits(x->qh), _mm256_set1_epi8(0x10)));
        }
        default: return _mm256_loadu_si256((const __m256i *)((const bq8_0 *)b)->qs);
    }
}

/* One block to 32 floats: avx2_codes, widened 8 at a time, times d (then + m for the _1 types).
 * Bit-identical to the scalar reference (an exact int -> float, one rounded product, one rounded
 * sum), and several times faster: the panel path of a quantized `linear` dequantizes every
 * weight once per call, which decides whether batched decode may take it (quant_kernels.c).
 * AVX-512 machines run it too. */
AVX2_TARGET static void avx2_dequantize(const int t, const uint8_t *w, float *y, int64_t nb) {
    const int m = has_min(t), ws = w_size(t);
    for (int64_t i = 0; i < nb; i++, w += ws, y += QK) {
        const __m256i c = avx2_codes(t, w);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)scale_word(m, w)));  /* [d, m] */
        const __m256 d = _mm256_broadcastss_ps(dm), mn = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m128i half[2] = {_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)};
        for (int q = 0; q < 4; q++) {
            const __m128i b = q & 1 ? _mm_srli_si128(half[q >> 1], 8) : half[q >> 1];
            __m256 v = _mm256_cvtepi32_ps(m ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
            v = _mm256_mul_ps(v, d);
            _mm256_storeu_ps(y + 8 * q, m ? _mm256_add_ps(v, mn) : v);
        }
    }
}

/* 8 i32 sums of 4 products; signed x moves its sign onto y, as maddubs wants x unsigned */
AVX2_TARGET INLINE __m256i avx2_dot_bytes(int is_signed, __m256i x, __m256i y) {
    if (is_signed) {
        y = _mm256_sign_epi8(y, x);
        x = _mm256_sign_epi8(x, x);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1));
}

/* [d_w * d_x, m_w * s_x, ...] from one vcvtph2ps of the two blocks' scale words ([d_w, m_w, d_x,
 * s_x] as halves) rather than four scalar conversions, which cost a shuffle-port uop each and
 * were the bottleneck. The products round exactly as the scalar body's. */
AVX2_TARGET INLINE __m128 avx2_scales(uint32_t w, uint32_t x) {
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)((uint64_t)x << 32 | w)));
    return _mm_mul_ps(v, _mm_movehl_ps(v, v));
}

AVX2_TARGET INLINE float avx2_dot(const int t, int64_t nb, const uint8_t *w, const uint8_t *xq) {
    const int m = has_min(t), ws = w_size(t);
    const int xs = m ? sizeof(bq8_1) : sizeof(bq8_0), xo = m ? 4 : 2;  /* activation block, qs */
    __m256 acc = _mm256_setzero_ps();
    __m128 mins = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += ws, xq += xs) {
        const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + xo));
        const __m256i p = avx2_dot_bytes(!m, avx2_codes(t, w), y);
        const __m128 s = avx2_scales(scale_word(m, w), scale_word(m, xq));
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(s), _mm256_cvtepi32_ps(p), acc);
        if (m) mins = _mm_add_ps(mins, s);
    }
    return avx2_hsum(acc) + (m ? _mm_cvtss_f32(_mm_movehdup_ps(mins)) : 0.0f);
}

// ---- vec_dot, AVX-512: two blocks per step in one zmm (bytes 0..31 block i, 32..63 block i+1)
//
// Only AVX-512F/BW/VL: no VNNI, so the product is still maddubs + madd. AVX-512 has no sign_epi8;
// the signed case takes |x| and negates y under x's sign mask. The high bits of the 5-bit types
// are exactly a byte mask: bit j of qh is byte j, so two blocks' qh make one __mmask64. An odd
// last block goes through the AVX2 body (its instructions are in this target too).

/* two blocks' 16 packed bytes -> 64 bytes: 128-bit lanes [a lo, a hi, b lo, b hi] */
AVX512_TARGET INLINE __m512i avx512_nibbles(const uint8_t *qa, const uint8_t *qb) {
    const __m512i t = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qa))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qb)), 1);
    /* shift the copies in lanes 1 and 3 (16-bit elements 8..15, 24..31) down to the high nibble */
    return _mm512_and_si512(_mm512_mask_srli_epi16(t, 0xFF00FF00u, t, 4), _mm512_set1_epi8(0x0F));
}

AVX512_TARGET INLINE __m512i avx512_bytes(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

AVX512_TARGET INLINE __m512i avx512_codes(int t, const uint8_t *a, const uint8_t *b) {
    switch (t) {
        case TAPER_Q4_0:
            return _mm512_sub_epi8(avx512_nibbles(((const bq4_0 *)a)->qs, ((const bq4_0 *)b)->qs),
                                   _mm512_set1_epi8(8));
        case TAPER_Q4_1: return avx512_nibbles(((const bq4_1 *)a)->qs, ((const bq4_1 *)b)->qs);
        case TAPER_Q5_0: {
            const bq5_0 *xa = (const bq5_0 *)a, *xb = (const bq5_0 *)b;
            const __m512i lo = avx512_nibbles(xa->qs, xb->qs);
            const __mmask64 hi = (__mmask64)load_u32(xa->qh) | (__mmask64)load_u32(xb->qh) << 32;
            /* bit 4 set: q - 16 = nibble; clear: nibble | 0xF0 = nibble - 16 as int8 */
            return _mm512_mask_blend_epi8(hi, _mm512_or_si512(lo, _mm512_set1_epi8((char)0xF0)), lo);
        }
        case TAPER_Q5_1: {
            const bq5_1 *xa = (const bq5_1 *)a, *xb = (const bq5_1 *)b;
            const __m512i lo = avx512_nibbles(xa->qs, xb->qs);
            const __mmask64 hi = (__mmask64)load_u32(xa->qh) | (__mmask64)load_u32(xb->qh) << 32;
            return _mm512_mask_blend_epi8(hi, lo, _mm512_or_si512(lo, _mm512_set1_epi8(0x10)));
        }
        default: return avx512_bytes(((const bq8_0 *)a)->qs, ((const bq8_0 *)b)->qs);
    }
}

AVX512_TARGET INLINE __m512i avx512_dot_bytes(int is_signed, __m512i x, __m512i y) {
    if (is_signed) {
        y = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(x), _mm512_setzero_si512(), y);
        x = _mm512_abs_epi8(x);
    }
    return _mm512_madd_epi16(_mm512_maddubs_epi16(x, y), _mm512_set1_epi16(1));
}

/* Both blocks' scale words in one vcvtph2ps: halves [d_wa, m_wa, d_xa, s_xa, d_wb, ...] times
 * themselves with pairs swapped = [d_wa*d_xa, m_wa*s_xa, .., .., d_wb*d_xb, m_wb*s_xb, .., ..]. */
AVX512_TARGET INLINE __m256 avx512_scales(uint32_t wa, uint32_t xa, uint32_t wb, uint32_t xb) {
    const __m256 v = _mm256_cvtph_ps(_mm_set_epi64x((long long)((uint64_t)xb << 32 | wb),
                                                    (long long)((uint64_t)xa << 32 | wa)));
    return _mm256_mul_ps(v, _mm256_permute_ps(v, 0x4E));
}

AVX512_TARGET INLINE float avx512_dot(const int t, int64_t nb, const uint8_t *w,
                                      const uint8_t *xq) {
    const int m = has_min(t), ws = w_size(t);
    const int xs = m ? sizeof(bq8_1) : sizeof(bq8_0), xo = m ? 4 : 2;
    /* lane 0's product for block a's 8 i32 lanes, lane 4's for block b's */
    const __m512i pick = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    __m256 mins = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2, w += 2 * ws, xq += 2 * xs) {
        const __m512i y = avx512_bytes(xq + xo, xq + xs + xo);
        const __m512i p = avx512_dot_bytes(!m, avx512_codes(t, w, w + ws), y);
        const __m256 s = avx512_scales(scale_word(m, w), scale_word(m, xq), scale_word(m, w + ws),
                                       scale_word(m, xq + xs));
        acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick, _mm512_castps256_ps512(s)),
                              _mm512_cvtepi32_ps(p), acc);
        if (m) mins = _mm256_add_ps(mins, s);
    }
    float sum = _mm512_reduce_add_ps(acc);
    if (m) {
        const __m128 mm = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
        sum += _mm_cvtss_f32(_mm_movehdup_ps(mm));
    }
    if (i < nb) sum += avx2_dot(t, nb - i, w, xq);
    return sum;
}

// ----------------------------------------------------------------------------
// ---- unpacker for the int8 prefill GEMM (quant_gemm_legacy.c): avx512_codes' bytes, so the
// GEMM's integer sums are avx512_dot's

AVX512_TARGET INLINE void legacy_unpack(const int t, const uint8_t *w, int64_t nb,
                                        taper_legacy_unpacked *o, float *d, float *m, int stride) {
    const int ws = w_size(t);
    const __m512i ones8 = _mm512_set1_epi8(1), ones16 = _mm512_set1_epi16(1);
    for (int64_t i = 0; i < nb; i += 2, o++) {
        const uint8_t *a = w + i * ws;
        const __m512i q = i + 1 < nb ? avx512_codes(t, a, a + ws)
                                     : _mm512_zextsi256_si512(avx2_codes(t, a));
        const __m512i sum4 = _mm512_madd_epi16(_mm512_maddubs_epi16(ones8, q), ones16);
        _mm512_storeu_si512(o->q, q);
        _mm512_storeu_si512(o->c, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                   _mm512_slli_epi32(sum4, 7)));
    }
    for (int64_t i = 0; i < nb; i++) {
        /* d, then m for the _1 types; F16C's conversion is exact, as h2f */
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)scale_word(has_min(t), w + i * ws)));
        d[i * stride] = _mm_cvtss_f32(dm);
        if (has_min(t)) m[i * stride] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    }
}

#define LEGACY_UNPACK(name, T)                                                                \
    AVX512_TARGET static void legacy_unpack_##name(const void *row, int64_t nb,               \
                                                   taper_legacy_unpacked *o, float *d,        \
                                                   float *m, int stride) {                    \
        legacy_unpack(T, row, nb, o, d, m, stride);                                           \
    }
LEGACY_UNPACK(q4_0, TAPER_Q4_0)
LEGACY_UNPACK(q4_1, TAPER_Q4_1)
LEGACY_UNPACK(q5_0, TAPER_Q5_0)
LEGACY_UNPACK(q5_1, TAPER_Q5_1)
LEGACY_UNPACK(q8_0, TAPER_Q8_0)

// ----------------------------------------------------------------------------
// ---- dispatch and traits

/* vec_dot entry per type: the caller (taper_quant_linear) has checked that `isa` is supported */
#define VEC_DOT(name, T, xtype)                                                            \
    static void dequantize_##name##_simd(int isa, const void *src, float *y, int64_t n) {  \
        (void)isa; /* AVX2 and AVX-512 share the AVX2 body */                             \
        avx2_dequantize(T, src, y, n / QK);                                                \
    }                                                                                      \
    AVX512_TARGET static float dot_##name##_avx512(int64_t n, const void *w, const void *x) { \
        return avx512_dot(T, n / QK, w, x);                                                \
    }                                                                                      \
    AVX2_TARGET static float dot_##name##_avx2(int64_t n, const void *w, const void *x) {  \
        return avx2_dot(T, n / QK, w, x);                                                  \
    }                                                                                      \
    static float vec_dot_##name(int isa, int64_t n, const void *w, const void *xq) {       \
        switch (isa) {                                                                     \
            case TAPER_ISA_AVX512: return dot_##name##_avx512(n, w, xq);                   \
            case TAPER_ISA_AVX2: return dot_##name##_avx2(n, w, xq);                       \
            default: return dot_##name##_scalar(n, w, (const xtype *)xq);                  \
        }                                                                                  \
    }
VEC_DOT(q4_0, TAPER_Q4_0, bq8_0)
VEC_DOT(q4_1, TAPER_Q4_1, bq8_1)
VEC_DOT(q5_0, TAPER_Q5_0, bq8_0)
VEC_DOT(q5_1, TAPER_Q5_1, bq8_1)
VEC_DOT(q8_0, TAPER_Q8_0, bq8_0)

/* int8_min_t: token rows from which the int8 GEMM (quant_gemm_legacy.c) replaces the vec_dot
   loop (T <= 4) and the float32 chunks / panels (T > 4). One Zen 4 core, shared machine,
   SmolLM2-135M's 1536x576 and 576x1536, loop or float32 / int8: T=2 0.87-0.93x for Q4_1 / Q5_1,
   1.06-1.09x Q4_0; T=3 1.25-1.57x (all five, Q8_0 and Q5_0 1.02-1.22x before the scales went
   through F16C); T=4 1.6-2.0x; T=5-33 1.01-1.48x; T=64 1.09-1.40x. So 3 for all of them. */
#define INT8_MIN_T_Q4_0 3
#define INT8_MIN_T_Q4_1 3
#define INT8_MIN_T_Q5_0 3
#define INT8_MIN_T_Q5_1 3
#define INT8_MIN_T_Q8_0 3

static const taper_quant_traits LEGACY_TRAITS[] = {
    {TAPER_Q4_0, QK, sizeof(bq4_0), TAPER_Q8_0, dequantize_q4_0, quantize_q4_0, vec_dot_q4_0,
     NULL, dequantize_q4_0_simd, NULL, 0, INT8_MIN_T_Q4_0, legacy_unpack_q4_0},
    {TAPER_Q4_1, QK, sizeof(bq4_1), TAPER_Q8_1, dequantize_q4_1, quantize_q4_1, vec_dot_q4_1,
     NULL, dequantize_q4_1_simd, NULL, 0, INT8_MIN_T_Q4_1, legacy_unpack_q4_1},
    {TAPER_Q5_0, QK, sizeof(bq5_0), TAPER_Q8_0, dequantize_q5_0, quantize_q5_0, vec_dot_q5_0,
     NULL, dequantize_q5_0_simd, NULL, 0, INT8_MIN_T_Q5_0, legacy_unpack_q5_0},
    {TAPER_Q5_1, QK, sizeof(bq5_1), TAPER_Q8_1, dequantize_q5_1, quantize_q5_1, vec_dot_q5_1,
     NULL, dequantize_q5_1_simd, NULL, 0, INT8_MIN_T_Q5_1, legacy_unpack_q5_1},
    {TAPER_Q8_0, QK, sizeof(bq8_0), TAPER_Q8_0, dequantize_q8_0, quantize_q8_0, vec_dot_q8_0,
     NULL, dequantize_q8_0_simd, NULL, 0, INT8_MIN_T_Q8_0, legacy_unpack_q8_0},
    /* activation-only: quantized per matmul, never a weight */
    {TAPER_Q8_1, QK, sizeof(bq8_1), TAPER_Q8_1, dequantize_q8_1, quantize_q8_1, NULL},
};

const taper_quant_traits *taper_legacy_traits(int type) {
    for (size_t i = 0; i < sizeof(LEGACY_TRAITS) / sizeof(LEGACY_TRAITS[0]); i++)
        if (LEGACY_TRAITS[i].type == type) return &LEGACY_TRAITS[i];
    return NULL;
}

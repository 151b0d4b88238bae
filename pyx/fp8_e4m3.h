/* OCP FP8 E4M3 ("e4m3fn") <-> f32, shared by the FP8 weight kernels (fp8_kernels.c) and the FP8
 * KV cache (cpu_kernels.c). Header-only: every function is static inline.
 *
 * Format: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN;
 * largest finite 448; subnormals m * 2^-9. Decoding is a 256-entry table for scalar code and bit
 * arithmetic for vectors (no gathers): a normal code's 7 magnitude bits shifted left by 20 are
 * exactly an f32's exponent-and-mantissa field once the exponent is rebased by 127 - 7 = 120, and
 * a subnormal is its 3 mantissa bits times 2^-9, converted from int (exact), never through f32
 * denormals (which a DAZ setting elsewhere in the process would flush).
 * Encoding rounds to nearest, ties to even, and saturates: |x| >= 448 (inf included) -> +-448,
 * NaN -> NaN (NVIDIA's __NV_SATFINITE; ml_dtypes instead overflows to NaN).
 */
#ifndef TAPER_FP8_E4M3_H
#define TAPER_FP8_E4M3_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define E4M3_INLINE static inline __attribute__((always_inline))

// ---- scalar

// |value| of code c (sign bit ignored): normal (8 + m) * 2^(e - 10), subnormal 2m * 2^-10.
#define E4M3_MAG(c) (((c) & 0x78) ? (float)((8 + ((c) & 7)) << (((c) >> 3) & 15)) / 1024.0f \
                                  : (float)(((c) & 7) * 2) / 1024.0f)
#define E4M3_VAL(c) ((((c) & 0x7f) == 0x7f) ? NAN : (((c) & 0x80) ? -E4M3_MAG(c) : E4M3_MAG(c)))
#define E4M3_R4(c) E4M3_VAL(c), E4M3_VAL(c + 1), E4M3_VAL(c + 2), E4M3_VAL(c + 3)
#define E4M3_R16(c) E4M3_R4(c), E4M3_R4(c + 4), E4M3_R4(c + 8), E4M3_R4(c + 12)
#define E4M3_R64(c) E4M3_R16(c), E4M3_R16(c + 16), E4M3_R16(c + 32), E4M3_R16(c + 48)

static const float taper_e4m3_lut[256] = {E4M3_R64(0), E4M3_R64(64), E4M3_R64(128),
                                          E4M3_R64(192)};

E4M3_INLINE float taper_e4m3_to_f32(uint8_t c) { return taper_e4m3_lut[c]; }

E4M3_INLINE uint8_t taper_f32_to_e4m3(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    uint32_t a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;   // NaN
    if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 (inf too): saturate; 464 ties to 448 anyway
    if (a < 0x3c800000u) {                     // below 2^-6, the smallest normal: grid m * 2^-9
        float f;
        memcpy(&f, &a, 4);
        return sign | (uint8_t)nearbyintf(f * 512.0f);  // 0..8, and 8 is 2^-6's code
    }
    a += 0x7ffffu + ((a >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
    return sign | (uint8_t)((a >> 20) - (120u << 3));
}

// ---- vectors

#define E4M3_AVX2 __attribute__((target("avx2,fma,f16c")))
#define E4M3_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// 8 codes at p -> 8 floats.
E4M3_AVX2 E4M3_INLINE __m256 taper_e4m3x8_avx2(const uint8_t* p) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
    __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
    __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    __m256 f = _mm256_blendv_ps(normal, sub, is_sub);
    f = _mm256_blendv_ps(f, _mm256_set1_ps(NAN), is_nan);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

// 16 codes (as 16 bytes) -> 16 floats.
E4M3_AVX512 E4M3_INLINE __m512 taper_e4m3x16_avx512_bytes(__m128i bytes) {
    __m512i c = _mm512_cvtepu8_epi32(bytes);
    __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7f));
    __m512 normal = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
    __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
    __mmask16 is_nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
    __m512 f = _mm512_mask_blend_ps(is_sub, normal, sub);
    f = _mm512_mask_blend_ps(is_nan, f, _mm512_set1_ps(NAN));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// 16 codes at p -> 16 floats; the masked form reads only the first n < 16 bytes (rest 0).
E4M3_AVX512 E4M3_INLINE __m512 taper_e4m3x16_avx512(const uint8_t* p) {
    return taper_e4m3x16_avx512_bytes(_mm_loadu_si128((const __m128i*)p));
}
E4M3_AVX512 E4M3_INLINE __m512 taper_e4m3x16_avx512_tail(const uint8_t* p, int n) {
    return taper_e4m3x16_avx512_bytes(_mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p));
}

// dst[i] = decode(src[i]) * scale, n elements, one function per ISA path.
static inline void taper_e4m3_row_scalar(const uint8_t* src, float scale, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = taper_e4m3_lut[src[i]] * scale;
}
E4M3_AVX2 static inline void taper_e4m3_row_avx2(const uint8_t* src, float scale, float* dst,
                                                 int64_t n) {
    __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(taper_e4m3x8_avx2(src + i), s));
    for (; i < n; i++) dst[i] = taper_e4m3_lut[src[i]] * scale;
}
E4M3_AVX512 static inline void taper_e4m3_row_avx512(const uint8_t* src, float scale, float* dst,
                                                     int64_t n) {
    __m512 s = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(taper_e4m3x16_avx512(src + i), s));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(taper_e4m3x16_avx512_tail(src + i, (int)(n - i)), s));
    }
}

#endif

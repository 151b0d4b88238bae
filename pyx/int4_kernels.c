/* W4A16 kernels on the canonical packed int4 layout (C11 + OpenMP). See int4_kernels.h for the
 * layout and the trick.
 *
 * ISA paths are compiled side by side with __attribute__((target(...))), as in cpu_kernels.c (no
 * -march=native, no AMX), and chosen by the caller's isa argument. The scalar path is the
 * reference: it dequantizes a row with the formula of the header and dots it with each token row.
 */
#include "int4_kernels.h"

#include <immintrin.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define INLINE static inline __attribute__((always_inline))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

#define BLOCK 32      /* codes per 16-byte block */
#define TILE_ROWS 4   /* weight rows per work item */
#define TILE_T 4      /* token rows decoded against at once */

// ----------------------------------------------------------------------------
// ---- helpers

// Same test as cpu_kernels.c's taper_cpu_isa_supported, which lives in another extension.
static int isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case TAPER_ISA_SCALAR: return 1;
        case TAPER_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case TAPER_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && isa_supported(TAPER_ISA_AVX2);
        default: return 0;
    }
}

static int bad_shape(int64_t K, int64_t G) {
    return K <= 0 || G <= 0 || K % BLOCK || G % BLOCK || K % G;
}

INLINE int code_at(const uint8_t* row, int64_t k) {
    const uint8_t b = row[(k / BLOCK) * 16 + (k % 16)];
    return (k % BLOCK) < 16 ? b & 15 : b >> 4;
}

// ----------------------------------------------------------------------------
// ---- kernels: scalar reference

static void dequant_row_scalar(const uint8_t* q,   // (K/2)
                               const float* s,     // (K/G)
                               const float* z,     // (K/G)
                               float* dst,         // (K)
                               int64_t K, int64_t G) {
    for (int64_t k = 0; k < K; k++) dst[k] = s[k / G] * ((float)code_at(q, k) - z[k / G]);
}

/* For each output row (parallel): dequantize it into a per-thread buffer once, then dot it with
 * every token row using 8 independent partial sums. */
static int linear_scalar(const float* x, const uint8_t* qs, const float* scales,
                         const float* zeros, const float* bias, float* out, int64_t T, int64_t K,
                         int64_t N, int64_t G, int64_t ldo, int nthreads) {
    const int64_t ng = K / G;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float* w = (float*)malloc((size_t)K * sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!w) continue;
            dequant_row_scalar(qs + n * (K / 2), scales + n * ng, zeros + n * ng, w, K, G);
            for (int64_t t = 0; t < T; t++) {
                const float* xr = x + t * K;
                float acc[8] = {0};
                for (int64_t k = 0; k < K; k += 8)
                    for (int i = 0; i < 8; i++) acc[i] += w[k + i] * xr[k + i];
                float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                            ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                out[t * ldo + n] = sum + (bias ? bias[n] : 0.0f);
            }
        }
        free(w);
    }
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: AVX2 + FMA

/* 32 codes of one block (16 bytes at p) -> 4 vectors of weights: elements 0-7, 8-15, 16-23,
 * 24-31. Widening 8 bytes to 8 int32 lanes keeps both nibbles of a byte in one lane. */
AVX2_TARGET INLINE void avx2_decode(const uint8_t* p, __m256 s, __m256 z, __m256 w[4]) {
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    const __m256i m = _mm256_set1_epi32(15);
    w[0] = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, m)), z), s);
    w[1] = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, m)), z), s);
    w[2] = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), z), s);
    w[3] = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), z), s);
}

AVX2_TARGET INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* TILE_ROWS weight rows x NT token rows: each block of a row is decoded once and feeds NT FMAs
 * per vector; one accumulator per (row, token). Short tiles repeat the last row. */
AVX2_TARGET INLINE void avx2_tile(const float* x, const uint8_t* qs, const float* scales,
                                  const float* zeros, const float* bias, float* out, int64_t K,
                                  int64_t G, int64_t ldo, int64_t t0, int64_t n0, int nr,
                                  const int NT) {
    const int64_t ng = K / G;
    const uint8_t* q[TILE_ROWS];
    const float *sr[TILE_ROWS], *zr[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t n = n0 + MIN(r, nr - 1);
        q[r] = qs + n * (K / 2);
        sr[r] = scales + n * ng;
        zr[r] = zeros + n * ng;
    }
    __m256 acc[TILE_ROWS][TILE_T];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {
            for (int r = 0; r < TILE_ROWS; r++) {
                __m256 w[4];
                avx2_decode(q[r] + k / 2, _mm256_set1_ps(sr[r][g]), _mm256_set1_ps(zr[r][g]), w);
                for (int j = 0; j < NT; j++) {
                    const float* xr = x + (t0 + j) * K + k;
                    acc[r][j] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][j]);
                    acc[r][j] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][j]);
                    acc[r][j] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][j]);
                    acc[r][j] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < NT; j++)
            out[(t0 + j) * ldo + n0 + r] = avx2_hsum(acc[r][j]) + (bias ? bias[n0 + r] : 0.0f);
}

AVX2_TARGET static void avx2_block(const float* x, const uint8_t* qs, const float* scales,
                                   const float* zeros, const float* bias, float* out, int64_t K,
                                   int64_t G, int64_t ldo, int64_t t0, int64_t n0, int nr,
                                   int nt) {
    switch (nt) {
        case 1: avx2_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 1); break;
        case 2: avx2_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 2); break;
        case 3: avx2_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 3); break;
        default: avx2_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 4); break;
    }
}

AVX2_TARGET static void dequant_row_avx2(const uint8_t* q, const float* s, const float* z,
                                         float* dst, int64_t K, int64_t G) {
    for (int64_t g = 0; g < K / G; g++) {
        const __m256 sv = _mm256_set1_ps(s[g]), zv = _mm256_set1_ps(z[g]);
        for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {
            __m256 w[4];
            avx2_decode(q + k / 2, sv, zv, w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + k + 8 * i, w[i]);
        }
    }
}

// ----------------------------------------------------------------------------
// ---- kernels: AVX-512

/* The group's 16 possible weights, (i - zero) * scale for i = 0..15: one register. */
AVX512_TARGET INLINE __m512 avx512_table(float s, float z) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_set1_ps(s));
}

/* 32 codes (16 bytes at p) -> weights of elements 0-15 (w0) and 16-31 (w1) by table lookup. */
AVX512_TARGET INLINE void avx512_decode(const uint8_t* p, __m512 table, __m512* w0, __m512* w1) {
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    *w0 = _mm512_permutexvar_ps(lo, table);                         // low nibble: bits 0-3
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), table);   // high nibble
}

/* As avx2_tile, 16 lanes: 4 rows x 4 tokens = 16 accumulators, 4 tables, 8 x vectors. */
AVX512_TARGET INLINE void avx512_tile(const float* x, const uint8_t* qs, const float* scales,
                                      const float* zeros, const float* bias, float* out,
                                      int64_t K, int64_t G, int64_t ldo, int64_t t0, int64_t n0,
                                      int nr, const int NT) {
    const int64_t ng = K / G;
    const uint8_t* q[TILE_ROWS];
    const float *sr[TILE_ROWS], *zr[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t n = n0 + MIN(r, nr - 1);
        q[r] = qs + n * (K / 2);
        sr[r] = scales + n * ng;
        zr[r] = zeros + n * ng;
    }
    __m512 acc[TILE_ROWS][TILE_T];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 table[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) table[r] = avx512_table(sr[r][g], zr[r][g]);
        for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {
            __m512 xv[TILE_T][2];
            for (int j = 0; j < NT; j++) {
                xv[j][0] = _mm512_loadu_ps(x + (t0 + j) * K + k);
                xv[j][1] = _mm512_loadu_ps(x + (t0 + j) * K + k + 16);
            }
            for (int r = 0; r < TILE_ROWS; r++) {
                __m512 w0, w1;
                avx512_decode(q[r] + k / 2, table[r], &w0, &w1);
                for (int j = 0; j < NT; j++) {
                    acc[r][j] = _mm512_fmadd_ps(w0, xv[j][0], acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(w1, xv[j][1], acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < NT; j++)
            out[(t0 + j) * ldo + n0 + r] =
                _mm512_reduce_add_ps(acc[r][j]) + (bias ? bias[n0 + r] : 0.0f);
}

AVX512_TARGET static void avx512_block(const float* x, const uint8_t* qs, const float* scales,
                                       const float* zeros, const float* bias, float* out,
                                       int64_t K, int64_t G, int64_t ldo, int64_t t0, int64_t n0,
                                       int nr, int nt) {
    switch (nt) {
        case 1: avx512_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 1); break;
        case 2: avx512_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 2); break;
        case 3: avx512_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 3); break;
        default: avx512_tile(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, 4); break;
    }
}

AVX512_TARGET static void dequant_row_avx512(const uint8_t* q, const float* s, const float* z,
                                             float* dst, int64_t K, int64_t G) {
    for (int64_t g = 0; g < K / G; g++) {
        const __m512 table = avx512_table(s[g], z[g]);
        for (int64_t k = g * G; k < (g + 1) * G; k += BLOCK) {
            __m512 w0, w1;
            avx512_decode(q + k / 2, table, &w0, &w1);
            _mm512_storeu_ps(dst + k, w0);
            _mm512_storeu_ps(dst + k + 16, w1);
        }
    }
}

// ----------------------------------------------------------------------------
// ---- launchers

int taper_int4_linear(int isa, const float* x, const uint8_t* qs, const float* scales,
                      const float* zeros, const float* bias, float* out, int64_t T, int64_t K,
                      int64_t N, int64_t G, int64_t ldo, int nthreads) {
    if (!isa_supported(isa)) return TAPER_ERR_ISA;
    if (bad_shape(K, G) || ldo < N) return TAPER_ERR_ARG;
    if (T <= 0 || N <= 0) return TAPER_OK;
    if (isa == TAPER_ISA_SCALAR)
        return linear_scalar(x, qs, scales, zeros, bias, out, T, K, N, G, ldo, nthreads);
    const int64_t nblocks = (N + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * TILE_ROWS;
        const int nr = (int)MIN(TILE_ROWS, N - n0);
        for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
            const int nt = (int)MIN(TILE_T, T - t0);
            if (isa == TAPER_ISA_AVX512)
                avx512_block(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, nt);
            else
                avx2_block(x, qs, scales, zeros, bias, out, K, G, ldo, t0, n0, nr, nt);
        }
    }
    return TAPER_OK;
}

int taper_int4_dequantize(int isa, const uint8_t* qs, const float* scales, const float* zeros,
                          float* out, int64_t N, int64_t K, int64_t G, int nthreads) {
    if (!isa_supported(isa)) return TAPER_ERR_ISA;
    if (bad_shape(K, G)) return TAPER_ERR_ARG;
    const int64_t ng = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* q = qs + n * (K / 2);
        const float *s = scales + n * ng, *z = zeros + n * ng;
        if (isa == TAPER_ISA_AVX512)
            dequant_row_avx512(q, s, z, out + n * K, K, G);
        else if (isa == TAPER_ISA_AVX2)
            dequant_row_avx2(q, s, z, out + n * K, K, G);
        else
            dequant_row_scalar(q, s, z, out + n * K, K, G);
    }
    return TAPER_OK;
}

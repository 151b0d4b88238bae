/* The int8 x int8 prefill GEMM of the K types (Q2_K .. Q6_K) on AVX-512 (see quant_internal.h).
 *
 * The vec_dot loop (quant_kernels.c) unpacks a weight super-block again for every token row and
 * sums each (weight row, token row) product horizontally per super-block; both costs grow with
 * T. Here a panel of PANEL_ROWS weight rows is unpacked once (taper_k_unpacked: levels as
 * unsigned bytes, scales spread to maddubs' int16 layout) and every token row runs against it in
 * tiles of NR weight rows x MR activation rows: per 64 elements one maddubs per pair, then the
 * group scales in int16 through vpdpwssd (AVX512_VNNI; madd + add without it). VPDPBUSD would
 * give 4-element int32 sums that still need a per-lane int32 multiply by the group scale
 * (vpmulld): three instructions instead of two. The 16 pairs' integer sums of a super-block are
 * then reduced together (one transpose-add of 16 vectors, not 16 horizontal sums), and the float
 * step runs for the 16 pairs at once, lane by lane, with vec_dot's kacc expression in vec_dot's
 * block order: every integer is exact and every float operation the same, so the result is
 * bit-identical to the vec_dot loop (and so to the scalar reference). No AMX.
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant_internal.h"

#define QK_K TAPER_QK_K
#define NR 4            /* weight rows per register tile */
#define MR 4            /* activation rows per register tile: NR * MR = 16 accumulators */
/* Weight rows unpacked together: 16 x K/256 x 552 bytes (168 KB at K = 4864) stay in L2 while
   each MR-row activation tile (K/256 x 292 bytes each, 22 KB at K = 4864) stays in L1. */
#define PANEL_ROWS 16
_Static_assert(NR == 4 && MR == 4, "the tile's reductions and scale vectors are 4 x 4");

typedef taper_block_q8_K bq8_K;

/* 16 int32 vectors -> one whose lane j is the sum of v[j]'s 16 lanes (transpose and add) */
/* the same for 16 vectors of 8 int32 (256-bit: single-uop on Zen 4) */
#define REDUCE16_256(TARGET, name)                                                              \
    TARGET static inline __attribute__((always_inline)) __m512i name(const __m256i *v) {       \
        __m256i a[8], b[4];                                                                     \
        for (int i = 0; i < 8; i++)                                                             \
            a[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),              \
                                    _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));             \
        for (int i = 0; i < 4; i++)                                                             \
            b[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]),              \
                                    _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));             \
        const __m256i lo = _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20),        \
                                            _mm256_permute2x128_si256(b[0], b[1], 0x31));       \
        const __m256i hi = _mm256_add_epi32(_mm256_permute2x128_si256(b[2], b[3], 0x20),        \
                                            _mm256_permute2x128_si256(b[2], b[3], 0x31));       \
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);                           \
    }

#define REDUCE16(TARGET, name)                                                                  \
    TARGET static inline __attribute__((always_inline)) __m512i name(const __m512i *v) {       \
        __m512i a[8], b[4];                                                                     \
        for (int i = 0; i < 8; i++)                                                             \
            a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),              \
                                    _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));             \
        for (int i = 0; i < 4; i++)                                                             \
            b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),              \
                                    _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));             \
        /* b[k] lane-in-128 j = part of v[4k + j] from that 128-bit lane: sum the 4 lanes */    \
        const __m512i w01 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88),            \
                                             _mm512_shuffle_i32x4(b[0], b[1], 0xDD));           \
        const __m512i w23 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x88),            \
                                             _mm512_shuffle_i32x4(b[2], b[3], 0xDD));           \
        return _mm512_add_epi32(_mm512_shuffle_i32x4(w01, w23, 0x88),                           \
                                _mm512_shuffle_i32x4(w01, w23, 0xDD));                          \
    }

/* One NR x MR tile over all nb super-blocks: res[n * MR + r] = vec_dot(W[n], X[r]).
   w[n]: row n's unpacked blocks; x[r]: activation row r's Q8_K blocks. */
#define TILE(TARGET, name, reduce, DOT_ACC, min_in_isum)                                        \
    TARGET static void name(const taper_k_unpacked *const *w, const bq8_K *const *x,           \
                            int64_t nb, float *res) {                                           \
        __m512 accf = _mm512_setzero_ps();                                                      \
        for (int64_t i = 0; i < nb; i++) {                                                      \
            __m512i acc[NR * MR];                                                               \
            for (int j = 0; j < NR * MR; j++) acc[j] = _mm512_setzero_si512();                  \
            for (int c = 0; c < QK_K / 64; c++) {                                               \
                __m512i q[MR];                                                                  \
                for (int r = 0; r < MR; r++)                                                    \
                    q[r] = _mm512_loadu_si512((const void *)(x[r][i].qs + 64 * c));             \
                for (int n = 0; n < NR; n++) {                                                  \
                    const __m512i u = _mm512_loadu_si512((const void *)(w[n][i].u + 64 * c));   \
                    const __m512i s = _mm512_loadu_si512((const void *)(w[n][i].sc + 32 * c));  \
                    for (int r = 0; r < MR; r++)                                                \
                        acc[n * MR + r] = DOT_ACC(acc[n * MR + r], _mm512_maddubs_epi16(u, q[r]), s); \
                }                                                                               \
            }                                                                                   \
            /* the bsums term: added to isum's lanes before the reduction for the signed types; \
               else reduced on its own (256-bit: 16 int16 products per pair) */                \
            __m256i m[NR * MR];                                                                 \
            for (int n = 0; n < NR; n++) {                                                      \
                const __m256i mn = _mm256_loadu_si256((const __m256i *)w[n][i].mn);             \
                for (int r = 0; r < MR; r++)                                                    \
                    m[n * MR + r] = _mm256_madd_epi16(                                          \
                        _mm256_loadu_si256((const __m256i *)x[r][i].bsums), mn);                \
            }                                                                                   \
            __m512i summs = _mm512_setzero_si512();                                             \
            if (min_in_isum)                                                                    \
                for (int j = 0; j < NR * MR; j++)                                               \
                    acc[j] = _mm512_add_epi32(acc[j], _mm512_zextsi256_si512(m[j]));            \
            else                                                                                \
                summs = reduce##_256(m);                                                        \
            const __m512i isum = reduce(acc);                                                   \
            /* lane n * MR + r: dx of row r, d and dmin of row n */                             \
            const __m512 vx = _mm512_broadcast_f32x4(                                           \
                _mm_set_ps(x[3][i].d, x[2][i].d, x[1][i].d, x[0][i].d));                        \
            const __m512i by_n = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); \
            const __m512 vd = _mm512_permutexvar_ps(by_n, _mm512_castps128_ps512(               \
                _mm_set_ps(w[3][i].d, w[2][i].d, w[1][i].d, w[0][i].d)));                       \
            const __m512 vdmin = _mm512_permutexvar_ps(by_n, _mm512_castps128_ps512(            \
                _mm_set_ps(w[3][i].dmin, w[2][i].dmin, w[1][i].dmin, w[0][i].dmin)));           \
            /* kacc, lane by lane: acc + ((dx * d) * isum - (dx * dmin) * summs) */             \
            const __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(vx, vd), _mm512_cvtepi32_ps(isum));   \
            const __m512 t2 = _mm512_mul_ps(_mm512_mul_ps(vx, vdmin), _mm512_cvtepi32_ps(summs)); \
            accf = _mm512_add_ps(accf, _mm512_sub_ps(t1, t2));                                  \
        }                                                                                       \
        _mm512_storeu_ps(res, accf);                                                            \
    }

#define BW_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define DOT_ACC_BW(acc, p, s) _mm512_add_epi32(acc, _mm512_madd_epi16(p, s))
#define DOT_ACC_VNNI(acc, p, s) _mm512_dpwssd_epi32(acc, p, s)

REDUCE16(BW_TARGET, reduce16_bw)
REDUCE16(VNNI_TARGET, reduce16_vnni)
REDUCE16_256(BW_TARGET, reduce16_bw_256)
REDUCE16_256(VNNI_TARGET, reduce16_vnni_256)
/* one body per min_in_isum value: no branch in the block loop */
TILE(BW_TARGET, tile_bw, reduce16_bw, DOT_ACC_BW, 0)
TILE(BW_TARGET, tile_bw_signed, reduce16_bw, DOT_ACC_BW, 1)
TILE(VNNI_TARGET, tile_vnni, reduce16_vnni, DOT_ACC_VNNI, 0)
TILE(VNNI_TARGET, tile_vnni_signed, reduce16_vnni, DOT_ACC_VNNI, 1)

int taper_k_gemm_int8(const taper_quant_traits *t, int vnni, const void *xq, int parts,
                      const void *w, const float *bias, float *out, int64_t T, int64_t K,
                      int64_t N, int64_t ldo, int nthreads) {
    if (!t->k_unpack || K % QK_K || (parts != 1 && parts != 2)) return TAPER_ERR_ARG;
    const int64_t nb = K / QK_K, w_row = nb * t->type_size;
    const bq8_K *xb = xq;
    const int64_t panels = (N + PANEL_ROWS - 1) / PANEL_ROWS;
    /* an MR-row activation tile is MR / parts token rows (hi and lo rows side by side) */
    const int64_t tok = MR / parts, tiles = (T + tok - 1) / tok;
    int status = TAPER_OK;
    #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
        taper_k_unpacked *buf = malloc((size_t)(PANEL_ROWS * nb) * sizeof *buf);
        if (!buf) {
            #pragma omp atomic write
            status = TAPER_ERR_NOMEM;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!buf) continue;
            const int64_t n0 = p * PANEL_ROWS;
            const int64_t rows = N - n0 < PANEL_ROWS ? N - n0 : PANEL_ROWS;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < nb; i++)
                    t->k_unpack((const uint8_t *)w + (n0 + r) * w_row + i * t->type_size,
                                &buf[r * nb + i]);
            for (int64_t ti = 0; ti < tiles; ti++) {
                const int64_t t0 = ti * tok;
                const bq8_K *xr[MR];
                /* rows past T repeat the last one (their results are not stored) */
                for (int j = 0; j < MR; j++) {
                    int64_t tr = t0 + j / parts;
                    if (tr >= T) tr = T - 1;
                    xr[j] = xb + ((j % parts) * T + tr) * nb;
                }
                for (int64_t nn = 0; nn < rows; nn += NR) {
                    const taper_k_unpacked *wr[NR];
                    for (int n = 0; n < NR; n++)
                        wr[n] = buf + (nn + n < rows ? nn + n : rows - 1) * nb;
                    float res[NR * MR];
                    if (vnni) (t->min_in_isum ? tile_vnni_signed : tile_vnni)(wr, xr, nb, res);
                    else (t->min_in_isum ? tile_bw_signed : tile_bw)(wr, xr, nb, res);
                    for (int n = 0; n < NR && nn + n < rows; n++) {
                        const int64_t col = n0 + nn + n;
                        const float b = bias ? bias[col] : 0.0f;
                        for (int j = 0; j < tok && t0 + j < T; j++) {
                            const float *v = res + n * MR + j * parts;
                            /* vec_dot2's acc + acc2, then the bias, as the vec_dot loop */
                            out[(t0 + j) * ldo + col] = (parts == 2 ? v[0] + v[1] : v[0]) + b;
                        }
                    }
                }
            }
        }
        free(buf);
    }
    return status;
}

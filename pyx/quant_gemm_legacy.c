/* The int8 x int8 prefill GEMM of the legacy types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0) on AVX512_VNNI.
 *
 * What it must reproduce: the AVX-512 vec_dot (quant_legacy.c, avx512_dot), which is not the
 * scalar reference's float order. Per pair of blocks it forms 16 int32 sums of 4 consecutive
 * products (8 per block), converts them to float and adds them, times d_w * d_x, into 16 float
 * lanes by FMA (the even blocks in lanes 0-7, the odd ones in 8-15); the row's result is
 * _mm512_reduce_add_ps of those lanes, plus the _1 types' minimum terms m_w * s_x summed per
 * even and odd block, plus an odd last block through the AVX2 body. Here every (weight row,
 * token row) pair keeps those same 16 lanes, so per 64 elements and pair the work is
 * vpdpbusd + cvt + mul (d_w * d_x) + FMA, the weights unpacked once per panel of PANEL_ROWS
 * rows (taper_legacy_unpacked) rather than per token row, in tiles of NR weight rows x MR
 * activation rows. Every integer is exact and every float operation the vec_dot's, in its
 * order, so the result is bit-identical to the vec_dot loop on AVX-512.
 *
 * vpdpbusd multiplies unsigned by signed bytes: the activations (|y| <= 127) go in as y + 128,
 * and the weight chunk's c (-128 times each 4 codes' sum) starts the accumulator, so a lane
 * ends at exactly sum(y * w) over its 4 elements, as maddubs + madd give it in vec_dot. Without
 * VNNI there is no such path (maddubs would saturate on 255 x 128), and the float32 panels stay.
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant_internal.h"

#define QK TAPER_QK
#define NR 4            /* weight rows per register tile */
#define MR 4            /* activation rows per register tile: NR * MR = 16 accumulators */
/* Weight rows unpacked together: 16 x K/64 x 128 bytes (156 KB at K = 4864) stay in L2 while
   an MR-row activation tile (K bytes each, 19 KB at K = 4864) stays in L1. */
#define PANEL_ROWS 16
_Static_assert(NR == 4 && MR == 4, "the tile's scale vectors are 4 x 4");
_Static_assert(PANEL_ROWS % NR == 0, "the panel's scales are kept per NR rows");

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* quant_legacy.c's avx2_hsum: the same adds in the same order */
VNNI_TARGET static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One NR x MR tile over all nb blocks: res[n * MR + r] = vec_dot(W[n], X[r]).
 * w[n]: row n's unpacked chunks; x[r]: activation row r as y + 128, 64 bytes per chunk.
 * dw, mw: the NR rows' d and m, block i's at [4 i + n]; dx, sx: the MR rows' d and s, block i's
 * at [4 i + r] (the tile's scales transposed, so one load serves the tile). */
VNNI_TARGET static inline __attribute__((always_inline)) void tile_body(
        const taper_legacy_unpacked *const *w, const uint8_t *const *x, const float *dw,
        const float *mw, const float *dx, const float *sx, int64_t nb, float *res,
        const int with_min) {
    /* lanes 0-7: entry r of block 2j (as [4 j..]), lanes 8-15: entry r of block 2j + 1 */
    const __m512i by_r[4] = {
        _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 2, 2, 2, 2, 2, 2, 2, 2),
        _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 3, 3, 3, 3, 3, 3, 3, 3)};
    const __m512i by_n = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[NR * MR];
    for (int j = 0; j < NR * MR; j++) acc[j] = _mm512_setzero_ps();
    const int64_t nc = nb / 2;
    for (int64_t j = 0; j < nc; j++) {
        const __m512 dxv = _mm512_castps256_ps512(_mm256_loadu_ps(dx + 8 * j));
        const __m512 dwv = _mm512_castps256_ps512(_mm256_loadu_ps(dw + 8 * j));
        __m512i y[MR];
        __m512 vx[MR];
        for (int r = 0; r < MR; r++) {
            y[r] = _mm512_loadu_si512((const void *)(x[r] + 64 * j));
            vx[r] = _mm512_permutexvar_ps(by_r[r], dxv);
        }
        for (int n = 0; n < NR; n++) {
            const __m512i u = _mm512_loadu_si512((const void *)w[n][j].q);
            const __m512i c = _mm512_loadu_si512((const void *)w[n][j].c);
            const __m512 vw = _mm512_permutexvar_ps(by_r[n], dwv);
            for (int r = 0; r < MR; r++) {
                const __m512i p = _mm512_dpbusd_epi32(c, y[r], u);
                acc[n * MR + r] = _mm512_fmadd_ps(_mm512_mul_ps(vw, vx[r]),
                                                  _mm512_cvtepi32_ps(p), acc[n * MR + r]);
            }
        }
    }
    /* the _1 types' m_w * s_x, lane n * MR + r, even and odd blocks apart (vec_dot's mins); a
       loop of its own: inside the one above its two vectors would push accumulators out of the
       32 registers */
    __m512 mins_e = _mm512_setzero_ps(), mins_o = _mm512_setzero_ps();
    for (int64_t j = 0; with_min && j < nc; j++) {
        const __m512 me = _mm512_mul_ps(
            _mm512_permutexvar_ps(by_n, _mm512_castps128_ps512(_mm_loadu_ps(mw + 8 * j))),
            _mm512_broadcast_f32x4(_mm_loadu_ps(sx + 8 * j)));
        const __m512 mo = _mm512_mul_ps(
            _mm512_permutexvar_ps(by_n, _mm512_castps128_ps512(_mm_loadu_ps(mw + 8 * j + 4))),
            _mm512_broadcast_f32x4(_mm_loadu_ps(sx + 8 * j + 4)));
        mins_e = _mm512_add_ps(mins_e, me);
        mins_o = _mm512_add_ps(mins_o, mo);
    }
    for (int j = 0; j < NR * MR; j++) res[j] = _mm512_reduce_add_ps(acc[j]);
    if (with_min)
        _mm512_storeu_ps(res, _mm512_add_ps(_mm512_loadu_ps(res), _mm512_add_ps(mins_e, mins_o)));
    if (nb & 1) {   /* vec_dot's odd last block: avx2_dot on one block */
        const int64_t i = nb - 1;
        for (int n = 0; n < NR; n++) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)w[n][nc].q);
            const __m256i c = _mm256_loadu_si256((const __m256i *)w[n][nc].c);
            for (int r = 0; r < MR; r++) {
                const __m256i p = _mm256_dpbusd_epi32(
                    c, _mm256_loadu_si256((const __m256i *)(x[r] + 64 * nc)), u);
                const float s = dw[4 * i + n] * dx[4 * i + r];
                const __m256 a = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(p),
                                                 _mm256_setzero_ps());
                const float mins = with_min ? 0.0f + mw[4 * i + n] * sx[4 * i + r] : 0.0f;
                res[n * MR + r] += hsum256(a) + mins;
            }
        }
    }
}

VNNI_TARGET static void tile(const taper_legacy_unpacked *const *w, const uint8_t *const *x,
                             const float *dw, const float *mw, const float *dx, const float *sx,
                             int64_t nb, float *res) {
    tile_body(w, x, dw, mw, dx, sx, nb, res, 0);
}

VNNI_TARGET static void tile_min(const taper_legacy_unpacked *const *w, const uint8_t *const *x,
                                 const float *dw, const float *mw, const float *dx,
                                 const float *sx, int64_t nb, float *res) {
    tile_body(w, x, dw, mw, dx, sx, nb, res, 1);
}

/* The activation tile's d (and Q8_1's s) per block, transposed: [(ti * nb + i) * MR + j] for
   tile row j (part j % parts of token ti * tok + j / parts; rows past T repeat the last one,
   their results are not stored). F16C's conversion is exact, as taper_half_to_float. */
VNNI_TARGET static void tile_scales(const uint8_t *xq, int64_t ti, int64_t tok, int parts,
                                    int64_t T, int64_t nb, int64_t xs, int with_min, float *xd,
                                    float *xsum) {
    for (int j = 0; j < MR; j++) {
        int64_t tr = ti * tok + j / parts;
        if (tr >= T) tr = T - 1;
        const uint8_t *row = xq + ((j % parts) * T + tr) * nb * xs;
        for (int64_t i = 0; i < nb; i++) {
            uint32_t h;
            memcpy(&h, row + i * xs, 4);   /* d, then s (Q8_1) or the first two qs (Q8_0) */
            const __m128 ds = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h));
            xd[(ti * nb + i) * MR + j] = _mm_cvtss_f32(ds);
            xsum[(ti * nb + i) * MR + j] = with_min ? _mm_cvtss_f32(_mm_movehdup_ps(ds)) : 0.0f;
        }
    }
}

int taper_legacy_gemm_int8(const taper_quant_traits *t, const void *xq, int parts, const void *w,
                           const float *bias, float *out, int64_t T, int64_t K, int64_t N,
                           int64_t ldo, int nthreads) {
    if (!t->legacy_unpack || K % QK || (parts != 1 && parts != 2)) return TAPER_ERR_ARG;
    const int with_min = t->vec_dot_type == TAPER_Q8_1;
    const int64_t nb = K / QK, nc = (nb + 1) / 2, w_row = nb * t->type_size;
    /* the activation blocks: Q8_1 has s after d, then both have 32 int8 */
    const int64_t xs = with_min ? sizeof(taper_block_q8_1) : sizeof(taper_block_q8_0);
    const int64_t xo = with_min ? 4 : 2;
    const int64_t xrows = T * parts;
    const int nt = nthreads > 0 ? nthreads : 1;
    /* an MR-row activation tile is MR / parts token rows (hi and lo rows side by side) */
    const int64_t tok = MR / parts, tiles = (T + tok - 1) / tok;
    const int64_t panels = (N + PANEL_ROWS - 1) / PANEL_ROWS;
    uint8_t *xy = malloc((size_t)(xrows * nc * 64));
    float *xsc = malloc((size_t)(2 * tiles * nb * MR) * sizeof(float));   /* d, then s */
    if (!xy || !xsc) {
        free(xy);
        free(xsc);
        return TAPER_ERR_NOMEM;
    }
    float *xd = xsc, *xsum = xsc + tiles * nb * MR;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < xrows; r++) {
        const uint8_t *src = (const uint8_t *)xq + r * nb * xs + xo;
        uint8_t *dst = xy + r * nc * 64;
        for (int64_t i = 0; i < nb; i++)
            for (int k = 0; k < QK; k++) dst[QK * i + k] = src[i * xs + k] ^ 0x80;
        if (nb & 1) memset(dst + QK * nb, 0x80, QK);
    }
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t ti = 0; ti < tiles; ti++)
        tile_scales(xq, ti, tok, parts, T, nb, xs, with_min, xd, xsum);
    int status = TAPER_OK;
    #pragma omp parallel num_threads(nt)
    {
        taper_legacy_unpacked *buf = malloc((size_t)(PANEL_ROWS * nc) * sizeof *buf);
        float *wsc = malloc((size_t)(2 * PANEL_ROWS * nb) * sizeof(float));   /* d, then m */
        if (!buf || !wsc) {
            #pragma omp atomic write
            status = TAPER_ERR_NOMEM;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!buf || !wsc) continue;
            float *wd = wsc, *wm = wsc + PANEL_ROWS * nb;
            const int64_t n0 = p * PANEL_ROWS;
            const int64_t rows = N - n0 < PANEL_ROWS ? N - n0 : PANEL_ROWS;
            /* rows up to the next multiple of NR repeat the last one (not stored either) */
            const int64_t filled = (rows + NR - 1) / NR * NR;
            for (int64_t r = 0; r < filled; r++) {
                const int64_t src = n0 + (r < rows ? r : rows - 1);
                const int64_t g = (r / NR) * nb * NR + r % NR;
                t->legacy_unpack((const uint8_t *)w + src * w_row, nb, buf + r * nc, wd + g,
                                 wm + g, NR);
            }
            for (int64_t ti = 0; ti < tiles; ti++) {
                const int64_t t0 = ti * tok;
                const uint8_t *xr[MR];
                for (int j = 0; j < MR; j++) {
                    int64_t tr = t0 + j / parts;
                    if (tr >= T) tr = T - 1;
                    xr[j] = xy + ((j % parts) * T + tr) * nc * 64;
                }
                const float *dx = xd + ti * nb * MR, *sx = xsum + ti * nb * MR;
                for (int64_t nn = 0; nn < rows; nn += NR) {
                    const taper_legacy_unpacked *wr[NR];
                    for (int n = 0; n < NR; n++) wr[n] = buf + (nn + n) * nc;
                    const float *dw = wd + (nn / NR) * nb * NR, *mw = wm + (nn / NR) * nb * NR;
                    float res[NR * MR];
                    (with_min ? tile_min : tile)(wr, xr, dw, mw, dx, sx, nb, res);
                    for (int n = 0; n < NR && nn + n < rows; n++) {
                        const int64_t col = n0 + nn + n;
                        const float b = bias ? bias[col] : 0.0f;
                        for (int j = 0; j < tok && t0 + j < T; j++) {
                            const float *v = res + n * MR + j * parts;
                            /* vec_dot(hi) + vec_dot(lo), then the bias, as the vec_dot loop */
                            out[(t0 + j) * ldo + col] = (parts == 2 ? v[0] + v[1] : v[0]) + b;
                        }
                    }
                }
            }
        }
        free(buf);
        free(wsc);
    }
    free(xy);
    free(xsc);
    return status;
}

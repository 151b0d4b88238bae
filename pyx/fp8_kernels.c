/* Taper FP8 weight kernels (C11 + OpenMP). See fp8_kernels.h for the ABI.
 *
 * The weight stays 1 byte per element in memory; e4m3 codes are decoded in registers (bit
 * arithmetic, fp8_e4m3.h) and the block scales are applied inside the kernel:
 *  - small T (decode, T <= FP8_SMALL_T): dot products straight from the codes, up to 4 tokens per
 *    weight row read; per (row, column block) the partial sums are multiplied by that block's scale
 *    once (one FMA per 16 lanes per block), so the inner loop is decode + FMA only;
 *  - larger T (prefill): packed GEMM. A panel of NR weight rows x KC columns is decoded with each
 *    element times its block scale into f32, transposed k-major, and an MR x NR register tile of
 *    outputs accumulates over it (broadcast x, FMA against the panel) -- the scheme of
 *    cpu_kernels.c's f32/bf16 GEMM, with decoding in place of widening;
 *  - scalar: one weight row decoded (and scaled) into a per-thread buffer, dotted with every token.
 * Three ISA paths compiled side by side with target attributes (no -march=native), chosen by the
 * caller; AVX-512 needs only F/BW/VL (no FP16, BF16 or AMX).
 */
#include "fp8_kernels.h"

#include <omp.h>
#include <stdlib.h>

#include "fp8_e4m3.h"

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define INLINE static inline __attribute__((always_inline))
#define AVX2_TARGET E4M3_AVX2
#define AVX512_TARGET E4M3_AVX512

#define FP8_SMALL_T 4   // tokens up to which the unpacked dot-product path is used
#define FP8_KC 256      // panel depth (columns of W per packed panel)

int taper_fp8_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case TAPER_ISA_SCALAR: return 1;
        case TAPER_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case TAPER_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && taper_fp8_isa_supported(TAPER_ISA_AVX2);
        default: return 0;
    }
}

// ----------------------------------------------------------------------------
// ---- helpers: decode a row range with its block scales

typedef void (*row_fn)(const uint8_t*, float, float*, int64_t);

/* dst[k - k0] = decode(wr[k]) * sr[k / bk] for k in [k0, k0 + kc): one run per column block. */
INLINE void decode_range(row_fn dec, const uint8_t* wr,  // (K,) codes of one row
                         const float* sr,                // (KB,) that row block's scales
                         int64_t bk, int64_t k0, int64_t kc, float* dst) {
    for (int64_t k = k0; k < k0 + kc;) {
        int64_t kb = k / bk, end = MIN(k0 + kc, (kb + 1) * bk);
        dec(wr + k, sr[kb], dst + (k - k0), end - k);
        k = end;
    }
}

// ----------------------------------------------------------------------------
// ---- kernels: scalar path

static int fp8_linear_scalar(const float* x, const uint8_t* w, const float* scale, int64_t bn,
                             int64_t bk, const float* bias, float* out, int64_t T, int64_t K,
                             int64_t N, int nthreads) {
    int64_t KB = (K + bk - 1) / bk;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (N * K > 32768)
    {
        float* buf = (float*)malloc((size_t)MAX(K, 1) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!buf) continue;
            decode_range(taper_e4m3_row_scalar, w + n * K, scale + (n / bn) * KB, bk, 0, K, buf);
            float b = bias ? bias[n] : 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const float* xr = x + t * K;
                float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int64_t k = 0;
                for (; k + 8 <= K; k += 8)
                    for (int u = 0; u < 8; u++) s[u] += xr[k + u] * buf[k + u];
                for (; k < K; k++) s[0] += xr[k] * buf[k];
                out[t * N + n] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) + b;
            }
        }
        free(buf);
    }
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: small T (decode), dot products on the codes

/* NT tokens (1..4) against weight row wr: res[t] = sum_kb s[kb] * sum_{k in kb} x[t,k] * w[k]. */
AVX512_TARGET INLINE void dot_row_avx512(const float* x, int64_t K, const uint8_t* wr,
                                         const float* sr, int64_t bk, const int NT, float* res) {
    __m512 acc[4], part[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
        int64_t k1 = MIN(K, k0 + bk), k = k0;
        for (int t = 0; t < NT; t++) part[t] = _mm512_setzero_ps();
        for (; k + 16 <= k1; k += 16) {
            __m512 wv = taper_e4m3x16_avx512(wr + k);
            for (int t = 0; t < NT; t++)
                part[t] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * K + k), wv, part[t]);
        }
        if (k < k1) {
            int r = (int)(k1 - k);
            __mmask16 m = (__mmask16)((1u << r) - 1);
            __m512 wv = taper_e4m3x16_avx512_tail(wr + k, r);
            for (int t = 0; t < NT; t++)
                part[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + t * K + k), wv, part[t]);
        }
        __m512 s = _mm512_set1_ps(sr[kb]);
        for (int t = 0; t < NT; t++) acc[t] = _mm512_fmadd_ps(part[t], s, acc[t]);
    }
    for (int t = 0; t < NT; t++) res[t] = _mm512_reduce_add_ps(acc[t]);
}

AVX2_TARGET INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_TARGET INLINE void dot_row_avx2(const float* x, int64_t K, const uint8_t* wr, const float* sr,
                                     int64_t bk, const int NT, float* res) {
    __m256 acc[4], part[4];
    float tail[4];
    for (int t = 0; t < NT; t++) {
        acc[t] = _mm256_setzero_ps();
        tail[t] = 0.0f;
    }
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
        int64_t k1 = MIN(K, k0 + bk), k = k0;
        float s = sr[kb];
        for (int t = 0; t < NT; t++) part[t] = _mm256_setzero_ps();
        for (; k + 8 <= k1; k += 8) {
            __m256 wv = taper_e4m3x8_avx2(wr + k);
            for (int t = 0; t < NT; t++)
                part[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * K + k), wv, part[t]);
        }
        for (; k < k1; k++) {
            float wk = taper_e4m3_lut[wr[k]] * s;
            for (int t = 0; t < NT; t++) tail[t] += x[t * K + k] * wk;
        }
        __m256 sv = _mm256_set1_ps(s);
        for (int t = 0; t < NT; t++) acc[t] = _mm256_fmadd_ps(part[t], sv, acc[t]);
    }
    for (int t = 0; t < NT; t++) res[t] = hsum256(acc[t]) + tail[t];
}

#define SMALL_T_DRIVER(isa)                                                                      \
    static void fp8_small_##isa(const float* x, const uint8_t* w, const float* scale, int64_t bn, \
                                int64_t bk, const float* bias, float* out, int64_t T, int64_t K,  \
                                int64_t N, int nthreads) {                                        \
        int64_t KB = (K + bk - 1) / bk;                                                           \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)")     \
        for (int64_t n = 0; n < N; n++) {                                                         \
            const uint8_t* wr = w + n * K;                                                        \
            const float* sr = scale + (n / bn) * KB;                                              \
            float b = bias ? bias[n] : 0.0f, res[4];                                              \
            for (int64_t t0 = 0; t0 < T; t0 += 4) {                                               \
                int nt = (int)MIN(4, T - t0);                                                     \
                const float* xt = x + t0 * K;                                                     \
                switch (nt) {                                                                     \
                    case 1: dot_row_##isa(xt, K, wr, sr, bk, 1, res); break;                      \
                    case 2: dot_row_##isa(xt, K, wr, sr, bk, 2, res); break;                      \
                    case 3: dot_row_##isa(xt, K, wr, sr, bk, 3, res); break;                      \
                    default: dot_row_##isa(xt, K, wr, sr, bk, 4, res); break;                     \
                }                                                                                 \
                for (int t = 0; t < nt; t++) out[(t0 + t) * N + n] = res[t] + b;                  \
            }                                                                                     \
        }                                                                                         \
    }

AVX512_TARGET SMALL_T_DRIVER(avx512)
AVX2_TARGET SMALL_T_DRIVER(avx2)

// ----------------------------------------------------------------------------
// ---- kernels: packed GEMM (prefill)

#define AVX512_MR 8
#define AVX512_NR 32
#define AVX2_MR 6
#define AVX2_NR 16

/* AVX-512 micro-kernel: 8 token rows x 32 weight rows = 16 zmm accumulators over a (kc, 32)
 * panel; out (at row t, column n0) += the tile, or = on the first panel, + bias on the last. */
AVX512_TARGET static void micro_avx512(const float* x, int64_t K, int mr, const float* packed,
                                       int64_t kc, float* out, int64_t N, int nr, int first,
                                       const float* bias_or_null) {
    const float* xr[AVX512_MR];
    for (int i = 0; i < AVX512_MR; i++) xr[i] = x + MIN(i, mr - 1) * K;
    __m512 c[AVX512_MR][2];
    for (int i = 0; i < AVX512_MR; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kc; kk++) {
        __m512 b0 = _mm512_load_ps(packed + kk * AVX512_NR);
        __m512 b1 = _mm512_load_ps(packed + kk * AVX512_NR + 16);
        for (int i = 0; i < AVX512_MR; i++) {
            __m512 a = _mm512_set1_ps(xr[i][kk]);
            c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
        }
    }
    __mmask16 m0 = (__mmask16)(nr >= 16 ? 0xffff : ((1u << nr) - 1));
    __mmask16 m1 = (__mmask16)(nr >= 32 ? 0xffff : nr <= 16 ? 0 : ((1u << (nr - 16)) - 1));
    __m512 bv0 = bias_or_null ? _mm512_maskz_loadu_ps(m0, bias_or_null) : _mm512_setzero_ps();
    __m512 bv1 = bias_or_null ? _mm512_maskz_loadu_ps(m1, bias_or_null + 16) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++) {
        float* o = out + i * N;
        __m512 o0 = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, o);
        __m512 o1 = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, o + 16);
        _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_add_ps(o0, c[i][0]), bv0));
        _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_add_ps(o1, c[i][1]), bv1));
    }
}

/* AVX-512 panel: rows n0 .. n0+nr (<= 32), columns k0 .. k0+kc decoded and scaled into tmp
 * (32, FP8_KC) row-major, then 16 x 16 blocks transposed in registers into dst (kc, 32). */
AVX512_TARGET static void pack_avx512(const uint8_t* w, const float* scale, int64_t bn, int64_t bk,
                                      int64_t K, int64_t n0, int nr, int64_t k0, int64_t kc,
                                      float* tmp, float* dst) {
    int64_t KB = (K + bk - 1) / bk;
    for (int j = 0; j < AVX512_NR; j++) {
        float* tr = tmp + j * FP8_KC;
        if (j < nr) {
            int64_t n = n0 + j;
            decode_range(taper_e4m3_row_avx512, w + n * K, scale + (n / bn) * KB, bk, k0, kc, tr);
        } else {
            for (int64_t kk = 0; kk < kc; kk++) tr[kk] = 0.0f;
        }
    }
    for (int j0 = 0; j0 < AVX512_NR; j0 += 16) {
        for (int64_t kk = 0; kk < kc; kk += 16) {
            int nk = (int)MIN(16, kc - kk);
            __mmask16 m = (__mmask16)(nk == 16 ? 0xffff : (1u << nk) - 1);
            __m512 r[16], t[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_maskz_loadu_ps(m, tmp + (j0 + j) * FP8_KC + kk);
            for (int j = 0; j < 16; j += 2) {
                t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) {
                r[j] = _mm512_shuffle_ps(t[j], t[j + 2], 0x44);
                r[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], 0xEE);
                r[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                r[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
            }
            for (int c = 0; c < 4; c++) {
                t[c] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0x88);
                t[c + 4] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0xdd);
                t[c + 8] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0x88);
                t[c + 12] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0xdd);
            }
            for (int c = 0; c < 4; c++) {
                r[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
                r[c + 4] = _mm512_shuffle_f32x4(t[c + 4], t[c + 12], 0x88);
                r[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd);
                r[c + 12] = _mm512_shuffle_f32x4(t[c + 4], t[c + 12], 0xdd);
            }
            for (int i = 0; i < nk; i++) _mm512_store_ps(dst + (kk + i) * AVX512_NR + j0, r[i]);
        }
    }
}

/* AVX2 micro-kernel: 6 token rows x 16 weight rows = 12 ymm accumulators (of 16 registers). */
AVX2_TARGET static void micro_avx2(const float* x, int64_t K, int mr, const float* packed,
                                   int64_t kc, float* out, int64_t N, int nr, int first,
                                   const float* bias_or_null) {
    const float* xr[AVX2_MR];
    for (int i = 0; i < AVX2_MR; i++) xr[i] = x + MIN(i, mr - 1) * K;
    __m256 c[AVX2_MR][2];
    for (int i = 0; i < AVX2_MR; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < kc; kk++) {
        __m256 b0 = _mm256_load_ps(packed + kk * AVX2_NR);
        __m256 b1 = _mm256_load_ps(packed + kk * AVX2_NR + 8);
        for (int i = 0; i < AVX2_MR; i++) {
            __m256 a = _mm256_broadcast_ss(xr[i] + kk);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    float res[AVX2_NR] __attribute__((aligned(32)));
    for (int i = 0; i < mr; i++) {
        _mm256_store_ps(res, c[i][0]);
        _mm256_store_ps(res + 8, c[i][1]);
        float* o = out + i * N;
        for (int j = 0; j < nr; j++) {
            float v = first ? res[j] : o[j] + res[j];
            o[j] = bias_or_null ? v + bias_or_null[j] : v;
        }
    }
}

/* AVX2 panel: rows decoded and scaled into tmp (16, FP8_KC), then 8 x 8 blocks transposed in
 * registers into dst (kc, 16); the last partial group of 8 columns is copied element-wise. */
AVX2_TARGET static void pack_avx2(const uint8_t* w, const float* scale, int64_t bn, int64_t bk,
                                  int64_t K, int64_t n0, int nr, int64_t k0, int64_t kc,
                                  float* tmp, float* dst) {
    int64_t KB = (K + bk - 1) / bk;
    for (int j = 0; j < AVX2_NR; j++) {
        float* tr = tmp + j * FP8_KC;
        if (j < nr) {
            int64_t n = n0 + j;
            decode_range(taper_e4m3_row_avx2, w + n * K, scale + (n / bn) * KB, bk, k0, kc, tr);
        } else {
            for (int64_t kk = 0; kk < kc; kk++) tr[kk] = 0.0f;
        }
    }
    for (int j0 = 0; j0 < AVX2_NR; j0 += 8) {
        int64_t kk = 0;
        for (; kk + 8 <= kc; kk += 8) {
            __m256 r[8], t[8];
            for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(tmp + (j0 + j) * FP8_KC + kk);
            for (int j = 0; j < 8; j += 2) {
                t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 8; j += 4) {
                r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
                r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
                r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
            }
            // r[c] (c < 4): column c of rows 0-3 (low lane: col c, high lane: col c + 4); r[c + 4]
            // the same for rows 4-7.
            for (int c = 0; c < 4; c++) {
                _mm256_store_ps(dst + (kk + c) * AVX2_NR + j0, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
                _mm256_store_ps(dst + (kk + c + 4) * AVX2_NR + j0, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
            }
        }
        for (; kk < kc; kk++)
            for (int j = 0; j < 8; j++) dst[kk * AVX2_NR + j0 + j] = tmp[(j0 + j) * FP8_KC + kk];
    }
}

typedef void (*micro_fn)(const float*, int64_t, int, const float*, int64_t, float*, int64_t, int,
                         int, const float*);
typedef void (*pack_fn)(const uint8_t*, const float*, int64_t, int64_t, int64_t, int64_t, int,
                        int64_t, int64_t, float*, float*);

/* Work items are (panel of NR weight rows) x (token chunk); token chunks only when the panels alone
 * cannot keep the threads busy (each chunk decodes its panels again). */
static int fp8_gemm(micro_fn micro, pack_fn pack, int MR, int NR, const float* x, const uint8_t* w,
                    const float* scale, int64_t bn, int64_t bk, const float* bias, float* out,
                    int64_t T, int64_t K, int64_t N, int nthreads) {
    int64_t npanels = (N + NR - 1) / NR;
    int64_t tchunks = 1;
    while (npanels * tchunks < 4 * (int64_t)nthreads && T / (tchunks * 2) >= 8 * MR) tchunks *= 2;
    int64_t tstep = ((T + tchunks - 1) / tchunks + MR - 1) / MR * MR;
    tchunks = (T + tstep - 1) / tstep;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (npanels * tchunks > 1 && T * N * K > 65536)
    {
        size_t panel = (size_t)FP8_KC * NR * sizeof(float);
        float* packed = (float*)aligned_alloc(64, 2 * panel);  // packed panel, then tmp
        if (!packed) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < npanels * tchunks; item++) {
            if (!packed) continue;
            int64_t p = item / tchunks, tc = item % tchunks;
            int64_t n0 = p * NR, t0 = tc * tstep, t1 = MIN(T, t0 + tstep);
            int nr = (int)MIN(NR, N - n0);
            for (int64_t k0 = 0; k0 < K; k0 += FP8_KC) {
                int64_t kc = MIN(FP8_KC, K - k0);
                pack(w, scale, bn, bk, K, n0, nr, k0, kc, packed + FP8_KC * NR, packed);
                int last = k0 + kc >= K;
                for (int64_t t = t0; t < t1; t += MR)
                    micro(x + t * K + k0, K, (int)MIN(MR, t1 - t), packed, kc, out + t * N + n0, N,
                          nr, k0 == 0, last && bias ? bias + n0 : NULL);
            }
        }
        free(packed);
    }
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- launchers

int taper_fp8_linear(int isa,
                     const float* x,      // (T, K)
                     const uint8_t* w,    // (N, K)
                     const float* scale,  // (N / bn, ceil(K / bk))
                     int64_t bn, int64_t bk,
                     const float* bias,   // (N,) or NULL
                     float* out,          // (T, N)
                     int64_t T, int64_t K, int64_t N, int batch_invariant, int nthreads) {
    if (!taper_fp8_isa_supported(isa)) return TAPER_ERR_ISA;
    if (T == 0 || N == 0) return TAPER_OK;
    if (K == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < N; n++) out[t * N + n] = bias ? bias[n] : 0.0f;
        return TAPER_OK;
    }
    switch (isa) {
        case TAPER_ISA_AVX512:
            if (T <= FP8_SMALL_T && !batch_invariant) {
                fp8_small_avx512(x, w, scale, bn, bk, bias, out, T, K, N, nthreads);
                return TAPER_OK;
            }
            return fp8_gemm(micro_avx512, pack_avx512, AVX512_MR, AVX512_NR, x, w, scale, bn, bk,
                            bias, out, T, K, N, nthreads);
        case TAPER_ISA_AVX2:
            if (T <= FP8_SMALL_T && !batch_invariant) {
                fp8_small_avx2(x, w, scale, bn, bk, bias, out, T, K, N, nthreads);
                return TAPER_OK;
            }
            return fp8_gemm(micro_avx2, pack_avx2, AVX2_MR, AVX2_NR, x, w, scale, bn, bk, bias, out,
                            T, K, N, nthreads);
        default:
            return fp8_linear_scalar(x, w, scale, bn, bk, bias, out, T, K, N, nthreads);
    }
}

int taper_fp8_decode(int isa, const uint8_t* src, float* dst, int64_t n) {
    if (!taper_fp8_isa_supported(isa)) return TAPER_ERR_ISA;
    if (isa == TAPER_ISA_AVX512) taper_e4m3_row_avx512(src, 1.0f, dst, n);
    else if (isa == TAPER_ISA_AVX2) taper_e4m3_row_avx2(src, 1.0f, dst, n);
    else taper_e4m3_row_scalar(src, 1.0f, dst, n);
    return TAPER_OK;
}

void taper_fp8_encode(const float* src, uint8_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = taper_f32_to_e4m3(src[i]);
}

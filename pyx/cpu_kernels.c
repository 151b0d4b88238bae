/* Taper CPU kernels (C11 + OpenMP). See cpu_kernels.h for the ABI.
 *
 * The performance-critical op is `linear` (decode = memory-bound GEMV, prefill = GEMM). It has
 * three ISA paths compiled side by side with __attribute__((target(...))) — no -march=native in
 * the build — and chosen at run time by the caller (CpuBackend reads __builtin_cpu_supports and
 * the KernelConfig's cpu_isa). 16-bit weights (bf16, f16) stay 16-bit in memory and are widened
 * to f32 in registers; accumulation is always f32. AMX and AVX512-BF16 are deliberately not used.
 * Paged attention has AVX-512 tile kernels (GQA groups share K/V loads) and a portable kernel;
 * SiLU, GeGLU, soft-capping and the portable attention are compiled per ISA from one body
 * (ISA_VARIANTS). The other ops are plain C loops with `omp simd` hints, parallel over rows with
 * OpenMP.
 */
#include "cpu_kernels.h"
#include "fp8_e4m3.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define INLINE static inline __attribute__((always_inline))

// ----------------------------------------------------------------------------
// ---- helpers: dtype conversion, ISA detection

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// IEEE half -> float by bit manipulation (portable; the SIMD paths use vcvtph2ps instead).
INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-08f;  // subnormal: man * 2^-24
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Widens n elements of a row of dtype `dtype` to f32.
static void row_to_f32(const void* src, int dtype, int64_t n, float* dst) {
    if (dtype == TAPER_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == TAPER_BF16) {
        const uint16_t* s = (const uint16_t*)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const uint16_t* s = (const uint16_t*)src;
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
    }
}

static size_t dtype_size(int dtype) { return dtype == TAPER_F32 ? 4 : 2; }

int taper_cpu_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case TAPER_ISA_SCALAR: return 1;
        case TAPER_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case TAPER_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") &&
                   taper_cpu_isa_supported(TAPER_ISA_AVX2);
        default: return 0;
    }
}

int taper_cpu_best_isa(void) {
    if (taper_cpu_isa_supported(TAPER_ISA_AVX512)) return TAPER_ISA_AVX512;
    if (taper_cpu_isa_supported(TAPER_ISA_AVX2)) return TAPER_ISA_AVX2;
    return TAPER_ISA_SCALAR;
}

int taper_cpu_max_threads(void) { return omp_get_max_threads(); }

// ----------------------------------------------------------------------------
// ---- kernels: embedding

/* Embedding gather: out[t] = f32(table[token_ids[t]]). Parallel over tokens. */
int taper_embedding(const int32_t* token_ids,  // (T,)
                    const void* table,         // (V, H)
                    int dtype, int64_t T, int64_t V, int64_t H,
                    float* out,                // (T, H)
                    int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (token_ids[t] < 0 || token_ids[t] >= V) return TAPER_ERR_ARG;
    size_t es = dtype_size(dtype);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H > 16384)
    for (int64_t t = 0; t < T; t++)
        row_to_f32((const char*)table + (size_t)token_ids[t] * H * es, dtype, H, out + t * H);
    return TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: linear, scalar path

/* Scalar linear: for each output column n (parallel), widen weight row n into a per-thread f32
 * buffer once, then dot it with every token row using 8 independent partial sums (lets the
 * compiler use SSE lanes without reassociating a single chain). Portable fallback and reference
 * for the SIMD paths. */
static int linear_scalar(const float* x,      // (T, K)
                         const void* w,       // (N, K)
                         int dtype,
                         const float* bias,   // (N,) or NULL
                         float* out,          // (T, N)
                         int64_t T, int64_t K, int64_t N, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float* buf = dtype == TAPER_F32 ? NULL : (float*)malloc((size_t)K * sizeof(float));
        if (dtype != TAPER_F32 && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (dtype != TAPER_F32 && !buf) continue;
            const float* wr;
            if (dtype == TAPER_F32) {
                wr = (const float*)w + n * K;
            } else {
                row_to_f32((const char*)w + (size_t)n * K * 2, dtype, K, buf);
                wr = buf;
            }
            float b = bias ? bias[n] : 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const float* xr = x + t * K;
                float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int64_t k = 0;
                for (; k + 8 <= K; k += 8)
                    for (int u = 0; u < 8; u++) s[u] += xr[k + u] * wr[k + u];
                for (; k < K; k++) s[0] += xr[k] * wr[k];
                out[t * N + n] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) + b;
            }
        }
        free(buf);
    }
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: linear, AVX2 + FMA + F16C path

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET INLINE __m256 avx2_load_w(const void* w, int dtype, int64_t off) {
    if (dtype == TAPER_F32) return _mm256_loadu_ps((const float*)w + off);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + off));
    if (dtype == TAPER_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

AVX2_TARGET INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float w_at(const void* w, int dtype, int64_t off) {
    if (dtype == TAPER_F32) return ((const float*)w)[off];
    if (dtype == TAPER_BF16) return bf16_to_f32(((const uint16_t*)w)[off]);
    return f16_to_f32(((const uint16_t*)w)[off]);
}

/* GEMV tile: 4 weight rows x NT (1..4) token rows, one vector accumulator per (row, token) pair,
 * streaming the 4 weight rows once: four independent row streams keep enough loads in flight to
 * approach memory bandwidth, and each widened weight vector feeds NT FMAs. */
AVX2_TARGET INLINE void avx2_gemv_tile(const float* x,    // (T, K), rows t0..t0+NT
                                        const void* w,     // (N, K), rows n0..n0+nr
                                        int dtype, const float* bias,
                                        float* out,        // (T, N)
                                        int64_t K, int64_t N, int64_t t0, int64_t n0, int nr,
                                        const int NT) {
    __m256 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < NT; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t rr[4];
    for (int r = 0; r < 4; r++) rr[r] = (n0 + MIN(r, nr - 1)) * K;  // duplicate last row if short
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[4];
        for (int j = 0; j < NT; j++) xv[j] = _mm256_loadu_ps(x + (t0 + j) * K + k);
        for (int r = 0; r < 4; r++) {
            __m256 wv = avx2_load_w(w, dtype, rr[r] + k);
            for (int j = 0; j < NT; j++) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < NT; j++) {
            float s = avx2_hsum(acc[r][j]);
            for (int64_t kk = k; kk < K; kk++) s += w_at(w, dtype, rr[r] + kk) * x[(t0 + j) * K + kk];
            out[(t0 + j) * N + n0 + r] = s + (bias ? bias[n0 + r] : 0.0f);
        }
}

AVX2_TARGET static void avx2_gemv(const float* x, const void* w, int dtype, const float* bias,
                                  float* out, int64_t T, int64_t K, int64_t N, int nthreads) {
    int64_t ngroups = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < ngroups; g++) {
        int64_t n0 = g * 4;
        int nr = (int)MIN(4, N - n0);
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            switch (MIN(4, T - t0)) {
                case 1: avx2_gemv_tile(x, w, dtype, bias, out, K, N, t0, n0, nr, 1); break;
                case 2: avx2_gemv_tile(x, w, dtype, bias, out, K, N, t0, n0, nr, 2); break;
                case 3: avx2_gemv_tile(x, w, dtype, bias, out, K, N, t0, n0, nr, 3); break;
                default: avx2_gemv_tile(x, w, dtype, bias, out, K, N, t0, n0, nr, 4); break;
            }
        }
    }
}

// ---- GEMM (shared structure for AVX2 and AVX-512)
//
// Classic packed outer-product GEMM (BLIS-style). A work item is a panel of NR weight rows and a
// range of token rows. For each K block of KC, the panel is widened to f32 and transposed into a
// per-thread buffer packed[kk][j] (KC*NR floats; 256*32*4 = 32 KiB fits L1), then the micro-kernel
// sweeps MR token rows at a time: per k it loads NR/W vectors of the panel, broadcasts MR x values
// and does MR*NR/W FMAs into register accumulators. The panel stays in L1 across the whole token
// range, x rows stream from L2, and out tiles are read/written once per K block.

#define GEMM_KC 256

#define AVX2_MR 6
#define AVX2_NR 16

/* One output row of an AVX2 tile: out[0:nr] = (first ? 0 : out) + acc (+ bias), acc the row's
 * accumulators spilled to memory. Shared by the micro-kernels so every row count stores alike. */
AVX2_TARGET INLINE void avx2_store_row(float* o, const float* acc, int nr, int first,
                                       const float* bias_or_null) {
    if (nr == AVX2_NR) {
        __m256 o0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
        __m256 o1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8);
        o0 = _mm256_add_ps(o0, _mm256_load_ps(acc));
        o1 = _mm256_add_ps(o1, _mm256_load_ps(acc + 8));
        if (bias_or_null) {
            o0 = _mm256_add_ps(o0, _mm256_loadu_ps(bias_or_null));
            o1 = _mm256_add_ps(o1, _mm256_loadu_ps(bias_or_null + 8));
        }
        _mm256_storeu_ps(o, o0);
        _mm256_storeu_ps(o + 8, o1);
    } else {
        for (int j = 0; j < nr; j++)
            o[j] = (first ? 0.0f : o[j]) + acc[j] + (bias_or_null ? bias_or_null[j] : 0.0f);
    }
}

/* AVX2 micro-kernel: 6 token rows x 16 weight rows = 12 ymm accumulators + 2 panel vectors +
 * 1 broadcast = 15 of 16 ymm registers. */
AVX2_TARGET static void avx2_micro(const float* x,        // (T, K), mr rows from x, at col k0
                                   int64_t K, int mr,
                                   const float* packed,  // (kc, 16)
                                   int64_t kc,
                                   float* out,           // (T, N), at (t, n0)
                                   int64_t N, int nr, int first, const float* bias_or_null) {
    const float* xr[AVX2_MR];
    for (int i = 0; i < AVX2_MR; i++) xr[i] = x + MIN(i, mr - 1) * K;
    // Named accumulators: with an array GCC keeps a memory copy updated inside the k loop.
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3], *x4 = xr[4], *x5 = xr[5];
    for (int64_t kk = 0; kk < kc; kk++) {
        __m256 b0 = _mm256_load_ps(packed + kk * AVX2_NR);
        __m256 b1 = _mm256_load_ps(packed + kk * AVX2_NR + 8);
        __m256 a;
#define AVX2_ROW(i)                              \
        a = _mm256_broadcast_ss(x##i + kk);      \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0); \
        c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);
        AVX2_ROW(0) AVX2_ROW(1) AVX2_ROW(2) AVX2_ROW(3) AVX2_ROW(4) AVX2_ROW(5)
#undef AVX2_ROW
    }
    __m256 c[AVX2_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    // Spill the tile once through a constant-indexed buffer: indexing c[][] with the runtime row
    // count below would make GCC keep the accumulators in memory inside the k loop.
    float res[AVX2_MR][AVX2_NR] __attribute__((aligned(32)));
    for (int i = 0; i < AVX2_MR; i++) {
        _mm256_store_ps(res[i], c[i][0]);
        _mm256_store_ps(res[i] + 8, c[i][1]);
    }
    for (int i = 0; i < mr; i++)
        avx2_store_row(out + i * N, res[i], nr, first, bias_or_null);
}

/* The AVX2 micro-kernel for a single token row (a decode step of the AVX2 batch-invariant linear):
 * the same FMA chain and stores as avx2_micro's row 0, without its five duplicate rows. */
AVX2_TARGET static void avx2_micro1(const float* x, int64_t K, int mr, const float* packed,
                                    int64_t kc, float* out, int64_t N, int nr, int first,
                                    const float* bias_or_null) {
    if (mr != 1) {
        avx2_micro(x, K, mr, packed, kc, out, N, nr, first, bias_or_null);
        return;
    }
    __m256 c0 = _mm256_setzero_ps(), c1 = c0;
    for (int64_t kk = 0; kk < kc; kk++) {
        __m256 a = _mm256_broadcast_ss(x + kk);
        c0 = _mm256_fmadd_ps(a, _mm256_load_ps(packed + kk * AVX2_NR), c0);
        c1 = _mm256_fmadd_ps(a, _mm256_load_ps(packed + kk * AVX2_NR + 8), c1);
    }
    float res[AVX2_NR] __attribute__((aligned(32)));
    _mm256_store_ps(res, c0);
    _mm256_store_ps(res + 8, c1);
    avx2_store_row(out, res, nr, first, bias_or_null);
}

/* AVX2 panel packing: widen 8 rows x 8 k-values into 8 ymm registers and transpose them in
 * registers (unpack / shuffle / permute2f128, 24 shuffles per 64 values), instead of 64 scalar
 * strided stores; conversion of bf16/f16 happens on the way in. */
AVX2_TARGET static void avx2_pack(const void* w, int dtype, int64_t K, int64_t n0, int nr,
                                  int64_t k0, int64_t kc,
                                  float* dst) {  // (kc, 16)
    for (int j0 = 0; j0 < AVX2_NR; j0 += 8) {
        int64_t kk = 0;
        for (; kk + 8 <= kc; kk += 8) {
            __m256 r[8], t[8], s8[8];
            for (int j = 0; j < 8; j++)
                r[j] = j0 + j < nr ? avx2_load_w(w, dtype, (n0 + j0 + j) * K + k0 + kk) : _mm256_setzero_ps();
            for (int j = 0; j < 8; j += 2) {
                t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 8; j += 4) {
                s8[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
                s8[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
                s8[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                s8[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
            }
            for (int m = 0; m < 4; m++) {
                _mm256_store_ps(dst + (kk + m) * AVX2_NR + j0, _mm256_permute2f128_ps(s8[m], s8[m + 4], 0x20));
                _mm256_store_ps(dst + (kk + m + 4) * AVX2_NR + j0, _mm256_permute2f128_ps(s8[m], s8[m + 4], 0x31));
            }
        }
        for (; kk < kc; kk++)
            for (int j = 0; j < 8; j++)
                dst[kk * AVX2_NR + j0 + j] = j0 + j < nr ? w_at(w, dtype, (n0 + j0 + j) * K + k0 + kk) : 0.0f;
    }
}

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define AVX512_MR 8
#define AVX512_NR 32

/* AVX-512 micro-kernel: 8 token rows x 32 weight rows = 16 zmm accumulators; per k two 64-byte
 * panel loads from L1 and 8 broadcasts feed 16 FMAs, so the FMA ports, not loads, are the limit.
 * Compiled for each row count MRC (1..8): a short tile (the last rows of a token range) does only
 * its own rows' FMAs. Each row's FMA chain is the same whatever MRC is, so every variant gives a
 * row the same bits. */
AVX512_TARGET INLINE void avx512_micro_rows(const float* x,        // (T, K), mr rows, at col k0
                                            int64_t K, int mr,
                                            const float* packed,  // (kc, 32)
                                            int64_t kc,
                                            float* out,           // (T, N), at (t, n0)
                                            int64_t N, int nr, int first,
                                            const float* bias_or_null, const int MRC) {
    const float* xr[AVX512_MR];
    for (int i = 0; i < MRC; i++) xr[i] = x + MIN(i, mr - 1) * K;
    __m512 c[AVX512_MR][2];
    for (int i = 0; i < MRC; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kc; kk++) {
        __m512 b0 = _mm512_load_ps(packed + kk * AVX512_NR);
        __m512 b1 = _mm512_load_ps(packed + kk * AVX512_NR + 16);
        for (int i = 0; i < MRC; i++) {
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
        o0 = _mm512_add_ps(_mm512_add_ps(o0, c[i][0]), bv0);
        o1 = _mm512_add_ps(_mm512_add_ps(o1, c[i][1]), bv1);
        _mm512_mask_storeu_ps(o, m0, o0);
        _mm512_mask_storeu_ps(o + 16, m1, o1);
    }
}

AVX512_TARGET static void avx512_micro(const float* x, int64_t K, int mr, const float* packed,
                                       int64_t kc, float* out, int64_t N, int nr, int first,
                                       const float* bias_or_null) {
#define AVX512_MICRO_CASE(R) \
    case R: avx512_micro_rows(x, K, mr, packed, kc, out, N, nr, first, bias_or_null, R); break;
    switch (mr) {
        AVX512_MICRO_CASE(1) AVX512_MICRO_CASE(2) AVX512_MICRO_CASE(3) AVX512_MICRO_CASE(4)
        AVX512_MICRO_CASE(5) AVX512_MICRO_CASE(6) AVX512_MICRO_CASE(7)
        default: avx512_micro_rows(x, K, mr, packed, kc, out, N, nr, first, bias_or_null, AVX512_MR);
    }
#undef AVX512_MICRO_CASE
}

typedef void (*micro_fn)(const float*, int64_t, int, const float*, int64_t, float*, int64_t, int,
                         int, const float*);
typedef void (*pack_fn)(const void*, int, int64_t, int64_t, int, int64_t, int64_t, float*);

// Splits the (N panels x token range) work and runs the packed GEMM with the given micro-kernel.
static int gemm_packed(micro_fn micro, pack_fn pack, int MR, int NR, const float* x, const void* w, int dtype,
                       const float* bias, float* out, int64_t T, int64_t K, int64_t N,
                       int nthreads) {
    int64_t npanels = (N + NR - 1) / NR;
    // Split tokens too when there are too few panels to keep every thread busy; each split
    // repacks its panels, so keep token chunks at >= 8 micro-tiles.
    int64_t tchunks = 1;
    while (npanels * tchunks < 4 * (int64_t)nthreads && T / (tchunks * 2) >= 8 * MR) tchunks *= 2;
    int64_t tstep = ((T + tchunks - 1) / tchunks + MR - 1) / MR * MR;
    tchunks = (T + tstep - 1) / tstep;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float* packed = (float*)aligned_alloc(64, (size_t)GEMM_KC * NR * sizeof(float));
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
            for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
                int64_t kc = MIN(GEMM_KC, K - k0);
                pack(w, dtype, K, n0, nr, k0, kc, packed);
                int last = k0 + kc >= K;
                for (int64_t t = t0; t < t1; t += MR)
                    micro(x + t * K + k0, K, (int)MIN(MR, t1 - t), packed, kc, out + t * N + n0, N, nr,
                          k0 == 0, last && bias ? bias + n0 : NULL);
            }
        }
        free(packed);
    }
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: linear, AVX-512 path

AVX512_TARGET INLINE __m512 avx512_load_w(const void* w, int dtype, int64_t off, __mmask16 m) {
    if (dtype == TAPER_F32) return _mm512_maskz_loadu_ps(m, (const float*)w + off);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)w + off);
    if (dtype == TAPER_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* AVX-512 panel packing: widen 16 rows x 16 k-values (masked at the K tail) into 16 zmm
 * registers and transpose in registers (unpack, shuffle_ps, two shuffle_f32x4 stages: 64
 * shuffles per 256 values), so packing costs a small fraction of the micro-kernel's FMAs. */
AVX512_TARGET static void avx512_pack(const void* w, int dtype, int64_t K, int64_t n0, int nr,
                                      int64_t k0, int64_t kc,
                                      float* dst) {  // (kc, 32)
    for (int j0 = 0; j0 < AVX512_NR; j0 += 16) {
        for (int64_t kk = 0; kk < kc; kk += 16) {
            int nk = (int)MIN(16, kc - kk);
            __mmask16 m = (__mmask16)(nk == 16 ? 0xffff : (1u << nk) - 1);
            __m512 r[16], t[16];
            for (int j = 0; j < 16; j++)
                r[j] = j0 + j < nr ? avx512_load_w(w, dtype, (n0 + j0 + j) * K + k0 + kk, m) : _mm512_setzero_ps();
            for (int j = 0; j < 16; j += 2) {
                t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
                t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) {  // r[j + c] = column c of rows j..j+3, per 128-bit lane
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
            for (int c = 0; c < 4; c++) {  // column (4 * lane + c) of all 16 rows
                r[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
                r[c + 4] = _mm512_shuffle_f32x4(t[c + 4], t[c + 12], 0x88);
                r[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd);
                r[c + 12] = _mm512_shuffle_f32x4(t[c + 4], t[c + 12], 0xdd);
            }
            for (int i = 0; i < nk; i++) _mm512_store_ps(dst + (kk + i) * AVX512_NR + j0, r[i]);
        }
    }
}

/* AVX-512 small-M linear (T <= SMALLM_MAX_T: decode GEMV and batched decode): dot products along
 * K straight from the weight rows, no packing.
 *
 * - Tiles: R weight rows x NT tokens with R*NT <= 16 zmm accumulators (R = 8, 4, 4, 4 for NT = 1..4,
 *   2 for NT = 5..8, 1 for NT = 9..16), stepping 32 K-values at a time: each row gives two f32
 *   vectors, each (row, token) pair two FMAs. bf16 is widened with one shift (even elements) and
 *   one AND (odd elements) per 32 values, no vpmovzxwd; x is de-interleaved once per call into a
 *   zero-padded buffer so its halves line up (f32/f16 keep natural order). K tail: masked loads.
 * - A tile's accumulators are reduced together (transpose-reduce: 45 shuffles/adds for 16 sums
 *   instead of ~8 per sum) into one vector whose lanes are the tile's outputs.
 * - Blocking: rows in blocks of SK_NB, split contiguously over threads (each streams its own
 *   contiguous range of rows). Tokens in balanced blocks of <= SK_MAXNT (T <= 8: all of them),
 *   so T <= 16 reads the weights exactly once. K is cut into chunks so that one token block's x
 *   chunk stays in L1; for each (row block, K chunk) the token blocks run innermost, re-reading
 *   the W block from L2. Partial sums of later chunks are added into out.
 * - Software prefetch: while on a tile, the same K position of a later tile's rows (every line:
 *   without it bf16 GEMV streams at ~23 GB/s and f32 T=16 runs ~1.6x slower). Where (kernels
 *   gemv_prefetch, sk_prefetch_l2): the next tile into L1 (as on the 48 KiB-L1 SPR VM), or the
 *   tile after it into L2 where a tile and the next one would take half the L1 or more (read at
 *   start-up): on this 32 KiB-L1 Zen 4 the L1 prefetch of SmolLM2-135M's 8-row f32 tiles (18 KiB
 *   at K = 576) evicted the lines it had fetched before their use, and batch-1 GEMV ran at
 *   0.5-0.7x the L2 prefetch's speed on every shape, bf16 too (bench/RESULTS.md, "Batch-1 decode
 *   on a 32 KiB L1").
 * - Batched decode (SK_TILE_MIN_T <= T <= SMALLM_MAX_T, not batch-invariant): one tile shape,
 *   4 rows x 4 tokens, T padded to a multiple of 4, and every token tile of a row group runs
 *   before the next group. A tile loads 8 vectors (4 rows' weights, 4 tokens' x) per 32 FMAs,
 *   where 1 row x 16 tokens loads 34: the FMA units, not the load ports, set the pace, and the
 *   group's 4 weight rows come from L1 for its later tiles. K chunks only past SK_TILE_KC (x of
 *   32 tokens stays in L2). On this 2-core AMD EPYC (Zen 4, 32 KiB L1) f32 T=16 went from 45-53
 *   to 62-69 GFLOP/s per core, T=32 (K=896) from 56-58 to 79-84 (bench/HISTORY.md, 2026-11-28).
 * On the 2-core SPR-class VM (bench/HISTORY.md, 2026-11-22): bf16 GEMV 23 -> 30-32 GB/s. */
#define SK_NB 64
#define SK_XBYTES 28672  // x chunk of one token block: 28 KiB of the 48 KiB L1
#define SK_MAXNT 16
#define SK_TILE_MIN_T 8
#define SK_TILE_KC 4096

/* The L1 data cache's bytes, read once (glibc asks the CPU; 32 KiB where the OS does not say). */
static int64_t l1d_bytes(void) {
    static int64_t bytes = 0;  // a benign race: every thread computes the same value
    if (!bytes) {
        long v = sysconf(_SC_LEVEL1_DCACHE_SIZE);
        bytes = v > 0 ? v : 32768;
    }
    return bytes;
}

/* Whether sk_block prefetches two tiles ahead into L2 rather than the next tile into L1: auto
 * picks L2 where a tile of R rows of the K chunk and the one prefetched would take half the L1 or
 * more (the lines fetched would be evicted by the tile in use before their turn). Half itself
 * included: f32 at K = 256 (hidden 256: bench/mla_hybrid.py's models) is a pair of 8 KiB tiles
 * on the 32 KiB-L1 EPYC, and there L2 streamed batch-1 GEMV at 1.7-1.8x L1's speed (bench/RESULTS.md,
 * MLA / hybrid). */
static int sk_prefetch_l2(int prefetch, int R, int64_t kc, int es) {
    if (prefetch != TAPER_PREFETCH_AUTO) return prefetch == TAPER_PREFETCH_L2;
    return 2 * (int64_t)R * kc * es >= l1d_bytes() / 2;
}

AVX512_TARGET INLINE void sk_wload(const void* w, const int DT, int64_t off, int masked, __mmask32 m,
                                   __m512* a, __m512* b) {
    if (DT == TAPER_BF16) {
        const uint16_t* p = (const uint16_t*)w + off;
        __m512i v = masked ? _mm512_maskz_loadu_epi16(m, p) : _mm512_loadu_si512((const void*)p);
        *a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                             // even k
        *b = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));  // odd k
    } else if (DT == TAPER_F16) {
        const uint16_t* p = (const uint16_t*)w + off;
        __m256i lo = masked ? _mm256_maskz_loadu_epi16((__mmask16)m, p) : _mm256_loadu_si256((const __m256i*)p);
        __m256i hi = masked ? _mm256_maskz_loadu_epi16((__mmask16)(m >> 16), p + 16)
                            : _mm256_loadu_si256((const __m256i*)(p + 16));
        *a = _mm512_cvtph_ps(lo);
        *b = _mm512_cvtph_ps(hi);
    } else {
        const float* p = (const float*)w + off;
        *a = masked ? _mm512_maskz_loadu_ps((__mmask16)m, p) : _mm512_loadu_ps(p);
        *b = masked ? _mm512_maskz_loadu_ps((__mmask16)(m >> 16), p + 16) : _mm512_loadu_ps(p + 16);
    }
}

/* Sums each of v[0..15] into one vector: lane l holds the sum of v[SK_PERM[l]] (an involution). */
static const int SK_PERM[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

AVX512_TARGET INLINE __m512 sk_reduce16(const __m512* v) {
    __m512 u[8], s[4], q[2];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[i], u[i + 4], 0x88), _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        q[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[i], s[i + 2]), _mm512_unpackhi_ps(s[i], s[i + 2]));
    return _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], 0x44), _mm512_shuffle_ps(q[0], q[1], 0xEE));
}

/* One K chunk [k0, k1) of the rows n0..n1 (a row block), R rows at a time, for ntiles token tiles
 * of NT tokens from t0 (rows of x at or past T are zero padding: computed, never stored). A row
 * group runs all its token tiles before the next group, so its R weight rows come from memory
 * once and from L1 for the other tiles; the prefetch of the next group's rows is spread over the
 * tiles (tile i fetches rows i, i + ntiles, ...). */
AVX512_TARGET INLINE void sk_block(const float* xd, int64_t Kp,  // (Tp, Kp) prepared x
                                   const void* w, const int DT, const float* bias,
                                   float* out,                   // (T, N)
                                   int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t t0,
                                   int64_t ntiles, int64_t T,
                                   int64_t k0, int64_t k1, const int R, const int NT, int prefetch) {
    const int es = DT == TAPER_F32 ? 4 : 2;
    const int first = k0 == 0;
    const int l2 = sk_prefetch_l2(prefetch, R, k1 - k0, es);
    const int64_t ahead = (l2 ? 2 : 1) * (int64_t)R;  // rows between a tile and the one it fetches
    const int64_t kfull = k0 + ((k1 - k0) & ~(int64_t)31);
    const __mmask32 tail = (__mmask32)((1ull << ((k1 - kfull) & 31)) - 1);
    for (int64_t g = n0; g < n1; g += R)
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const int64_t tt = t0 + tile * NT;
        const float* xt = xd + tt * Kp;
        int64_t ro[8], po[8];  // offsets of the tile's rows and of the rows to prefetch
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            ro[r] = MIN(g + r, n1 - 1) * K;          // duplicate the last row if short
            po[r] = MIN(g + ahead + r, N - 1) * K;   // prefetch: a later tile's rows
        }
        __m512 acc[8][16];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k < kfull; k += 32) {
            __m512 wa[8], wb[8];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) sk_wload(w, DT, ro[r] + k, 0, 0, &wa[r], &wb[r]);
            if (l2) {
                for (int r = (int)tile; r < R; r += (int)ntiles) {
                    _mm_prefetch((const char*)w + (po[r] + k) * es, _MM_HINT_T1);
                    if (DT == TAPER_F32) _mm_prefetch((const char*)w + (po[r] + k) * es + 64, _MM_HINT_T1);
                }
            } else {
                for (int r = (int)tile; r < R; r += (int)ntiles) {
                    _mm_prefetch((const char*)w + (po[r] + k) * es, _MM_HINT_T0);
                    if (DT == TAPER_F32) _mm_prefetch((const char*)w + (po[r] + k) * es + 64, _MM_HINT_T0);
                }
            }
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) {
                __m512 xa = _mm512_load_ps(xt + j * Kp + k), xb = _mm512_load_ps(xt + j * Kp + k + 16);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    acc[r][j] = _mm512_fmadd_ps(wa[r], xa, acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(wb[r], xb, acc[r][j]);
                }
            }
        }
        if (k < k1) {  // K tail (only in the last chunk): masked weight loads, x is zero-padded
            __m512 wa[8], wb[8];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) sk_wload(w, DT, ro[r] + k, 1, tail, &wa[r], &wb[r]);
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) {
                __m512 xa = _mm512_load_ps(xt + j * Kp + k), xb = _mm512_load_ps(xt + j * Kp + k + 16);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    acc[r][j] = _mm512_fmadd_ps(wa[r], xa, acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(wb[r], xb, acc[r][j]);
                }
            }
        }
        // Accumulator (r, j) goes to lane j*R + r of the reduced vector.
        __m512 v[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) v[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) v[SK_PERM[j * R + r]] = acc[r][j];
        __m512 sums = sk_reduce16(v);
        int nv = (int)MIN(R, n1 - g);
        __mmask16 mrow = (__mmask16)((1u << nv) - 1);
        __m512 bv = first && bias ? _mm512_maskz_loadu_ps(mrow, bias + g) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) {
            if (tt + j >= T) break;  // zero-padded token rows
            __m512 s = j == 0 ? sums : _mm512_maskz_compress_ps((__mmask16)(((1u << R) - 1) << (j * R)), sums);
            float* o = out + (tt + j) * N + g;
            s = _mm512_add_ps(s, first ? bv : _mm512_maskz_loadu_ps(mrow, o));
            _mm512_mask_storeu_ps(o, mrow, s);
        }
    }
}

#define SK_CASE(DT, NT, R) \
    case NT: sk_block(xd, Kp, w, DT, bias, out, K, N, n0, n1, t0, 1, T, k0, k1, R, NT, prefetch); break;
#define SK_DISPATCH(DT)                                                                              \
    switch (nt) {                                                                                    \
        SK_CASE(DT, 1, 8) SK_CASE(DT, 2, 4) SK_CASE(DT, 3, 4) SK_CASE(DT, 4, 4) SK_CASE(DT, 5, 2)   \
        SK_CASE(DT, 6, 2) SK_CASE(DT, 7, 2) SK_CASE(DT, 8, 2) SK_CASE(DT, 9, 1) SK_CASE(DT, 10, 1)  \
        SK_CASE(DT, 11, 1) SK_CASE(DT, 12, 1) SK_CASE(DT, 13, 1) SK_CASE(DT, 14, 1)                 \
        SK_CASE(DT, 15, 1) default: SK_CASE(DT, 16, 1)                                               \
    }

/* x for the small-M kernel: (Tp, Kp) rows zero-padded past K (and past T: the rows T..Tp-1 of a
 * last, partial token tile), bf16's halves de-interleaved to line up with sk_wload. */
AVX512_TARGET static float* sk_prepare_x(const float* x, int dtype, int64_t T, int64_t Tp, int64_t K,
                                         int64_t Kp) {
    float* xd = (float*)aligned_alloc(64, (size_t)(Tp * Kp) * sizeof(float));
    if (!xd) return NULL;
    memset(xd + T * Kp, 0, (size_t)((Tp - T) * Kp) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const float* xs = x + t * K;
        float* xr = xd + t * Kp;
        const int64_t kz = K & ~(int64_t)31;  // zero the last (partial) 32-block: padding
        memset(xr + kz, 0, (size_t)(Kp - kz) * sizeof(float));
        if (dtype == TAPER_BF16) {  // per 32 values: the 16 even ones, then the 16 odd ones
            const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
            for (int64_t k = 0; k < kz; k += 32) {
                __m512 a = _mm512_loadu_ps(xs + k), b = _mm512_loadu_ps(xs + k + 16);
                _mm512_store_ps(xr + k, _mm512_permutex2var_ps(a, ie, b));
                _mm512_store_ps(xr + k + 16, _mm512_permutex2var_ps(a, io, b));
            }
            for (int64_t k = kz; k < K; k++) xr[kz + ((k & 1) << 4) + ((k - kz) >> 1)] = xs[k];
        } else {
            memcpy(xr, xs, (size_t)K * sizeof(float));
        }
    }
    return xd;
}

#define SK_TILED(DT) sk_block(xd, Kp, w, DT, bias, out, K, N, n0, n1, 0, Tp / 4, T, k0, k1, 4, 4, prefetch)

AVX512_TARGET static int avx512_smallm(const float* x, const void* w, int dtype, const float* bias,
                                       float* out, int64_t T, int64_t K, int64_t N,
                                       int fixed_chunks, int prefetch, int nthreads) {
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    // Batched decode: 4 x 4 tiles over every token, T padded to a multiple of 4 (see SK_TILE_MIN_T).
    const int tiled = !fixed_chunks && T >= SK_TILE_MIN_T;
    const int64_t Tp = tiled ? (T + 3) & ~(int64_t)3 : T;
    // Otherwise balanced token blocks of <= SK_MAXNT tokens (T <= 8: one block).
    const int64_t ntb = tiled || T <= 8 ? 1 : (T + SK_MAXNT - 1) / SK_MAXNT, ntmax = (T + ntb - 1) / ntb;
    // K chunks sized for the largest token block, or (fixed_chunks) for SK_MAXNT tokens whatever
    // T is: then a row's sums never depend on T (see taper_linear_ex).
    int64_t nch = ((fixed_chunks ? SK_MAXNT : ntmax) * Kp * 4 + SK_XBYTES - 1) / SK_XBYTES;
    const int64_t kc = tiled ? MIN(Kp, SK_TILE_KC) : ((Kp + nch - 1) / nch + 31) & ~(int64_t)31;
    float* xd = sk_prepare_x(x, dtype, T, Tp, K, Kp);
    if (!xd) return TAPER_ERR_NOMEM;
    const int64_t nblocks = (N + SK_NB - 1) / SK_NB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * SK_NB, n1 = MIN(N, n0 + SK_NB);
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            const int64_t k1 = MIN(K, k0 + kc);
            if (tiled) {
                if (dtype == TAPER_BF16) SK_TILED(TAPER_BF16);
                else if (dtype == TAPER_F16) SK_TILED(TAPER_F16);
                else SK_TILED(TAPER_F32);
                continue;
            }
            for (int64_t tb = 0; tb < ntb; tb++) {
                const int64_t t0 = tb * T / ntb;
                const int nt = (int)((tb + 1) * T / ntb - t0);
                if (dtype == TAPER_BF16) {
                    SK_DISPATCH(TAPER_BF16)
                } else if (dtype == TAPER_F16) {
                    SK_DISPATCH(TAPER_F16)
                } else {
                    SK_DISPATCH(TAPER_F32)
                }
            }
        }
    }
    free(xd);
    return TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- launcher: linear

// AVX2: up to this many token rows the GEMV tiles (4 weight rows x 4 tokens, weights streamed once
// and reused from L1 for the next 4 tokens) beat packing; measured crossover ~8-12.
#define GEMV_MAX_T 8
// AVX-512 uses its small-M kernel (no packing) up to SMALLM_MAX_T token rows: its 4 x 4 tiles
// matched or beat the packed GEMM at T = 24 and 32 for K = 896 and 4864 on the Zen 4 VM.
#define SMALLM_MAX_T 32

int taper_linear(int isa,
                 const float* x,      // (T, K)
                 const void* weight,  // (N, K)
                 int dtype,
                 const float* bias,   // (N,) or NULL
                 float* out,          // (T, N)
                 int64_t T, int64_t K, int64_t N, int nthreads) {
    return taper_linear_ex(isa, x, weight, dtype, bias, out, T, K, N, 0, nthreads);
}

/* batch_invariant: one kernel for every T, whose sums for a row never depend on T, on how the
 * tokens are split among threads, or on which rows share its tile:
 * - AVX-512: the small-M kernel with K chunks sized for SK_MAXNT tokens whatever T is. Each
 *   output's k-sum is one 16-lane accumulator per chunk (two FMAs per 32 k), then the same
 *   transpose-and-add tree whichever slot it sits in, the chunks added in order. Decode keeps the
 *   GEMV speed; prefill pays for re-reading weight blocks per 16 tokens (bench/RESULTS.md).
 * - AVX2: the packed GEMM, whose output element is one FMA chain over k in fixed KC blocks,
 *   vectorized across n (its GEMV tiles re-stream the weights for every 4 tokens: too slow for
 *   prefill to use for every T).
 * - scalar: its one loop, the same for every T already.
 * By default the small-T kernels (up to 8-32 rows) and the packed GEMM beyond sum in different
 * orders, and the small-M kernel's K chunks depend on T (bench/invariance_probe.py). */
int taper_linear_ex(int isa,
                    const float* x,      // (T, K)
                    const void* weight,  // (N, K)
                    int dtype,
                    const float* bias,   // (N,) or NULL
                    float* out,          // (T, N)
                    int64_t T, int64_t K, int64_t N, int batch_invariant, int nthreads) {
    return taper_linear_pf(isa, x, weight, dtype, bias, out, T, K, N, batch_invariant,
                           TAPER_PREFETCH_AUTO, nthreads);
}

/* taper_linear_ex with the AVX-512 small-M kernel's software prefetch chosen (kernels
 * gemv_prefetch: TAPER_PREFETCH_AUTO, _L1, _L2; see sk_prefetch_l2). The sums do not depend on it. */
int taper_linear_pf(int isa, const float* x, const void* weight, int dtype, const float* bias,
                    float* out, int64_t T, int64_t K, int64_t N, int batch_invariant, int prefetch,
                    int nthreads) {
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    if (prefetch < TAPER_PREFETCH_AUTO || prefetch > TAPER_PREFETCH_L2) return TAPER_ERR_ARG;
    if (T == 0 || N == 0) return TAPER_OK;
    if (K == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < N; n++) out[t * N + n] = bias ? bias[n] : 0.0f;
        return TAPER_OK;
    }
    if (batch_invariant) {
        if (isa == TAPER_ISA_AVX512)
            return avx512_smallm(x, weight, dtype, bias, out, T, K, N, 1, prefetch, nthreads);
        if (isa == TAPER_ISA_AVX2)
            return gemm_packed(avx2_micro1, avx2_pack, AVX2_MR, AVX2_NR, x, weight, dtype, bias, out, T, K, N, nthreads);
        return linear_scalar(x, weight, dtype, bias, out, T, K, N, nthreads);
    }
    switch (isa) {
        case TAPER_ISA_AVX512:
            if (T <= SMALLM_MAX_T)
                return avx512_smallm(x, weight, dtype, bias, out, T, K, N, 0, prefetch, nthreads);
            return gemm_packed(avx512_micro, avx512_pack, AVX512_MR, AVX512_NR, x, weight, dtype, bias, out, T, K, N, nthreads);
        case TAPER_ISA_AVX2:
            if (T <= GEMV_MAX_T) { avx2_gemv(x, weight, dtype, bias, out, T, K, N, nthreads); return TAPER_OK; }
            return gemm_packed(avx2_micro, avx2_pack, AVX2_MR, AVX2_NR, x, weight, dtype, bias, out, T, K, N, nthreads);
        default:
            return linear_scalar(x, weight, dtype, bias, out, T, K, N, nthreads);
    }
}

// ----------------------------------------------------------------------------
// ---- helpers: vectorizable exp, multiversioned row kernels
//
// The row kernels below are written once as an always-inline body and compiled three times
// (AVX-512, AVX2+FMA, baseline SSE2) by ISA_VARIANTS, so `omp simd` loops use the widest vectors
// without -march=native, and the caller's ISA choice (kernels cpu_isa, CpuBackend(isa=)) picks the
// variant exactly as it does for `linear` -- which is what lets the tests run every path. libm's expf does not vectorize without -ffast-math,
// hence fast_expf: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a degree-6 Taylor polynomial
// (truncation error < 2e-7 relative) and 2^n built in the exponent bits.
#define ISA_VARIANTS(name, params, args)                                   \
    AVX512_TARGET static void name##_avx512 params { name##_body args; }   \
    AVX2_TARGET static void name##_avx2 params { name##_body args; }       \
    static void name##_scalar params { name##_body args; }
#define ISA_PICK(name, isa) \
    ((isa) == TAPER_ISA_AVX512 ? name##_avx512 : (isa) == TAPER_ISA_AVX2 ? name##_avx2 : name##_scalar)

INLINE float fast_expf(float x) {
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

/* tanh for the row kernels (vectorizes like fast_expf): an odd Taylor polynomial through y^9 for
 * |y| < 0.25 (next term < 1e-8 relative), else (1 - e) / (1 + e) with e = exp(-2|y|) <= 0.61, where
 * 1 - e has no cancellation; about 3e-7 relative error. +-inf give +-1. */
INLINE float fast_tanhf(float y) {
    float a = fabsf(y), a2 = a * a;
    float e = fast_expf(-2.0f * a);
    float big = (1.0f - e) / (1.0f + e);
    float small = a + a * a2 * (-0.333333343f + a2 * (0.133333340f + a2 * (-0.0539682540f +
                                                                      a2 * 0.0218694885f)));
    return copysignf(a < 0.25f ? small : big, y);
}

// Gemma-2 soft-capping of one value: cap * tanh(x / cap).
INLINE float softcap1(float x, float cap) { return cap * fast_tanhf(x / cap); }

// ----------------------------------------------------------------------------
// ---- kernels: norms and activation

/* RMSNorm: one row per iteration; sum of squares with an `omp simd` reduction (several lanes of
 * partial sums, which is also more accurate than one serial chain). */
INLINE float inv_rms(const float* x, int64_t H, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)H + eps);
}

int taper_rms_norm(const float* x,       // (T, H)
                   const float* weight,  // (H,)
                   float eps,
                   float* out,           // (T, H)
                   int64_t T, int64_t H, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H > 16384)
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * H;
        float* o = out + t * H;
        float r = inv_rms(xr, H, eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = xr[i] * r * weight[i];
    }
    return TAPER_OK;
}

int taper_fused_add_rms_norm(float* x,             // (T, H)
                             float* residual,      // (T, H)
                             const float* weight,  // (H,)
                             float eps, int64_t T, int64_t H, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H > 16384)
    for (int64_t t = 0; t < T; t++) {
        float* xr = x + t * H;
        float* rr = residual + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) rr[i] += xr[i];
        float r = inv_rms(rr, H, eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) xr[i] = rr[i] * r * weight[i];
    }
    return TAPER_OK;
}

/* LayerNorm of one row: (x - mean) / sqrt(var + eps) * weight (+ bias), var the biased variance
 * computed from the mean in a second pass (PyTorch's formula, no E[x^2] - mean^2 cancellation). */
INLINE void layer_norm_row(const float* x, const float* weight, const float* bias, float eps,
                           float* out, int64_t H) {
    float sum = 0.0f, sq = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; i++) sum += x[i];
    const float mean = sum / (float)H;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < H; i++) sq += (x[i] - mean) * (x[i] - mean);
    const float r = 1.0f / sqrtf(sq / (float)H + eps);
    if (bias) {
#pragma omp simd
        for (int64_t i = 0; i < H; i++) out[i] = (x[i] - mean) * r * weight[i] + bias[i];
    } else {
#pragma omp simd
        for (int64_t i = 0; i < H; i++) out[i] = (x[i] - mean) * r * weight[i];
    }
}

int taper_layer_norm(const float* x,       // (T, H)
                     const float* weight,  // (H,)
                     const float* bias,    // (H,) or NULL
                     float eps,
                     float* out,           // (T, H)
                     int64_t T, int64_t H, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H > 16384)
    for (int64_t t = 0; t < T; t++) layer_norm_row(x + t * H, weight, bias, eps, out + t * H, H);
    return TAPER_OK;
}

int taper_fused_add_layer_norm(float* x,             // (T, H)
                               float* residual,      // (T, H)
                               const float* weight,  // (H,)
                               const float* bias,    // (H,) or NULL
                               float eps, int64_t T, int64_t H, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H > 16384)
    for (int64_t t = 0; t < T; t++) {
        float* xr = x + t * H;
        float* rr = residual + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) rr[i] += xr[i];
        layer_norm_row(rr, weight, bias, eps, xr, H);
    }
    return TAPER_OK;
}

/* SwiGLU gate: out = silu(gate) * up with gate = x[:, :I], up = x[:, I:]. */
INLINE void silu_row_body(const float* g,  // (I,) gate; up follows at g + I
                          float* o,        // (I,)
                          int64_t inter) {
    const float* u = g + inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + fast_expf(-g[i])) * u[i];
}
ISA_VARIANTS(silu_row, (const float* g, float* o, int64_t inter), (g, o, inter))

int taper_silu_and_mul(int isa,
                       const float* x,  // (T, 2I)
                       float* out,      // (T, I)
                       int64_t T, int64_t inter, int nthreads) {
    void (*silu_row)(const float*, float*, int64_t) = ISA_PICK(silu_row, isa);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * inter > 16384)
    for (int64_t t = 0; t < T; t++) silu_row(x + t * 2 * inter, out + t * inter, inter);
    return TAPER_OK;
}

/* GeGLU gate (Gemma): out = gelu_tanh(gate) * up. 0.5 g (1 + tanh(u)) = g * sigmoid(2u), so it is
 * silu's loop with u = sqrt(2/pi) (g + 0.044715 g^3) and no tanh. */
INLINE void gelu_tanh_row_body(const float* g,  // (I,) gate; up follows at g + I
                               float* o,        // (I,)
                               int64_t inter) {
    const float* u = g + inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        float gi = g[i], z = 0.797884561f * (gi + 0.044715f * gi * gi * gi);
        o[i] = gi / (1.0f + fast_expf(-2.0f * z)) * u[i];
    }
}
ISA_VARIANTS(gelu_tanh_row, (const float* g, float* o, int64_t inter), (g, o, inter))

int taper_gelu_tanh_and_mul(int isa,
                            const float* x,  // (T, 2I)
                            float* out,      // (T, I)
                            int64_t T, int64_t inter, int nthreads) {
    void (*row)(const float*, float*, int64_t) = ISA_PICK(gelu_tanh_row, isa);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * inter > 16384)
    for (int64_t t = 0; t < T; t++) row(x + t * 2 * inter, out + t * inter, inter);
    return TAPER_OK;
}

/* Soft-capping in place, in 4096-element pieces (x is often a (B, V) block of logits). */
INLINE void softcap_piece_body(float* x, int64_t n, float cap) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = softcap1(x[i], cap);
}
ISA_VARIANTS(softcap_piece, (float* x, int64_t n, float cap), (x, n, cap))

int taper_softcap(int isa,
                  float* x,  // (n,)
                  int64_t n, float cap, int nthreads) {
    if (!(cap > 0.0f)) return TAPER_ERR_ARG;
    void (*piece)(float*, int64_t, float) = ISA_PICK(softcap_piece, isa);
    const int64_t P = 4096;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; i += P) piece(x + i, MIN(P, n - i), cap);
    return TAPER_OK;
}

/* x *= s in place, in float32 (Gemma's embedding scaled by sqrt(hidden)). */
int taper_scale(float* x,  // (n,)
                int64_t n, float s, int nthreads) {
#pragma omp parallel for simd num_threads(nthreads) schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; i++) x[i] *= s;
    return TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: rotary embedding

/* RoPE on the first rot_dim dims of each head. neox pairs (i, i + rot_dim/2); GPT-J pairs
 * (2i, 2i+1). cos/sin for pair i are cache[pos][i] and cache[pos][rot_dim/2 + i]. */
static void rope_head(float* h, const float* cs, int64_t half, int is_neox) {
    const float* c = cs;
    const float* s = cs + half;
    if (is_neox) {
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float a = h[i], b = h[i + half];
            h[i] = a * c[i] - b * s[i];
            h[i + half] = b * c[i] + a * s[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            float a = h[2 * i], b = h[2 * i + 1];
            h[2 * i] = a * c[i] - b * s[i];
            h[2 * i + 1] = b * c[i] + a * s[i];
        }
    }
}

int taper_rotary_embedding(const int32_t* positions,    // (T,)
                           float* q,                    // (T, Hq, D)
                           float* k,                    // (T, Hkv, D)
                           const float* cos_sin_cache,  // (max_pos, rot_dim)
                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t rot_dim,
                           int64_t max_pos, int is_neox, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return TAPER_ERR_ARG;
    int64_t half = rot_dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * (Hq + Hkv) * D > 16384)
    for (int64_t t = 0; t < T; t++) {
        const float* cs = cos_sin_cache + (int64_t)positions[t] * rot_dim;
        for (int64_t h = 0; h < Hq; h++) rope_head(q + (t * Hq + h) * D, cs, half, is_neox);
        for (int64_t h = 0; h < Hkv; h++) rope_head(k + (t * Hkv + h) * D, cs, half, is_neox);
    }
    return TAPER_OK;
}

// ----------------------------------------------------------------------------
// ---- kernels: KV cache write and paged attention

/* Scatter each token's K and V rows to its cache slot; slot -1 (padding) is skipped. */
int taper_reshape_and_cache(const float* k,               // (T, Hkv, D)
                            const float* v,               // (T, Hkv, D)
                            float* k_cache,               // (NB, BS, Hkv, D)
                            float* v_cache,               // (NB, BS, Hkv, D)
                            const int32_t* slot_mapping,  // (T,)
                            int64_t T, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                            int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= NB * BS) return TAPER_ERR_ARG;
    int64_t row = Hkv * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * row > 65536)
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slot_mapping[t];
        if (s < 0) continue;
        memcpy(k_cache + s * row, k + t * row, (size_t)row * sizeof(float));
        memcpy(v_cache + s * row, v + t * row, (size_t)row * sizeof(float));
    }
    return TAPER_OK;
}

/* FP8 cache write: each element stored as e4m3(x / scale of its KV head), rounded to nearest even
 * and saturated to +-448 (DESIGN.md section 5: stored = x / scale, read back x scale). */
int taper_reshape_and_cache_fp8(const float* k,               // (T, Hkv, D)
                                const float* v,               // (T, Hkv, D)
                                uint8_t* k_cache,             // (NB, BS, Hkv, D) e4m3
                                uint8_t* v_cache,             // (NB, BS, Hkv, D) e4m3
                                const float* k_scale,         // (Hkv,)
                                const float* v_scale,         // (Hkv,)
                                const int32_t* slot_mapping,  // (T,)
                                int64_t T, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                                int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= NB * BS) return TAPER_ERR_ARG;
    int64_t row = Hkv * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * row > 65536)
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slot_mapping[t];
        if (s < 0) continue;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *kr = k + t * row + h * D, *vr = v + t * row + h * D;
            uint8_t *kc = k_cache + s * row + h * D, *vc = v_cache + s * row + h * D;
            float ks = k_scale[h], vs = v_scale[h];
            for (int64_t d = 0; d < D; d++) {
                kc[d] = taper_f32_to_e4m3(kr[d] / ks);
                vc[d] = taper_f32_to_e4m3(vr[d] / vs);
            }
        }
    }
    return TAPER_OK;
}

/* ---- paged attention
 * A tile is (sequence b, KV head g, R consecutive query rows of b), or for a decode row (q_len 1)
 * all KV heads of that row; its queries ("slots") share every K/V row loaded, so the context is
 * streamed once per tile, not once per query head. Keys go in chunks of ATTN_KC = 16: scores,
 * masked per query (causal limit, sliding window), an online softmax per query updating (max,
 * sum, O), then O += P V over the tile with each V row loaded once. Three kernels:
 *  - attn_piece_avx512_qt (AVX-512, tiles of 16+ queries of one KV head: prefill): queries in
 *    lanes, a GEMM-like 16 x 16 score block per chunk from broadcast K elements, softmax vertical;
 *  - attn_piece_avx512 (AVX-512, smaller tiles: decode): per query 16 dot-product accumulators
 *    (lanes = d) folded by one transpose-add into a vector of 16 key scores;
 *  - attn_piece_generic (any ISA via ISA_VARIANTS, any D; also D % 16 != 0).
 * Lanes of a chunk past the piece's last key point at a zero row, so nothing outside the
 * sequence's table and positions is ever read (unused blocks may hold NaN); masked probabilities
 * are exactly 0. An FP8 cache is decoded per chunk: the chunk's K and V rows of the piece's KV heads
 * are widened (x their head's scale) into per-thread f32 rows that the kernels read as they read an
 * f32 cache, so every row is decoded once per piece, not once per query. When there are too few tiles to occupy the threads (one long decode sequence), a
 * tile's keys are split into pieces (split-K / flash-decoding); each piece leaves unnormalised
 * (O, max, sum) per query and a second pass merges them. Gemma-2's score soft-capping (softcap > 0)
 * runs on each chunk's 16 scaled scores before the masking, behind one branch, so softcap 0
 * computes exactly what it did before the option existed. */

#define ATTN_KC 16

typedef struct {
    const float *q, *k_cache, *v_cache;  // q (T, Hq, D); caches (NB, BS, Hkv, D)
    const int32_t *block_tables, *seq_lens, *qsl;
    int64_t Hq, Hkv, D, BS, MB, group, window;
    float scale;
    const uint8_t *k8, *v8;        // FP8 caches (NB, BS, Hkv, D) instead of k_cache / v_cache, or NULL
    const float *k_scale, *v_scale;  // (Hkv,) their per-head scales
    void (*decode)(const uint8_t*, float, float*, int64_t);  // the ISA path's e4m3 row decoder
    float softcap;  // > 0: scores capped to softcap * tanh(s / softcap); 0 = off
} AttnArgs;

// Soft-caps a chunk's 16 scores (compiled inside each ISA's kernel, so vectorized there).
INLINE void attn_softcap16(float* s, float cap) {
#pragma omp simd
    for (int kk = 0; kk < ATTN_KC; kk++) s[kk] = softcap1(s[kk], cap);
}

typedef struct {
    int32_t b, g, i0, nr;  // sequence, (first) KV head, first query row, number of rows
    int32_t ng;            // KV heads g .. g+ng-1 (ng > 1 only for a single decode row)
    int32_t ks, ke;        // this piece's keys [ks, ke]
    int64_t part;          // offset of its partials (O, max, sum) in the scratch buffer; -1: none
} AttnPiece;

typedef struct {        // per-thread scratch; Mp = M rounded up to 16 (padding queries see no key)
    float* qs;          // (Mp, D) queries times scale
    float* qt;          // (D, Mp) the same, transposed (queries-in-lanes kernel)
    float* o;           // (Mp, D) running unnormalised output
    float* p;           // (Mp, 16) probabilities of the current chunk
    float* zero;        // (D,) zeros: the K/V row of a chunk's lanes past the piece's end
    float *m, *l;       // (Mp,) running max and sum
    int32_t *lo, *hi;   // (Mp,) the query's keys within this piece, [lo, hi] (empty: lo > hi)
    float *kdec, *vdec; // (ATTN_KC, Hkv * D) a chunk's decoded K/V rows (FP8 cache only)
} AttnScratch;

/* Query slots of a piece. One KV head (ng = 1): slot m is row i0 + m / G, head g * G + m % G.
 * Several KV heads (a decode row): slot m is KV head g + m / Gp, its query head m % Gp; a group
 * of 4+ is padded to Gp = a multiple of 4 so that the P V tiles are all 4 rows high. */
INLINE int64_t attn_gp(int64_t G) { return G >= 4 ? (G + 3) & ~3 : G; }
INLINE int attn_slots(const AttnPiece* pc, int64_t G) {
    return (int)(pc->ng == 1 ? pc->nr * G : pc->ng * attn_gp(G));
}
INLINE int attn_query(const AttnPiece* pc, int64_t G, int m, int64_t* i, int64_t* h) {
    if (pc->ng == 1) {
        if (m >= pc->nr * G) return 0;
        *i = pc->i0 + m / G;
        *h = pc->g * G + m % G;
        return 1;
    }
    int64_t Gp = attn_gp(G), gl = m / Gp, hh = m % Gp;
    if (gl >= pc->ng || hh >= G) return 0;
    *i = pc->i0;
    *h = (pc->g + gl) * G + hh;
    return 1;
}
// Offset of slot m's K/V row from the piece's first KV head.
INLINE int64_t attn_kv_off(const AttnPiece* pc, int64_t G, int64_t D, int m) {
    return pc->ng == 1 ? 0 : m / attn_gp(G) * D;
}

// Key and value row pointers of keys j0 .. j0+15 of the piece's KV heads (zero row past ke).
// An FP8 cache's rows are decoded into the scratch first (ng * D values per key, head-major as in
// the cache), so the kernels see f32 rows either way.
INLINE void attn_chunk_rows(const AttnArgs* a, const int32_t* bt, const AttnPiece* pc, int64_t j0,
                            const AttnScratch* w, const float** kr, const float** vr) {
    int64_t kv_stride = a->Hkv * a->D, g = pc->g, ke = pc->ke, D = a->D;
    for (int kk = 0; kk < ATTN_KC; kk++) {
        int64_t j = j0 + kk;
        if (j > ke) {
            kr[kk] = vr[kk] = w->zero;
            continue;
        }
        int64_t off = ((int64_t)bt[j / a->BS] * a->BS + j % a->BS) * kv_stride + g * D;
        if (!a->k8) {
            kr[kk] = a->k_cache + off;
            vr[kk] = a->v_cache + off;
            continue;
        }
        float* kd = w->kdec + (int64_t)kk * pc->ng * D;
        float* vd = w->vdec + (int64_t)kk * pc->ng * D;
        for (int64_t gl = 0; gl < pc->ng; gl++) {
            a->decode(a->k8 + off + gl * D, a->k_scale[g + gl], kd + gl * D, D);
            a->decode(a->v8 + off + gl * D, a->v_scale[g + gl], vd + gl * D, D);
        }
        kr[kk] = kd;
        vr[kk] = vd;
    }
}

// Online-softmax update of query m with its chunk scores s[16] (keys j0..): masks lanes outside
// [lo, hi], rescales O and the sum if the max rose, leaves the probabilities in p (0 when masked).
INLINE void attn_softmax_scalar(float* s, float* p, float* o, float* m, float* l, int64_t j0,
                                int32_t lo, int32_t hi, int64_t D) {
    float mb = -INFINITY;
    for (int kk = 0; kk < ATTN_KC; kk++) {
        int64_t j = j0 + kk;
        if (j < lo || j > hi) s[kk] = -INFINITY;
        mb = MAX(mb, s[kk]);
    }
    if (mb == -INFINITY) {  // no key of this chunk for this query
        for (int kk = 0; kk < ATTN_KC; kk++) p[kk] = 0.0f;
        return;
    }
    if (mb > *m) {
        float alpha = *m == -INFINITY ? 0.0f : fast_expf(*m - mb);
        *l *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] *= alpha;
        *m = mb;
    }
    float sum = 0.0f;
    for (int kk = 0; kk < ATTN_KC; kk++) {
        p[kk] = s[kk] == -INFINITY ? 0.0f : fast_expf(s[kk] - *m);
        sum += p[kk];
    }
    *l += sum;
}

/* Portable piece kernel (any D): per query a dot product per key, then O += p v per key. */
INLINE void attn_piece_generic_body(const AttnArgs* a, const AttnPiece* pc, AttnScratch* w,
                                   int M) {
    const int32_t* bt = a->block_tables + (int64_t)pc->b * a->MB;
    int64_t D = a->D;
    const float *kr[ATTN_KC], *vr[ATTN_KC];
    float s[ATTN_KC];
    for (int64_t j0 = pc->ks; j0 <= pc->ke; j0 += ATTN_KC) {
        attn_chunk_rows(a, bt, pc, j0, w, kr, vr);
        int n = (int)MIN(ATTN_KC, pc->ke + 1 - j0);
        for (int m = 0; m < M; m++) {
            if (j0 > w->hi[m] || j0 + n - 1 < w->lo[m]) {
                for (int kk = 0; kk < ATTN_KC; kk++) w->p[m * ATTN_KC + kk] = 0.0f;
                continue;
            }
            const float* qm = w->qs + m * D;
            int64_t ko = attn_kv_off(pc, a->group, D, m);
            for (int kk = 0; kk < ATTN_KC; kk++) {
                float dot = 0.0f;
                if (kk < n) {
                    const float* k = kr[kk] + ko;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qm[d] * k[d];
                }
                s[kk] = dot;  // lanes kk >= n are past ke, masked by the softmax
            }
            if (a->softcap > 0.0f) attn_softcap16(s, a->softcap);
            attn_softmax_scalar(s, w->p + m * ATTN_KC, w->o + m * D, w->m + m, w->l + m, j0,
                                w->lo[m], w->hi[m], D);
        }
        for (int m = 0; m < M; m++) {
            float* om = w->o + m * D;
            for (int kk = 0; kk < n; kk++) {
                float pj = w->p[m * ATTN_KC + kk];
                if (pj == 0.0f) continue;
                const float* v = vr[kk] + attn_kv_off(pc, a->group, D, m);
#pragma omp simd
                for (int64_t d = 0; d < D; d++) om[d] += pj * v[d];
            }
        }
    }
}
ISA_VARIANTS(attn_piece_generic,
             (const AttnArgs* a, const AttnPiece* pc, AttnScratch* w, int M), (a, pc, w, M))

AVX512_TARGET INLINE __m512 attn_exp512(__m512 x) {  // fast_expf, 16 lanes
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(0.00138888892f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.00833333377f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0416666679f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166666672f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

/* 16 vectors -> one: lane k = the sum of a[k]'s 16 lanes (transpose-and-add, 30 shuffles). */
AVX512_TARGET INLINE __m512 attn_hsum16(const __m512* a) {
    __m512 v[8], w[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: keys (2i, 2i+1, 2i, 2i+1)
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++)  // per 128-bit lane: keys 4j .. 4j+3
        w[j] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0xEE));
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// O[m0 .. m0+MR)[c .. c + 16 NV) += P[m][kk] * V[kk][...] over the chunk's 16 keys, where
// P[m][kk] is p[m * sm + kk * sk].
AVX512_TARGET INLINE void attn_pv512(float* o, const float* p, const float* const* vr, int64_t D,
                                     int m0, int64_t c, const int MR, const int NV, int64_t sm,
                                     int64_t sk) {
    __m512 acc[4][4];
    for (int a = 0; a < MR; a++)
        for (int v = 0; v < NV; v++) acc[a][v] = _mm512_loadu_ps(o + (m0 + a) * D + c + 16 * v);
    for (int kk = 0; kk < ATTN_KC; kk++) {
        __m512 vv[4];
        for (int v = 0; v < NV; v++) vv[v] = _mm512_loadu_ps(vr[kk] + c + 16 * v);
        for (int a = 0; a < MR; a++) {
            __m512 pb = _mm512_set1_ps(p[(m0 + a) * sm + kk * sk]);
            for (int v = 0; v < NV; v++) acc[a][v] = _mm512_fmadd_ps(pb, vv[v], acc[a][v]);
        }
    }
    for (int a = 0; a < MR; a++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + (m0 + a) * D + c + 16 * v, acc[a][v]);
}

// Rows m0 .. m0+MR of O (rows, D) += P V, in 64-column strips.
AVX512_TARGET INLINE void attn_pv_rows512(float* o, const float* p, const float* const* vr,
                                          int64_t D, int m0, const int MR, int64_t sm, int64_t sk) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) attn_pv512(o, p, vr, D, m0, c, MR, 4, sm, sk);
    switch ((D - c) / 16) {
        case 3: attn_pv512(o, p, vr, D, m0, c, MR, 3, sm, sk); break;
        case 2: attn_pv512(o, p, vr, D, m0, c, MR, 2, sm, sk); break;
        case 1: attn_pv512(o, p, vr, D, m0, c, MR, 1, sm, sk); break;
        default: break;
    }
}

// O (rows, D) += P V over one chunk: 4 rows at a time, then 2, then 1.
AVX512_TARGET INLINE void attn_pv_tile512(float* o, const float* p, const float* const* vr,
                                          int64_t D, int rows, int64_t sm, int64_t sk) {
    int m0 = 0;
    for (; m0 + 4 <= rows; m0 += 4) attn_pv_rows512(o, p, vr, D, m0, 4, sm, sk);
    if (m0 + 2 <= rows) {
        attn_pv_rows512(o, p, vr, D, m0, 2, sm, sk);
        m0 += 2;
    }
    if (m0 < rows) attn_pv_rows512(o, p, vr, D, m0, 1, sm, sk);
}

/* AVX-512 piece kernel, D a multiple of 16: scores for 16 keys per query by 16 dot-product
 * accumulators and one transpose-add; softmax on the 16-lane score vector; P V in 4x64 tiles. */
AVX512_TARGET static void attn_piece_avx512(const AttnArgs* a, const AttnPiece* pc, AttnScratch* w,
                                            int M) {
    const int32_t* bt = a->block_tables + (int64_t)pc->b * a->MB;
    int64_t D = a->D;
    const float *kr[ATTN_KC], *vr[ATTN_KC];
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = pc->ks; j0 <= pc->ke; j0 += ATTN_KC) {
        attn_chunk_rows(a, bt, pc, j0, w, kr, vr);
        __m512i jv = _mm512_add_epi32(_mm512_set1_epi32((int32_t)j0), iota);
        int n = (int)MIN(ATTN_KC, pc->ke + 1 - j0), any = 0;
        for (int m = 0; m < M; m++) {
            float* pm = w->p + m * ATTN_KC;
            __mmask16 valid = _mm512_cmp_epi32_mask(jv, _mm512_set1_epi32(w->lo[m]), _MM_CMPINT_NLT) &
                              _mm512_cmp_epi32_mask(jv, _mm512_set1_epi32(w->hi[m]), _MM_CMPINT_LE);
            if (!valid) {
                _mm512_storeu_ps(pm, _mm512_setzero_ps());
                continue;
            }
            any = 1;
            const float* qm = w->qs + m * D;
            int64_t ko = attn_kv_off(pc, a->group, D, m);
            const float* kg[ATTN_KC];
            for (int kk = 0; kk < ATTN_KC; kk++) kg[kk] = kk < n ? kr[kk] + ko : w->zero;
            __m512 acc[ATTN_KC];
            for (int kk = 0; kk < ATTN_KC; kk++) acc[kk] = _mm512_setzero_ps();
            for (int64_t c = 0; c < D; c += 16) {
                __m512 qc = _mm512_loadu_ps(qm + c);
                for (int kk = 0; kk < ATTN_KC; kk++)
                    acc[kk] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kg[kk] + c), acc[kk]);
            }
            __m512 s = attn_hsum16(acc);
            if (a->softcap > 0.0f) {
                float sc[ATTN_KC];
                _mm512_storeu_ps(sc, s);
                attn_softcap16(sc, a->softcap);
                s = _mm512_loadu_ps(sc);
            }
            s = _mm512_mask_blend_ps(valid, ninf, s);
            float mb = _mm512_reduce_max_ps(s);
            if (mb > w->m[m]) {
                float alpha = w->m[m] == -INFINITY ? 0.0f : fast_expf(w->m[m] - mb);
                w->l[m] *= alpha;
                __m512 av = _mm512_set1_ps(alpha);
                float* om = w->o + m * D;
                for (int64_t c = 0; c < D; c += 16)
                    _mm512_storeu_ps(om + c, _mm512_mul_ps(av, _mm512_loadu_ps(om + c)));
                w->m[m] = mb;
            }
            __m512 pv = _mm512_maskz_mov_ps(valid, attn_exp512(_mm512_sub_ps(s, _mm512_set1_ps(w->m[m]))));
            w->l[m] += _mm512_reduce_add_ps(pv);
            _mm512_storeu_ps(pm, pv);
        }
        if (!any) continue;
        if (pc->ng == 1) {
            attn_pv_tile512(w->o, w->p, vr, D, M, ATTN_KC, 1);
        } else {  // one P V tile per KV head
            int Gp = (int)attn_gp(a->group);
            for (int gl = 0; gl < pc->ng; gl++) {
                const float* vg[ATTN_KC];
                for (int kk = 0; kk < ATTN_KC; kk++) vg[kk] = kk < n ? vr[kk] + gl * D : w->zero;
                attn_pv_tile512(w->o + (int64_t)gl * Gp * D, w->p + gl * Gp * ATTN_KC, vg, D, Gp, ATTN_KC, 1);
            }
        }
    }
}

/* AVX-512 piece kernel for tiles of 16+ queries (prefill), D a multiple of 16: queries in lanes.
 * The scaled queries are transposed once per piece to qt (D, Mw); then per chunk a 16-query x
 * 16-key score block is 16 accumulators (one per key), each fed per d by a broadcast K element and
 * a qt load: no per-chunk transpose or horizontal sum. Masking, max, exp and sums run vertically
 * over the 16 query lanes; P is stored key-major (pt[kk * Mw + m]) for the shared P V tile. */
AVX512_TARGET static void attn_piece_avx512_qt(const AttnArgs* a, const AttnPiece* pc,
                                               AttnScratch* w, int M) {
    const int32_t* bt = a->block_tables + (int64_t)pc->b * a->MB;
    int64_t D = a->D;
    int Mw = (M + 15) & ~15;
    float* qt = w->qt;
    for (int m = 0; m < Mw; m++)
        for (int64_t d = 0; d < D; d++) qt[d * Mw + m] = w->qs[m * D + d];
    const float *kr[ATTN_KC], *vr[ATTN_KC];
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = pc->ks; j0 <= pc->ke; j0 += ATTN_KC) {
        attn_chunk_rows(a, bt, pc, j0, w, kr, vr);
        for (int m0 = 0; m0 < Mw; m0 += 16) {
            __m512i lov = _mm512_loadu_si512(w->lo + m0), hiv = _mm512_loadu_si512(w->hi + m0);
            __mmask16 valid[ATTN_KC], anyv = 0;
            for (int kk = 0; kk < ATTN_KC; kk++) {
                __m512i jb = _mm512_set1_epi32((int32_t)(j0 + kk));
                valid[kk] = _mm512_cmp_epi32_mask(lov, jb, _MM_CMPINT_LE) &
                            _mm512_cmp_epi32_mask(hiv, jb, _MM_CMPINT_NLT);
                anyv |= valid[kk];
            }
            if (!anyv) {
                for (int kk = 0; kk < ATTN_KC; kk++)
                    _mm512_storeu_ps(w->p + kk * Mw + m0, _mm512_setzero_ps());
                continue;
            }
            __m512 acc[ATTN_KC];
            for (int kk = 0; kk < ATTN_KC; kk++) acc[kk] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                __m512 qd = _mm512_loadu_ps(qt + d * Mw + m0);
                for (int kk = 0; kk < ATTN_KC; kk++)
                    acc[kk] = _mm512_fmadd_ps(_mm512_set1_ps(kr[kk][d]), qd, acc[kk]);
            }
            if (a->softcap > 0.0f) {
                float sc[ATTN_KC];
                for (int kk = 0; kk < ATTN_KC; kk++) {
                    _mm512_storeu_ps(sc, acc[kk]);
                    attn_softcap16(sc, a->softcap);
                    acc[kk] = _mm512_loadu_ps(sc);
                }
            }
            __m512 mx = ninf;
            for (int kk = 0; kk < ATTN_KC; kk++) {
                acc[kk] = _mm512_mask_blend_ps(valid[kk], ninf, acc[kk]);
                mx = _mm512_max_ps(mx, acc[kk]);
            }
            __m512 mold = _mm512_loadu_ps(w->m + m0), lv = _mm512_loadu_ps(w->l + m0);
            __mmask16 rise = _mm512_cmp_ps_mask(mx, mold, _CMP_GT_OQ);
            __m512 mnew = _mm512_mask_mov_ps(mold, rise, mx);
            if (rise) {  // alpha = exp(old - new) where the max rose (0 where old was -inf)
                __mmask16 fin = rise & _mm512_cmp_ps_mask(mold, ninf, _CMP_NEQ_OQ);
                __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), rise, _mm512_setzero_ps());
                alpha = _mm512_mask_mov_ps(alpha, fin, attn_exp512(_mm512_sub_ps(mold, mnew)));
                lv = _mm512_mul_ps(lv, alpha);
                float al[16];
                _mm512_storeu_ps(al, alpha);
                for (int i = 0; i < 16; i++) {
                    if (!((rise >> i) & 1)) continue;
                    __m512 ab = _mm512_set1_ps(al[i]);
                    float* om = w->o + (int64_t)(m0 + i) * D;
                    for (int64_t c = 0; c < D; c += 16)
                        _mm512_storeu_ps(om + c, _mm512_mul_ps(ab, _mm512_loadu_ps(om + c)));
                }
                _mm512_storeu_ps(w->m + m0, mnew);
            }
            for (int kk = 0; kk < ATTN_KC; kk++) {
                __m512 pk = _mm512_maskz_mov_ps(valid[kk], attn_exp512(_mm512_sub_ps(acc[kk], mnew)));
                lv = _mm512_add_ps(lv, pk);
                _mm512_storeu_ps(w->p + kk * Mw + m0, pk);
            }
            _mm512_storeu_ps(w->l + m0, lv);
        }
        attn_pv_tile512(w->o, w->p, vr, D, Mw, 1, Mw);
    }
}

typedef void (*attn_piece_fn)(const AttnArgs*, const AttnPiece*, AttnScratch*, int);

// Loads piece pc's queries into the scratch and resets (O, max, sum).
static void attn_piece_setup(const AttnArgs* a, const AttnPiece* pc, AttnScratch* w, int Mp) {
    int64_t D = a->D, G = a->group;
    int64_t qend = a->qsl[pc->b + 1], sl = a->seq_lens[pc->b];
    for (int m = 0; m < Mp; m++) {
        float* qs = w->qs + m * D;
        w->m[m] = -INFINITY;
        w->l[m] = 0.0f;
        for (int64_t d = 0; d < D; d++) w->o[m * D + d] = 0.0f;
        int64_t i, h;
        if (!attn_query(pc, G, m, &i, &h)) {
            w->lo[m] = 1;
            w->hi[m] = 0;
            for (int64_t d = 0; d < D; d++) qs[d] = 0.0f;
            continue;
        }
        int64_t p = sl - (qend - i);
        int64_t lo = a->window > 0 ? MAX(0, p - a->window + 1) : 0;
        w->lo[m] = (int32_t)MAX(lo, pc->ks);
        w->hi[m] = (int32_t)MIN(p, pc->ke);
        const float* qr = a->q + (i * a->Hq + h) * D;
        for (int64_t d = 0; d < D; d++) qs[d] = qr[d] * a->scale;
    }
}

/* The softmax's denominator for query head h: l = sum over keys of exp(s - m), m the running
 * maximum of the scores s; with attention sinks (GPT-OSS) one more logit per head, sinks[h],
 * joins the softmax with no value (its weight only shrinks the others'): l + exp(sinks[h] - m). */
static inline float attn_denominator(float l, float m, const float* sinks, int64_t h) {
    return sinks ? l + expf(sinks[h] - m) : l;
}

/* Paged attention over tiles of (sequence, KV head, query rows), parallel over pieces (dynamic
 * schedule, longest-context tiles first), then a merge pass for split tiles. Keys are located
 * through the block table one at a time, so blocks need not be contiguous or ordered.
 * One body for both cache types: f32 (k_cache, v_cache) or FP8 (k8, v8 with per-head scales). */
static int paged_attention_impl(int isa,
                                float* out,                      // (T, Hq, D)
                                const float* q,                  // (T, Hq, D)
                                const float* k_cache,            // (NB, BS, Hkv, D) or NULL
                                const float* v_cache,            // (NB, BS, Hkv, D) or NULL
                                const uint8_t* k8,               // (NB, BS, Hkv, D) e4m3 or NULL
                                const uint8_t* v8,               // (NB, BS, Hkv, D) e4m3 or NULL
                                const float* k_scale,            // (Hkv,) with k8
                                const float* v_scale,            // (Hkv,) with v8
                                const int32_t* block_tables,     // (B, MB)
                                const int32_t* seq_lens,         // (B,)
                                const int32_t* query_start_loc,  // (B+1,)
                                int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                int64_t NB, int64_t BS, int64_t MB, float scale,
                                int64_t sliding_window, float softcap,
                                const float* sinks,              // (Hq,) or NULL
                                int batch_invariant, int nthreads) {
    if (!(softcap >= 0.0f)) return TAPER_ERR_ARG;
    if (query_start_loc[0] != 0 || query_start_loc[B] != T) return TAPER_ERR_ARG;
    for (int64_t b = 0; b < B; b++) {
        int64_t ql = (int64_t)query_start_loc[b + 1] - query_start_loc[b];
        int64_t sl = seq_lens[b];
        if (ql < 0 || sl < ql || sl > MB * BS) return TAPER_ERR_ARG;
        if (ql == 0) continue;
        int64_t first = sliding_window > 0 ? MAX(0, sl - ql - sliding_window + 1) : 0;
        if (batch_invariant) first -= first % ATTN_KC;  // chunks aligned down (see the tiles)
        for (int64_t j = first / BS; j < (sl + BS - 1) / BS; j++) {
            int32_t blk = block_tables[b * MB + j];
            if (blk < 0 || blk >= NB) return TAPER_ERR_ARG;
        }
    }
    if (T == 0) return TAPER_OK;
    AttnArgs a = {q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                  Hq, Hkv, D, BS, MB, Hq / Hkv, sliding_window, scale,
                  k8, v8, k_scale, v_scale,
                  isa == TAPER_ISA_AVX512 ? taper_e4m3_row_avx512
                  : isa == TAPER_ISA_AVX2 ? taper_e4m3_row_avx2 : taper_e4m3_row_scalar,
                  softcap};
    int64_t G = a.group;
    int64_t R = MAX(1, (D <= 128 ? 64 : 32) / G);  // query rows per tile (~64 queries)
    int Mp = (int)MAX(R * G, Hkv * attn_gp(G));
    Mp = (Mp + 15) & ~15;
    // Tiles: a decode row (q_len 1) takes all KV heads at once, so each key's K/V rows are read as
    // one contiguous Hkv * D run; otherwise one tile per (KV head, R rows), KV head outermost so
    // that neighbouring tiles share K/V in cache.
    int64_t ntiles = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t ql = query_start_loc[b + 1] - query_start_loc[b];
        ntiles += ql == 1 ? 1 : (ql + R - 1) / R * Hkv;
    }
    AttnPiece* tiles = (AttnPiece*)malloc((size_t)ntiles * sizeof(AttnPiece));
    if (!tiles) return TAPER_ERR_NOMEM;
    int64_t nt = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t q0 = query_start_loc[b], q1 = query_start_loc[b + 1], sl = seq_lens[b];
        for (int64_t g = 0; g < (q1 - q0 == 1 ? 1 : Hkv); g++)
            for (int64_t i0 = q0; i0 < q1; i0 += R) {
                AttnPiece* t = &tiles[nt++];
                int64_t ilast = MIN(i0 + R, q1) - 1, pfirst = sl - (q1 - i0);
                t->b = (int32_t)b;
                t->g = (int32_t)g;
                t->ng = q1 - q0 == 1 ? (int32_t)Hkv : 1;
                t->i0 = (int32_t)i0;
                t->nr = (int32_t)(ilast + 1 - i0);
                t->ks = (int32_t)(sliding_window > 0 ? MAX(0, pfirst - sliding_window + 1) : 0);
                // Invariant: chunks start at multiples of ATTN_KC, so a query meets the same
                // chunks (and online-softmax rescales) whichever tile holds it.
                if (batch_invariant) t->ks -= t->ks % ATTN_KC;
                t->ke = (int32_t)(sl - (q1 - ilast));
                t->part = -1;
            }
    }
    // Split-K only when the tiles alone cannot keep the threads busy: aim at 4 pieces per thread,
    // each at least 256 keys.
    const int64_t min_split = 256;
    int64_t want = nthreads > 1 && ntiles < 4 * (int64_t)nthreads ? (4 * nthreads + ntiles - 1) / ntiles : 1;
    if (batch_invariant) want = 1;  // a split's merge reorders a query's sums
    int64_t npieces = 0, nsplit_tiles = 0;
    for (int64_t t = 0; t < ntiles; t++) {
        int64_t ns = MAX(1, MIN(want, (tiles[t].ke - tiles[t].ks + 1) / min_split));
        npieces += ns;
        nsplit_tiles += ns > 1;
    }
    AttnPiece* pieces = (AttnPiece*)malloc((size_t)npieces * sizeof(AttnPiece));
    int64_t* merges = (int64_t*)malloc((size_t)MAX(nsplit_tiles, 1) * 2 * sizeof(int64_t));
    if (!pieces || !merges) {
        free(tiles);
        free(pieces);
        free(merges);
        return TAPER_ERR_NOMEM;
    }
    int64_t part_stride = (int64_t)Mp * (D + 2), nparts = 0, k = 0, nm = 0;
    for (int64_t t = 0; t < ntiles; t++) {
        int64_t lo = tiles[t].ks, hi = tiles[t].ke;
        int64_t ns = MAX(1, MIN(want, (hi - lo + 1) / min_split));
        int64_t len = ((hi - lo + 1 + ns - 1) / ns + ATTN_KC - 1) / ATTN_KC * ATTN_KC;
        if (ns > 1) {
            merges[2 * nm] = k;
            merges[2 * nm + 1] = ns;
            nm++;
        }
        for (int64_t s = 0; s < ns; s++) {
            AttnPiece* pc = &pieces[k++];
            *pc = tiles[t];
            pc->ks = (int32_t)MIN(lo + s * len, hi + 1);
            pc->ke = (int32_t)MIN(lo + (s + 1) * len - 1, hi);
            pc->part = ns > 1 ? (nparts++) * part_stride : -1;
        }
    }
    free(tiles);
    float* parts = nparts ? (float*)malloc((size_t)(nparts * part_stride) * sizeof(float)) : NULL;
    if (nparts && !parts) {
        free(pieces);
        free(merges);
        return TAPER_ERR_NOMEM;
    }
    attn_piece_fn kernel = ISA_PICK(attn_piece_generic, isa), kernel_qt = NULL;
    if (D % 16 == 0 && isa == TAPER_ISA_AVX512) {
        kernel = attn_piece_avx512;
        // The queries-in-lanes kernel sums scores over d in another order than the decode
        // kernel: invariant mode runs every tile through the one kernel.
        kernel_qt = batch_invariant ? NULL : attn_piece_avx512_qt;
    }
    int failed = 0;
    int64_t qd = Mp * D;
#pragma omp parallel num_threads(nthreads) if (npieces > 1)
    {
        int64_t dec = k8 ? ATTN_KC * Hkv * D : 0;  // per decoded cache (K, V)
        size_t fl = (size_t)(3 * qd + Mp * ATTN_KC + D + 2 * Mp + 2 * Mp + 16 + 2 * dec);
        float* buf = (float*)aligned_alloc(64, (fl * sizeof(float) + 63) / 64 * 64);
        AttnScratch w;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else {
            w.qs = buf;
            w.o = buf + qd;
            w.qt = buf + 2 * qd;
            w.p = buf + 3 * qd;
            w.zero = w.p + Mp * ATTN_KC;
            w.m = w.zero + D;
            w.l = w.m + Mp;
            w.lo = (int32_t*)(w.l + Mp);
            w.hi = w.lo + Mp;
            w.kdec = (float*)(w.hi + Mp);
            w.vdec = w.kdec + dec;
            for (int64_t d = 0; d < D; d++) w.zero[d] = 0.0f;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t idx = 0; idx < npieces; idx++) {
            if (!buf) continue;
            const AttnPiece* pc = &pieces[npieces - 1 - idx];  // long contexts (last rows) first
            int Mt = attn_slots(pc, G);
            attn_piece_setup(&a, pc, &w, (Mt + 15) & ~15);
            if (pc->ks <= pc->ke)
                (Mt >= 16 && pc->ng == 1 && kernel_qt ? kernel_qt : kernel)(&a, pc, &w, Mt);
            if (pc->part < 0) {
                for (int m = 0; m < Mt; m++) {
                    int64_t i, h;
                    if (!attn_query(pc, G, m, &i, &h)) continue;
                    float inv = 1.0f / attn_denominator(w.l[m], w.m[m], sinks, h);
                    float* o = out + (i * Hq + h) * D;
                    for (int64_t d = 0; d < D; d++) o[d] = w.o[m * D + d] * inv;
                }
            } else {
                float* pp = parts + pc->part;
                memcpy(pp, w.o, (size_t)Mt * D * sizeof(float));
                memcpy(pp + (int64_t)Mp * D, w.m, (size_t)Mt * sizeof(float));
                memcpy(pp + (int64_t)Mp * D + Mp, w.l, (size_t)Mt * sizeof(float));
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nm; t++) {
            const AttnPiece* p0 = &pieces[merges[2 * t]];
            int64_t ns = merges[2 * t + 1];
            int Mt = attn_slots(p0, G);
            for (int m = 0; m < Mt; m++) {
                int64_t i, h;
                if (!attn_query(p0, G, m, &i, &h)) continue;
                float mx = -INFINITY, lsum = 0.0f;
                for (int64_t s = 0; s < ns; s++) mx = MAX(mx, parts[p0[s].part + (int64_t)Mp * D + m]);
                float* o = out + (i * Hq + h) * D;
                for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                for (int64_t s = 0; s < ns; s++) {
                    const float* pp = parts + p0[s].part;
                    float ms = pp[(int64_t)Mp * D + m];
                    if (ms == -INFINITY) continue;  // no key of this piece for this query
                    float wgt = fast_expf(ms - mx);
                    lsum += wgt * pp[(int64_t)Mp * D + Mp + m];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += wgt * pp[m * D + d];
                }
                float inv = 1.0f / attn_denominator(lsum, mx, sinks, h);
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
        free(buf);
    }
    free(parts);
    free(pieces);
    free(merges);
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

int taper_paged_attention(int isa,
                          float* out,                      // (T, Hq, D)
                          const float* q,                  // (T, Hq, D)
                          const float* k_cache,            // (NB, BS, Hkv, D)
                          const float* v_cache,            // (NB, BS, Hkv, D)
                          const int32_t* block_tables,     // (B, MB)
                          const int32_t* seq_lens,         // (B,)
                          const int32_t* query_start_loc,  // (B+1,)
                          int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                          int64_t NB, int64_t BS, int64_t MB, float scale, int64_t sliding_window,
                          float softcap, const float* sinks, int batch_invariant, int nthreads) {
    return paged_attention_impl(isa, out, q, k_cache, v_cache, NULL, NULL, NULL, NULL, block_tables,
                                seq_lens, query_start_loc, T, B, Hq, Hkv, D, NB, BS, MB, scale,
                                sliding_window, softcap, sinks, batch_invariant, nthreads);
}

int taper_paged_attention_fp8(int isa,
                              float* out,                      // (T, Hq, D)
                              const float* q,                  // (T, Hq, D)
                              const uint8_t* k_cache,          // (NB, BS, Hkv, D) e4m3
                              const uint8_t* v_cache,          // (NB, BS, Hkv, D) e4m3
                              const float* k_scale,            // (Hkv,)
                              const float* v_scale,            // (Hkv,)
                              const int32_t* block_tables,     // (B, MB)
                              const int32_t* seq_lens,         // (B,)
                              const int32_t* query_start_loc,  // (B+1,)
                              int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                              int64_t NB, int64_t BS, int64_t MB, float scale,
                              int64_t sliding_window, float softcap, const float* sinks,
                              int batch_invariant, int nthreads) {
    return paged_attention_impl(isa, out, q, NULL, NULL, k_cache, v_cache, k_scale, v_scale,
                                block_tables, seq_lens, query_start_loc, T, B, Hq, Hkv, D, NB, BS,
                                MB, scale, sliding_window, softcap, sinks, batch_invariant,
                                nthreads);
}

// ----------------------------------------------------------------------------
// ---- kernels: argmax and Gumbel-max sampling

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

/* Philox4x32-10 (Salmon et al. 2011, as in Random123 and cuRAND): 10 rounds of two 32x32->64
 * multiplies and a key-bumped xor mix. */
INLINE void philox10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; r++) {
        if (r) { k0 += PHILOX_W0; k1 += PHILOX_W1; }
        uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
        uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0; c[1] = (uint32_t)p1; c[2] = n2; c[3] = (uint32_t)p0;
    }
}

void taper_philox4x32_10(uint32_t* ctr, const uint32_t* key) { philox10(ctr, key[0], key[1]); }

// Best (value, index) of one chunk of a row; strict > keeps the lowest index on ties.
typedef struct { double val; int64_t idx; } best_t;

#define ROW_CHUNK 8192

/* Shared driver for argmax and Gumbel-max: rows are cut into chunks of 8192 so one long row
 * (B=1, V=150k) still spreads over all threads; each chunk writes its best (value, index) to a
 * slot, and a serial pass per row reduces the chunks in order (lowest index wins ties). */
static int row_argmax(const float* logits, const uint64_t* seeds, const int64_t* positions,
                      int64_t* out, int64_t B, int64_t V, int nthreads, int gumbel) {
    int64_t nch = (V + ROW_CHUNK - 1) / ROW_CHUNK;
    if (nch == 0) nch = 1;
    best_t* part = (best_t*)malloc((size_t)(B * nch) * sizeof(best_t));
    if (!part) return TAPER_ERR_NOMEM;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (B * V > 32768)
    for (int64_t item = 0; item < B * nch; item++) {
        int64_t b = item / nch, c = item % nch;
        int64_t v0 = c * ROW_CHUNK, v1 = MIN(V, v0 + ROW_CHUNK);
        const float* row = logits + b * V;
        double best = -INFINITY;
        int64_t bi = -1;
        if (!gumbel) {
            for (int64_t v = v0; v < v1; v++)
                if (row[v] > best || bi < 0) { best = row[v]; bi = v; }
        } else {
            uint64_t pos = (uint64_t)positions[b], seed = seeds[b];
            uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
            // The largest Gumbel draw: u = (2^32 - 0.5) / 2^32. Rounding is monotone, so when
            // logit + GMAX <= best the exact value cannot beat best: skip Philox and both logs.
            const double gmax = -log(-log((4294967295.0 + 0.5) / 4294967296.0));
            for (int64_t v = v0; v < v1; v++) {
                if (row[v] == -INFINITY || (bi >= 0 && (double)row[v] + gmax <= best)) continue;
                uint32_t ctr[4] = {(uint32_t)v, (uint32_t)pos, (uint32_t)(pos >> 32), 0};
                philox10(ctr, k0, k1);
                double u = ((double)ctr[0] + 0.5) * (1.0 / 4294967296.0);
                double val = (double)row[v] - log(-log(u));
                if (val > best || bi < 0) { best = val; bi = v; }
            }
        }
        part[item].val = best;
        part[item].idx = bi;
    }
    for (int64_t b = 0; b < B; b++) {
        double best = -INFINITY;
        int64_t bi = -1;
        for (int64_t c = 0; c < nch; c++) {
            best_t p = part[b * nch + c];
            if (p.idx >= 0 && (bi < 0 || p.val > best)) { best = p.val; bi = p.idx; }
        }
        out[b] = bi < 0 ? 0 : bi;
    }
    free(part);
    return TAPER_OK;
}

/* Greedy: out[b] = argmax(logits[b]), lowest index on ties. */
int taper_argmax(const float* logits,  // (B, V)
                 int64_t* out,         // (B,)
                 int64_t B, int64_t V, int nthreads) {
    return row_argmax(logits, NULL, NULL, out, B, V, nthreads, 0);
}

/* Gumbel-max: out[b] = argmax_v(logits[b, v] - log(-log(u_bv))), u from Philox counted by
 * (v, position) under key seed (DESIGN.md section 5); -inf logits are skipped. */
int taper_gumbel_sample(const float* logits,       // (B, V)
                        const uint64_t* seeds,     // (B,)
                        const int64_t* positions,  // (B,)
                        int64_t* out,              // (B,)
                        int64_t B, int64_t V, int nthreads) {
    return row_argmax(logits, seeds, positions, out, B, V, nthreads, 1);
}

/* Structured outputs: logits[rows[r], v] = -inf where bit v of bitmask[rows[r]] is clear.
 * Bit v lives in word v / 32 at position v % 32 (llguidance's and xgrammar's layout); the words
 * past ceil(V/32) do not exist, so every token id < V has a bit. Rows are independent, and each
 * row is cut into chunks of 32-bit words so a single long row (B=1, V=150k) spreads too. */
int taper_apply_token_bitmask(float* logits,            // (B, V)
                              const int32_t* bitmask,   // (B, W) W = ceil(V / 32)
                              const int32_t* rows,      // (R,) rows of logits to mask
                              int64_t B, int64_t V, int64_t R, int nthreads) {
    int64_t W = (V + 31) / 32;
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= B) return TAPER_ERR_ARG;
    const int64_t words_per_chunk = 256;               // 8192 tokens per work item
    int64_t nch = (W + words_per_chunk - 1) / words_per_chunk;
    // One thread does ~1 G logits/s here, so threads only pay off past a few million logits:
    // below that, waking the pool costs more than the pass (and on a loaded machine a
    // descheduled worker stalls the whole op by a time slice: 12 ms for 8 x 32k, 2026-11-26).
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * V > (1 << 22))
    for (int64_t item = 0; item < R * nch; item++) {
        int64_t b = rows[item / nch], c = item % nch;
        int64_t w0 = c * words_per_chunk, w1 = MIN(W, w0 + words_per_chunk);
        float* row = logits + b * V;
        const uint32_t* mask = (const uint32_t*)(bitmask + b * W);
        for (int64_t w = w0; w < w1; w++) {
            uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;        // all 32 allowed (free text, padding)
            int64_t v0 = w * 32, n = MIN(32, V - v0);
            if (bits == 0) {                          // none allowed: most words of a grammar
                for (int64_t j = 0; j < n; j++) row[v0 + j] = -INFINITY;
                continue;
            }
            // A select, not a branch per token: the compiler vectorizes it.
            for (int64_t j = 0; j < n; j++)
                row[v0 + j] = ((bits >> j) & 1u) ? row[v0 + j] : -INFINITY;
        }
    }
    return TAPER_OK;
}

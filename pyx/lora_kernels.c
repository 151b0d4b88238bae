/* The segmented LoRA product on the CPU (pyx/lora_kernels.h): a row's shrink (x . A rows, the
 * adapter's rank r) then its expand (axpy of B^T rows into the output's part), row by row over the
 * rows of each adapter's segment, rows in parallel.
 *
 * Why per row and not a GEMM per segment: an adapter's A and B^T are small (r x K and r x N, tens
 * of KB at rank 8-16) and stay in L1/L2 while the segment's rows stream past, so each row costs
 * its r * (K + N_part) multiply-adds and nothing more; a row's sums never depend on the other rows
 * (batch invariant). The shrink keeps four independent accumulators (four rank rows against one
 * x row) so the FMA latency is hidden; the expand's axpy runs along contiguous output columns.
 * Compiled for AVX-512, AVX2+FMA and baseline SSE2 side by side, as cpu_kernels.c does. */
#include "lora_kernels.h"
#include "cpu_kernels.h"

#include <omp.h>
#include <stdlib.h>

#define LORA_AVX2 __attribute__((target("avx2,fma")))
#define LORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

/* Multiply-adds below which one thread does the whole call (a parallel region costs a few us). */
#define LORA_PARALLEL_WORK (1 << 16)

static inline __attribute__((always_inline)) void lora_row_body(
        const float* restrict xr, const float* restrict a, const float* restrict bt,
        const int32_t* rk, const int32_t* parts, int64_t P, int64_t R, int64_t K, int64_t N,
        float* restrict y, float* restrict outr) {
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = rk[p];
        const float* ap = a + p * R * K;
        int64_t j = 0;
        for (; j + 4 <= r; j += 4) {
            const float *a0 = ap + j * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t k = 0; k < K; k++) {
                const float xv = xr[k];
                s0 += a0[k] * xv;
                s1 += a1[k] * xv;
                s2 += a2[k] * xv;
                s3 += a3[k] * xv;
            }
            y[p * R + j] = s0;
            y[p * R + j + 1] = s1;
            y[p * R + j + 2] = s2;
            y[p * R + j + 3] = s3;
        }
        for (; j < r; j++) {
            const float* aj = ap + j * K;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; k++) s += aj[k] * xr[k];
            y[p * R + j] = s;
        }
    }
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = rk[p], c0 = parts[p], c1 = parts[p + 1];
        for (int64_t j = 0; j < r; j++) {
            const float yj = y[p * R + j];
            const float* br = bt + j * N;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) outr[c] += yj * br[c];
        }
    }
}

#define LORA_ROW_PARAMS                                                                  \
    (const float* restrict xr, const float* restrict a, const float* restrict bt,        \
     const int32_t* rk, const int32_t* parts, int64_t P, int64_t R, int64_t K, int64_t N, \
     float* restrict y, float* restrict outr)
#define LORA_ROW_ARGS (xr, a, bt, rk, parts, P, R, K, N, y, outr)

LORA_AVX512 static void lora_row_avx512 LORA_ROW_PARAMS { lora_row_body LORA_ROW_ARGS; }
LORA_AVX2 static void lora_row_avx2 LORA_ROW_PARAMS { lora_row_body LORA_ROW_ARGS; }
static void lora_row_scalar LORA_ROW_PARAMS { lora_row_body LORA_ROW_ARGS; }

typedef void (*lora_row_fn) LORA_ROW_PARAMS;

/* The segment holding position i of rows: the last g with seg_offsets[g] <= i. */
static int64_t segment_of(const int32_t* seg_offsets, int64_t G, int64_t i) {
    int64_t lo = 0, hi = G - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (seg_offsets[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

int taper_lora_linear(int isa, const float* x, const float* a, const float* bt,
                      const int32_t* ranks, const int32_t* parts, const int32_t* rows,
                      const int32_t* seg_offsets, const int32_t* seg_slots, float* out,
                      int64_t T, int64_t K, int64_t N, int64_t S, int64_t P, int64_t R,
                      int64_t G, int nthreads) {
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    if (G <= 0) return TAPER_OK;
    if (P < 1 || R < 0 || parts[0] != 0 || parts[P] != N || seg_offsets[0] != 0)
        return TAPER_ERR_ARG;
    for (int64_t p = 0; p < P; p++)
        if (parts[p + 1] < parts[p]) return TAPER_ERR_ARG;
    for (int64_t i = 0; i < S * P; i++)
        if (ranks[i] < 0 || ranks[i] > R) return TAPER_ERR_ARG;
    int64_t rank_sum_max = 0;   /* the most multiply-adds a row costs, for the parallel cut */
    for (int64_t g = 0; g < G; g++) {
        if (seg_offsets[g + 1] < seg_offsets[g] || seg_slots[g] < 0 || seg_slots[g] >= S)
            return TAPER_ERR_ARG;
        int64_t sum = 0;
        for (int64_t p = 0; p < P; p++) sum += ranks[seg_slots[g] * P + p];
        if (sum > rank_sum_max) rank_sum_max = sum;
    }
    const int64_t L = seg_offsets[G];
    for (int64_t i = 0; i < L; i++)
        if (rows[i] < 0 || rows[i] >= T) return TAPER_ERR_ARG;
    if (L == 0 || rank_sum_max == 0) return TAPER_OK;

    const lora_row_fn row = isa == TAPER_ISA_AVX512 ? lora_row_avx512
                          : isa == TAPER_ISA_AVX2 ? lora_row_avx2 : lora_row_scalar;
    const int64_t work = L * rank_sum_max * (K + N);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (work > LORA_PARALLEL_WORK && nthreads > 1)
    {
        float* y = malloc((size_t)(P * R > 0 ? P * R : 1) * sizeof(float));
        if (!y) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < L; i++) {
            if (!y) continue;
            const int64_t g = segment_of(seg_offsets, G, i);
            const int64_t s = seg_slots[g], t = rows[i];
            row(x + t * K, a + s * P * R * K, bt + s * R * N, ranks + s * P, parts, P, R, K, N,
                y, out + t * N);
        }
        free(y);
    }
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

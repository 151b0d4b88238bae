/* The segmented LoRA product on the CPU (pyx/lora_kernels.h): the rows of each adapter's segment
 * in tiles of up to LORA_TILE rows; per tile the shrink (x . A rows, the adapter's rank r) and then
 * the expand (y times B^T rows, added into the output's part), tiles in parallel.
 *
 * Why this shape: between two LoRA ops the base linears stream megabytes of weights, so an
 * adapter's A and B^T (tens to hundreds of KB per projection) come from memory, not cache, each
 * time; a decode step's cost is their bytes more than their multiply-adds. So each tile of one
 * adapter's rows reads them once (not once per row), the slots may hold them in bf16 (half the
 * bytes; widened exactly in registers), and the sums stay in registers: the shrink takes two x
 * rows against two A rows at a time, the expand 64 output columns of two rows over the rank. A
 * row's sums never depend on the other rows or the tiling (batch invariant). Compiled for
 * AVX-512, AVX2+FMA and baseline SSE2 side by side, as cpu_kernels.c does. */
#include "lora_kernels.h"
#include "cpu_kernels.h"

/* -std=c11 turns contraction off: a * b + c would stay two instructions, halving the FMA paths'
 * rate. The scalar path, whose target has no FMA, keeps separate multiplies and adds. */
#pragma GCC optimize("fp-contract=fast")

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define LORA_AVX2 __attribute__((target("avx2,fma")))
#define LORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

#define LORA_TILE 8        /* rows of one segment per tile */
/* Multiply-adds below which one thread does the whole call (a parallel region costs a few us). */
#define LORA_PARALLEL_WORK (1 << 16)

/* 16 lanes, loaded from any address: GCC's vector extension, which each target variant lowers to
 * its own registers (one zmm, two ymm, four xmm). Written out so the accumulators stay in
 * registers; `omp simd` loops kept them on the stack, several times slower. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* Lane loads of a slot's weights, f32 or bf16 (bf16 = the top half of an f32: exact). The
 * `bf16` argument is a constant in each compiled variant, so the branch folds away. */
INLINE void load16(v16* v, const void* p, int64_t i, int bf16) {
    if (!bf16) {
        *v = *(const v16*)((const float*)p + i);
        return;
    }
    v16u w = __builtin_convertvector(*(const v16h*)((const uint16_t*)p + i), v16u) << 16;
    memcpy(v, &w, sizeof *v);
}

INLINE float load1(const void* p, int64_t i, int bf16) {
    if (!bf16) return ((const float*)p)[i];
    uint32_t w = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

INLINE const void* at(const void* p, int64_t i, int bf16) {
    return bf16 ? (const void*)((const uint16_t*)p + i) : (const void*)((const float*)p + i);
}

INLINE float hsum(const v16* v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += (*v)[i];
    return s;
}

/* y[t * PR + p * R + j] = x[rows[t]] . a[p * R + j] for the tile's nt rows, j < rank of part p:
 * two x rows against two A rows at a time, four independent sums. */
INLINE void lora_shrink(const float* restrict x, const int32_t* rows, int64_t nt, const void* a,
                        const int32_t* rk, int64_t P, int64_t R, int64_t K, float* restrict y,
                        int bf16) {
    const int64_t PR = P * R, K16 = K & ~(int64_t)15;
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = rk[p];
        for (int64_t j = 0; j < r; j += 2) {
            const int64_t j1 = j + 1 < r ? j + 1 : j;     /* an odd rank repeats its last row */
            const void *a0 = at(a, (p * R + j) * K, bf16), *a1 = at(a, (p * R + j1) * K, bf16);
            for (int64_t t = 0; t < nt; t += 2) {
                const int64_t t1 = t + 1 < nt ? t + 1 : t;
                const float *x0 = x + (int64_t)rows[t] * K, *x1 = x + (int64_t)rows[t1] * K;
                v16 s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0};
                for (int64_t k = 0; k < K16; k += 16) {
                    v16 va0, va1;
                    load16(&va0, a0, k, bf16);
                    load16(&va1, a1, k, bf16);
                    const v16 vx0 = *(const v16*)(x0 + k), vx1 = *(const v16*)(x1 + k);
                    s00 += va0 * vx0;
                    s01 += va1 * vx0;
                    s10 += va0 * vx1;
                    s11 += va1 * vx1;
                }
                float r00 = hsum(&s00), r01 = hsum(&s01), r10 = hsum(&s10), r11 = hsum(&s11);
                for (int64_t k = K16; k < K; k++) {
                    const float w0 = load1(a0, k, bf16), w1 = load1(a1, k, bf16);
                    r00 += w0 * x0[k];
                    r01 += w1 * x0[k];
                    r10 += w0 * x1[k];
                    r11 += w1 * x1[k];
                }
                float *y0 = y + t * PR + p * R, *y1 = y + t1 * PR + p * R;
                y0[j] = r00;
                y0[j1] = r01;
                y1[j] = r10;
                y1[j1] = r11;
            }
        }
    }
}

/* out[rows[t], part p] += sum_j y[t, p * R + j] * bt[j, part p]: 64 columns of two rows at a
 * time in eight register accumulators, each B^T row chunk loaded once for both rows. */
INLINE void lora_expand(const int32_t* rows, int64_t nt, const void* bt, const int32_t* rk,
                        const int32_t* parts, int64_t P, int64_t R, int64_t N,
                        const float* restrict y, float* restrict out, int bf16) {
    const int64_t PR = P * R;
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = rk[p], c1 = parts[p + 1];
        if (r == 0) continue;
        int64_t c = parts[p];
        for (; c + 64 <= c1; c += 64) {
            for (int64_t t = 0; t < nt; t += 2) {
                const int two = t + 1 < nt;
                const float* y0 = y + t * PR + p * R;
                const float* y1 = two ? y0 + PR : y0;
                float* o0 = out + (int64_t)rows[t] * N + c;
                float* o1 = two ? out + (int64_t)rows[t + 1] * N + c : o0;
                v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
                for (int64_t j = 0; j < r; j++) {
                    const void* w = at(bt, j * N + c, bf16);
                    v16 w0, w1, w2, w3;
                    load16(&w0, w, 0, bf16);
                    load16(&w1, w, 16, bf16);
                    load16(&w2, w, 32, bf16);
                    load16(&w3, w, 48, bf16);
                    const float u = y0[j], v = y1[j];
                    a0 += u * w0;
                    a1 += u * w1;
                    a2 += u * w2;
                    a3 += u * w3;
                    b0 += v * w0;
                    b1 += v * w1;
                    b2 += v * w2;
                    b3 += v * w3;
                }
                *(v16*)o0 += a0;
                *(v16*)(o0 + 16) += a1;
                *(v16*)(o0 + 32) += a2;
                *(v16*)(o0 + 48) += a3;
                if (two) {
                    *(v16*)o1 += b0;
                    *(v16*)(o1 + 16) += b1;
                    *(v16*)(o1 + 32) += b2;
                    *(v16*)(o1 + 48) += b3;
                }
            }
        }
        for (int64_t t = 0; c < c1 && t < nt; t++) {   /* the part's last columns, under 64 */
            const float* yt = y + t * PR + p * R;
            float* o = out + (int64_t)rows[t] * N;
            for (int64_t j = 0; j < r; j++)
                for (int64_t i = c; i < c1; i++) o[i] += yt[j] * load1(bt, j * N + i, bf16);
        }
    }
}

#define LORA_TILE_PARAMS                                                                     \
    (const float* restrict x, const int32_t* rows, int64_t nt, const void* a, const void* bt, \
     const int32_t* rk, const int32_t* parts, int64_t P, int64_t R, int64_t K, int64_t N,     \
     float* restrict y, float* restrict out)

#define LORA_TILE_FN(name, target, bf16)                                     \
    target static void name LORA_TILE_PARAMS {                                \
        lora_shrink(x, rows, nt, a, rk, P, R, K, y, bf16);                    \
        lora_expand(rows, nt, bt, rk, parts, P, R, N, y, out, bf16);          \
    }
LORA_TILE_FN(lora_tile_avx512_f32, LORA_AVX512, 0)
LORA_TILE_FN(lora_tile_avx512_bf16, LORA_AVX512, 1)
LORA_TILE_FN(lora_tile_avx2_f32, LORA_AVX2, 0)
LORA_TILE_FN(lora_tile_avx2_bf16, LORA_AVX2, 1)
LORA_TILE_FN(lora_tile_scalar_f32, , 0)
LORA_TILE_FN(lora_tile_scalar_bf16, , 1)

typedef void (*lora_tile_fn) LORA_TILE_PARAMS;

int taper_lora_linear(int isa, const float* x, const void* a, const void* bt, int dtype,
                      const int32_t* ranks, const int32_t* parts, const int32_t* rows,
                      const int32_t* seg_offsets, const int32_t* seg_slots, float* out,
                      int64_t T, int64_t K, int64_t N, int64_t S, int64_t P, int64_t R,
                      int64_t G, int nthreads) {
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    if (dtype != TAPER_F32 && dtype != TAPER_BF16) return TAPER_ERR_ARG;
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

    const int bf16 = dtype == TAPER_BF16;
    const lora_tile_fn tile =
        isa == TAPER_ISA_AVX512 ? (bf16 ? lora_tile_avx512_bf16 : lora_tile_avx512_f32)
        : isa == TAPER_ISA_AVX2 ? (bf16 ? lora_tile_avx2_bf16 : lora_tile_avx2_f32)
        : (bf16 ? lora_tile_scalar_bf16 : lora_tile_scalar_f32);
    const int64_t item = bf16 ? 2 : 4;
    /* the tiles: (segment, first position in rows) */
    int64_t num_tiles = 0;
    for (int64_t g = 0; g < G; g++)
        num_tiles += (seg_offsets[g + 1] - seg_offsets[g] + LORA_TILE - 1) / LORA_TILE;
    int64_t* tiles = malloc((size_t)(2 * num_tiles + 1) * sizeof(int64_t));
    if (!tiles) return TAPER_ERR_NOMEM;
    int64_t n = 0;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = seg_offsets[g]; i < seg_offsets[g + 1]; i += LORA_TILE) {
            tiles[2 * n] = g;
            tiles[2 * n + 1] = i;
            n++;
        }
    const int64_t work = L * rank_sum_max * (K + N);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (work > LORA_PARALLEL_WORK && nthreads > 1)
    {
        float* y = malloc((size_t)(LORA_TILE * P * R > 0 ? LORA_TILE * P * R : 1) * sizeof(float));
        if (!y) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_tiles; k++) {
            if (!y) continue;
            const int64_t g = tiles[2 * k], i = tiles[2 * k + 1], s = seg_slots[g];
            const int64_t end = seg_offsets[g + 1], nt = end - i < LORA_TILE ? end - i : LORA_TILE;
            tile(x, rows + i, nt, (const char*)a + s * P * R * K * item,
                 (const char*)bt + s * R * N * item, ranks + s * P, parts, P, R, K, N, y, out);
        }
        free(y);
    }
    free(tiles);
    return failed ? TAPER_ERR_NOMEM : TAPER_OK;
}

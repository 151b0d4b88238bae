/* MLA's decode attention (mla_kernels.h).
 *
 * Why its own kernel: in the absorbed form all Hq query heads read one cached head of D = L + R
 * values (DeepSeek-V2-Lite: 16 heads, D = 576; its 1/8 bench model 72). paged_attention treats
 * that as grouped-query attention, a head at a time, and at D = 72 spent ~0.45 us per (token,
 * head): 66 us per layer for a 150-token context, a tenth of the bench model's decode step. Here
 * the heads are the vector lanes instead: each cached row is read once for a chunk of HC heads,
 * its D values broadcast against the chunk's queries laid out (D, HC), four rows at a time so
 * the FMA chains overlap; then an exact softmax over the stored scores (max, fast_expf, sum),
 * and the weighted sum of the rows' first Dv values, again a row at a time for the chunk.
 *
 * Written once as always-inline bodies, compiled per ISA (AVX-512, AVX2, baseline) like
 * cpu_kernels.c's row kernels, so the `omp simd` loops over heads use the widest vectors.
 */
#include "mla_kernels.h"

#include "cpu_kernels.h"
#include "fast_exp.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define HC 16  // query heads per chunk: one AVX-512 vector of scores per cached row

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Heads [h0, h0 + nh) of sequence b, nh <= HC. scratch: D * HC + S * HC + Dv * HC floats. */
INLINE void mla_chunk_body(float* out, const float* q, const float* cache,
                           const int32_t* table, int64_t S, int64_t Hq, int64_t D, int64_t Dv,
                           int64_t BS, int64_t h0, int64_t nh, float scale, float* scratch) {
    float* qt = scratch;            // (D, HC) the chunk's queries, padding heads zero
    float* s = qt + D * HC;         // (S, HC) scores, then probabilities
    float* acc = s + S * HC;        // (Dv, HC) the weighted sum, transposed
    for (int64_t d = 0; d < D; d++)
        for (int64_t h = 0; h < HC; h++) qt[d * HC + h] = h < nh ? q[(h0 + h) * D + d] : 0.0f;

    float mx[HC];
    for (int64_t h = 0; h < HC; h++) mx[h] = -INFINITY;
    int64_t j = 0;
    for (; j + 4 <= S; j += 4) {
        const float* r0 = cache + ((int64_t)table[j / BS] * BS + j % BS) * D;
        const float* r1 = cache + ((int64_t)table[(j + 1) / BS] * BS + (j + 1) % BS) * D;
        const float* r2 = cache + ((int64_t)table[(j + 2) / BS] * BS + (j + 2) % BS) * D;
        const float* r3 = cache + ((int64_t)table[(j + 3) / BS] * BS + (j + 3) % BS) * D;
        float a0[HC] = {0}, a1[HC] = {0}, a2[HC] = {0}, a3[HC] = {0};
        for (int64_t d = 0; d < D; d++) {
            const float* qd = qt + d * HC;
            const float x0 = r0[d], x1 = r1[d], x2 = r2[d], x3 = r3[d];
#pragma omp simd
            for (int64_t h = 0; h < HC; h++) {
                a0[h] += x0 * qd[h];
                a1[h] += x1 * qd[h];
                a2[h] += x2 * qd[h];
                a3[h] += x3 * qd[h];
            }
        }
#pragma omp simd
        for (int64_t h = 0; h < HC; h++) {
            s[j * HC + h] = scale * a0[h];
            s[(j + 1) * HC + h] = scale * a1[h];
            s[(j + 2) * HC + h] = scale * a2[h];
            s[(j + 3) * HC + h] = scale * a3[h];
        }
    }
    for (; j < S; j++) {
        const float* r = cache + ((int64_t)table[j / BS] * BS + j % BS) * D;
        float a[HC] = {0};
        for (int64_t d = 0; d < D; d++) {
            const float x = r[d];
#pragma omp simd
            for (int64_t h = 0; h < HC; h++) a[h] += x * qt[d * HC + h];
        }
#pragma omp simd
        for (int64_t h = 0; h < HC; h++) s[j * HC + h] = scale * a[h];
    }
    for (j = 0; j < S; j++)
#pragma omp simd
        for (int64_t h = 0; h < HC; h++) mx[h] = s[j * HC + h] > mx[h] ? s[j * HC + h] : mx[h];

    float sum[HC];
    for (int64_t h = 0; h < HC; h++) sum[h] = 0.0f;
    for (j = 0; j < S; j++)
#pragma omp simd
        for (int64_t h = 0; h < HC; h++) {
            float p = fast_expf(s[j * HC + h] - mx[h]);
            s[j * HC + h] = p;
            sum[h] += p;
        }

    for (int64_t i = 0; i < Dv * HC; i++) acc[i] = 0.0f;
    for (j = 0; j < S; j++) {
        const float* r = cache + ((int64_t)table[j / BS] * BS + j % BS) * D;
        const float* p = s + j * HC;
        for (int64_t v = 0; v < Dv; v++) {
            const float x = r[v];
#pragma omp simd
            for (int64_t h = 0; h < HC; h++) acc[v * HC + h] += x * p[h];
        }
    }
    for (int64_t h = 0; h < nh; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t v = 0; v < Dv; v++) out[(h0 + h) * Dv + v] = acc[v * HC + h] * inv;
    }
}

#define MLA_PARAMS (float* out, const float* q, const float* cache, const int32_t* table, \
                    int64_t S, int64_t Hq, int64_t D, int64_t Dv, int64_t BS, int64_t h0,  \
                    int64_t nh, float scale, float* scratch)
#define MLA_ARGS (out, q, cache, table, S, Hq, D, Dv, BS, h0, nh, scale, scratch)
AVX512_TARGET static void mla_chunk_avx512 MLA_PARAMS { mla_chunk_body MLA_ARGS; }
AVX2_TARGET static void mla_chunk_avx2 MLA_PARAMS { mla_chunk_body MLA_ARGS; }
static void mla_chunk_scalar MLA_PARAMS { mla_chunk_body MLA_ARGS; }

int taper_mla_decode_attention(int isa, float* out, const float* q, const float* cache,
                               const int32_t* block_tables, const int32_t* seq_lens, int64_t B,
                               int64_t Hq, int64_t D, int64_t Dv, int64_t NB, int64_t BS,
                               int64_t MB, float scale, int nthreads) {
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    if (B < 0 || Hq <= 0 || D <= 0 || Dv <= 0 || Dv > D || BS <= 0 || MB < 0) return TAPER_ERR_ARG;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t S = seq_lens[b];
        if (S < 1 || S > MB * BS) return TAPER_ERR_ARG;
        for (int64_t i = 0; i < (S + BS - 1) / BS; i++)
            if (block_tables[b * MB + i] < 0 || block_tables[b * MB + i] >= NB) return TAPER_ERR_ARG;
        longest = S > longest ? S : longest;
    }
    if (B == 0) return TAPER_OK;
    void (*chunk)MLA_PARAMS = isa == TAPER_ISA_AVX512 ? mla_chunk_avx512
                              : isa == TAPER_ISA_AVX2 ? mla_chunk_avx2 : mla_chunk_scalar;
    const int64_t nchunks = (Hq + HC - 1) / HC, work = B * nchunks;
    const int nt = (int)MIN(nthreads > 0 ? nthreads : 1, work);
    const int64_t per = (D + longest + Dv) * HC;
    float* scratch = malloc((size_t)nt * per * sizeof(float));
    if (!scratch) return TAPER_ERR_NOMEM;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t w = 0; w < work; w++) {
        const int64_t b = w / nchunks, h0 = (w % nchunks) * HC;
        chunk(out + b * Hq * Dv, q + b * Hq * D, cache, block_tables + b * MB, seq_lens[b], Hq, D,
              Dv, BS, h0, MIN(HC, Hq - h0), scale, scratch + (size_t)omp_get_thread_num() * per);
    }
    free(scratch);
    return TAPER_OK;
}

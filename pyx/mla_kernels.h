/* Multi-head latent attention's decode attention on the CPU (CpuBackend.mla_decode_attention).
 *
 * Statuses and ISA codes are cpu_kernels.h's. */
#ifndef TAPER_MLA_KERNELS_H
#define TAPER_MLA_KERNELS_H

#include <stdint.h>

/* One query row per sequence b (its last token) and one cached head that every query head
 * reads: for head h, s_j = scale * (q[b, h] . row_j) over the sequence's rows j < seq_lens[b]
 * (row j at cache[block_tables[b, j / BS], j % BS], D values), p = softmax(s), and
 * out[b, h] = sum_j p_j row_j[:Dv]. The same numbers as paged_attention with the cache as K and
 * V, up to the order of the float sums. TAPER_ERR_ARG for a seq_len outside [1, MB * BS] or a
 * block id outside [0, NB); TAPER_ERR_NOMEM when scratch cannot be had. */
int taper_mla_decode_attention(int isa,
                               float* out,                  // (B, Hq, Dv)
                               const float* q,              // (B, Hq, D)
                               const float* cache,          // (NB, BS, 1, D)
                               const int32_t* block_tables, // (B, MB)
                               const int32_t* seq_lens,     // (B,)
                               int64_t B, int64_t Hq, int64_t D, int64_t Dv, int64_t NB,
                               int64_t BS, int64_t MB, float scale, int nthreads);

#endif

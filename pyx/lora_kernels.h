/* The CPU LoRA kernel behind CpuBackend.lora_linear (pyx/backend.pyx documents the op).
 *
 * Statuses and ISA codes are cpu_kernels.h's. */
#ifndef TAPER_LORA_KERNELS_H
#define TAPER_LORA_KERNELS_H

#include <stdint.h>

/* For each segment g (rows[seg_offsets[g] .. seg_offsets[g+1]) of adapter slot seg_slots[g]) and
 * each part p (the columns [parts[p], parts[p+1]) of out), with r = ranks[s * P + p]:
 *     out[t, part p] += (x[t] . a[s, p*R + j]) * bt[s, j, part p]   summed over j < r
 * in float32 (bf16 weights widened exactly). Rows outside every segment are not touched; rows must be distinct (rows of one
 * call are updated in parallel). TAPER_ERR_ARG for a row, slot, rank, part or offset out of
 * range; TAPER_ERR_NOMEM when per-thread scratch cannot be had. */
int taper_lora_linear(int isa,
                      const float* x,            // (T, K)
                      const void* a,             // (S, P*R, K) f32|bf16
                      const void* bt,            // (S, R, N), a's dtype
                      int dtype,                 // TAPER_F32 or TAPER_BF16
                      const int32_t* ranks,      // (S, P)
                      const int32_t* parts,      // (P+1,)
                      const int32_t* rows,       // (L,)
                      const int32_t* seg_offsets,  // (G+1,)
                      const int32_t* seg_slots,  // (G,)
                      float* out,                // (T, N)
                      int64_t T, int64_t K, int64_t N, int64_t S, int64_t P, int64_t R,
                      int64_t G, int nthreads);

#endif

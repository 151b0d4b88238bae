/* A mixture-of-experts layer's routed experts on the CPU in one call (CpuBackend.moe_experts).
 *
 * Statuses and ISA codes are cpu_kernels.h's; ggml type ids are quant_kernels.h's. */
#ifndef TAPER_MOE_KERNELS_H
#define TAPER_MOE_KERNELS_H

#include <stdint.h>

/* The experts' gate (the first half of gate_up's rows) */
#define TAPER_MOE_SILU 0       /* SwiGLU: silu(gate) * up, as taper_silu_and_mul */
#define TAPER_MOE_GELU_TANH 1  /* GeGLU: gelu_tanh(gate) * up, as taper_gelu_tanh_and_mul */

/* One piece of an expert's weight: `rows` output rows of a float matrix (dtype TAPER_F32,
 * TAPER_BF16 or TAPER_F16, rows of K elements) or of ggml blocks (dtype -1, type qtype, rows of
 * K / block elements). An expert's weight is the parts [start[e], start[e + 1]) of a table,
 * stacked along N (a fused gate_up whose halves have different ggml types has two); a float
 * weight is one part. act_split: a block part's decode activations are written as two 8-bit
 * rows (taper_quant_linear's act_split). The layout is CpuBackend.stack_experts' NumPy record. */
typedef struct {
    const void* data;
    int64_t rows;
    int32_t dtype;
    int32_t qtype;
    int32_t act_split;
    int32_t pad_;
} taper_moe_part;

/* out[t] = sum over slots j < top_k, in order, of topk_weights[t, j] * y(t, j), where for
 * e = topk_ids[t, j]:  g = x[t] @ gate_up[e].T (2I),  a = act(g[:I]) * g[I:],  y = a @ down[e].T.
 * Each expert runs once on all its pairs (their tokens in pair order, p = t * top_k + j) through
 * the kernels `linear` uses (taper_linear_ex, taper_quant_linear, the activation's): bit for bit
 * the numbers of one linear per expert on those rows, whatever the thread count. OpenMP across
 * experts when they are at least as many as the threads (each expert's kernels on one thread),
 * else the experts in turn with every thread. A slot whose id lies outside [0, E) adds nothing.
 * TAPER_ERR_ARG for a part table that does not cover an expert's rows (2I for gate_up, H for
 * down) or an unknown activation; TAPER_ERR_NOMEM when scratch cannot be had. */
int taper_moe_experts(int isa,
                      const float* x,                  // (T, H)
                      const int64_t* topk_ids,         // (T, top_k)
                      const float* topk_weights,       // (T, top_k)
                      const taper_moe_part* gate_up,   // parts of (2I, H) per expert
                      const int64_t* gate_up_start,    // (E + 1,)
                      const taper_moe_part* down,      // parts of (H, I) per expert
                      const int64_t* down_start,       // (E + 1,)
                      int activation,
                      float* out,                      // (T, H)
                      int64_t T, int64_t H, int64_t inter, int64_t top_k, int64_t E,
                      int batch_invariant, int prefill_int8, int nthreads);

#endif

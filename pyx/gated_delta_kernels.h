/* The gated DeltaNet's decode step on the CPU (CpuBackend.gated_delta_conv_decode and
 * gated_delta_recurrent_decode, for pyx/gated_delta_net.py): B sequences of one token each.
 * The two calls do what the NumPy path does between its exponentials (silu, the gates), which
 * stay NumPy's: the results are that path's bits. Statuses are cpu_kernels.h's. */
#ifndef TAPER_GATED_DELTA_KERNELS_H
#define TAPER_GATED_DELTA_KERNELS_H

#include <stdint.h>

/* The causal conv1d's output before silu, per sequence i (row i of proj, rows of proj_cols):
 *   window = [conv_state[src[i]] (K - 1 rows of C; zeros if fresh[i]), proj[i, :C]]
 *   acc[i] = sum_j taps[j] * window[j] (j in order),  taps (K, C);  conv_state[slot[i]] =
 *   window[1:]. TAPER_ERR_ARG for a row outside [0, num_rows). */
int taper_gated_delta_conv_decode(const float* proj, int64_t proj_cols, const float* taps,
                                  float* conv_state, const int64_t* src, const int64_t* slot,
                                  const uint8_t* fresh, float* acc, int64_t B, int64_t num_rows,
                                  int64_t C, int64_t K);

/* The delta rule and the gated RMSNorm, per sequence i and v head h (served by q/k head
 * h / (nv / nk)), from mixed[i] = [q (nk dk), k (nk dk), v (nv dv)] (after silu):
 *   q, k = l2norm (eps 1e-6) of the heads, q times dk^-0.5
 *   S    = ssm_state[src[i], h] (dk, dv; zeros if fresh[i]) * decay[i, h]
 *   S   += k (beta[i, h] (v - k^T S))^T;  o = q^T S;  ssm_state[slot[i], h] = S
 *   core[i, h] = o / sqrt(mean(o^2) + eps) * norm_weight * gate[i, h]   (gate: silu(z))
 * Sums are NumPy's (pairwise for the norms, in order over k for the contractions). Every state
 * row is read before its sequence writes its slot, so src[i] == slot[i] is fine; no sequence may
 * read another's slot. TAPER_ERR_ARG for a row outside [0, num_rows). */
int taper_gated_delta_recurrent_decode(const float* mixed, const float* decay, const float* beta,
                                       const float* gate, const float* norm_weight,
                                       float* ssm_state, const int64_t* src, const int64_t* slot,
                                       const uint8_t* fresh, float* core, int64_t B,
                                       int64_t num_rows, int64_t nk, int64_t nv, int64_t dk,
                                       int64_t dv, float eps);

#endif

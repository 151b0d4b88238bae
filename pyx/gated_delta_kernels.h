/* The gated DeltaNet's decode step on the CPU in one call (CpuBackend.gated_delta_decode, for
 * pyx/gated_delta_net.py): everything between the input projection and the output projection
 * for B sequences of one token each. Statuses are cpu_kernels.h's. */
#ifndef TAPER_GATED_DELTA_KERNELS_H
#define TAPER_GATED_DELTA_KERNELS_H

#include <stdint.h>

/* Per sequence i (its row i of proj, (B, C + Vd + 2 Hv) with C = 2 nk dk + Vd, Vd = nv dv):
 *   window   = [conv_state[src[i]] (K - 1 rows of C; zeros if fresh[i]), proj[i, :C]]
 *   mixed    = silu(sum_j taps[j] * window[j]),  taps (K, C);  conv_state[slot[i]] = window[1:]
 *   q, k     = l2norm (eps 1e-6) of mixed's q / k heads (dk each), q times dk^-0.5; v head h is
 *              served by q/k head h / (nv / nk)
 *   beta     = sigmoid(b),  g = neg_A * softplus(a + dt_bias)  (b, a: proj's last 2 Hv columns)
 *   S        = ssm_state[src[i]] (nv, dk, dv; zeros if fresh[i]) * exp(g)
 *   S       += k (beta (v - k^T S))^T;  o = q^T S;  ssm_state[slot[i]] = S
 *   core[i]  = o / sqrt(mean(o^2) + eps) * norm_weight * silu(z)  (z: proj[i, C:C + Vd])
 * Every state row is read before its sequence writes its slot, so src[i] == slot[i] is fine; no
 * sequence may read another's slot. TAPER_ERR_ARG for a row outside [0, num_rows). */
int taper_gated_delta_decode(const float* proj, const float* taps, const float* neg_A,
                             const float* dt_bias, const float* norm_weight, float* conv_state,
                             float* ssm_state, const int64_t* src, const int64_t* slot,
                             const uint8_t* fresh, float* core, int64_t B, int64_t num_rows,
                             int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t K,
                             float eps);

#endif

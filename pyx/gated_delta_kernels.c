/* See gated_delta_kernels.h. Sequence by sequence and head by head, in the order the NumPy path
 * (pyx/gated_delta_net.py) adds, so the two differ by float reassociation at most; the decode
 * step's state is small (nv dk dv floats), so one thread: the step's time is the NumPy path's
 * dozens of small array operations per layer that this call replaces. */
#include "gated_delta_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

static inline float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static inline float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void l2norm_(const float* x, float* y, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t j = 0; j < n; j++) y[j] = x[j] * inv * scale;
}

int taper_gated_delta_decode(const float* proj, const float* taps, const float* neg_A,
                             const float* dt_bias, const float* norm_weight, float* conv_state,
                             float* ssm_state, const int64_t* src, const int64_t* slot,
                             const uint8_t* fresh, float* core, int64_t B, int64_t num_rows,
                             int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t K,
                             float eps) {
    for (int64_t i = 0; i < B; i++)
        if (src[i] < 0 || src[i] >= num_rows || slot[i] < 0 || slot[i] >= num_rows)
            return TAPER_ERR_ARG;
    const int64_t Kd = nk * dk, Vd = nv * dv, C = 2 * Kd + Vd, N = C + Vd + 2 * nv;
    const int64_t K1 = K - 1, r = nv / nk;
    const float q_scale = 1.0f / sqrtf((float)dk);
    /* the window (K rows of C), the convolution's output, q and k normalised, one head's state
     * and the rows kv_mem / delta / o */
    float* scratch = malloc(sizeof(float) * (size_t)(K * C + C + 2 * Kd + dk * dv + 3 * dv));
    if (!scratch) return TAPER_ERR_NOMEM;
    float* window = scratch;
    float* mixed = window + K * C;
    float* qn = mixed + C;
    float* kn = qn + Kd;
    float* S = kn + Kd;
    float* kv_mem = S + dk * dv;
    float* delta = kv_mem + dv;
    float* o = delta + dv;
    for (int64_t i = 0; i < B; i++) {
        const float* x = proj + i * N;
        float* cs_src = conv_state + src[i] * K1 * C;
        if (fresh[i]) memset(window, 0, sizeof(float) * (size_t)(K1 * C));
        else memcpy(window, cs_src, sizeof(float) * (size_t)(K1 * C));
        memcpy(window + K1 * C, x, sizeof(float) * (size_t)C);
        for (int64_t c = 0; c < C; c++) {
            float acc = window[c] * taps[c];
            for (int64_t j = 1; j < K; j++) acc += window[j * C + c] * taps[j * C + c];
            mixed[c] = acc * sigmoidf_(acc);
        }
        memcpy(conv_state + slot[i] * K1 * C, window + C, sizeof(float) * (size_t)(K1 * C));
        for (int64_t h = 0; h < nk; h++) {
            l2norm_(mixed + h * dk, qn + h * dk, dk, q_scale);
            l2norm_(mixed + Kd + h * dk, kn + h * dk, dk, 1.0f);
        }
        const float* z = x + C;
        const float* b = x + C + Vd;
        const float* a = b + nv;
        for (int64_t h = 0; h < nv; h++) {
            const float* qh = qn + (h / r) * dk;
            const float* kh = kn + (h / r) * dk;
            const float* vh = mixed + 2 * Kd + h * dv;
            const float beta = sigmoidf_(b[h]);
            const float decay = expf(neg_A[h] * softplusf_(a[h] + dt_bias[h]));
            const float* S_src = ssm_state + (src[i] * nv + h) * dk * dv;
            if (fresh[i]) memset(S, 0, sizeof(float) * (size_t)(dk * dv));
            else for (int64_t e = 0; e < dk * dv; e++) S[e] = S_src[e] * decay;
            for (int64_t v = 0; v < dv; v++) kv_mem[v] = 0.0f;
            for (int64_t k = 0; k < dk; k++)
                for (int64_t v = 0; v < dv; v++) kv_mem[v] += S[k * dv + v] * kh[k];
            for (int64_t v = 0; v < dv; v++) delta[v] = (vh[v] - kv_mem[v]) * beta;
            for (int64_t v = 0; v < dv; v++) o[v] = 0.0f;
            for (int64_t k = 0; k < dk; k++)
                for (int64_t v = 0; v < dv; v++) {
                    S[k * dv + v] += kh[k] * delta[v];
                    o[v] += S[k * dv + v] * qh[k];
                }
            memcpy(ssm_state + (slot[i] * nv + h) * dk * dv, S, sizeof(float) * (size_t)(dk * dv));
            float ss = 0.0f;
            for (int64_t v = 0; v < dv; v++) ss += o[v] * o[v];
            const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
            float* out = core + i * Vd + h * dv;
            for (int64_t v = 0; v < dv; v++) {
                const float zv = z[h * dv + v];
                out[v] = o[v] * inv * norm_weight[v] * (zv * sigmoidf_(zv));
            }
        }
    }
    free(scratch);
    return TAPER_OK;
}

/* See gated_delta_kernels.h. Sequence by sequence and head by head, with the NumPy path's
 * (pyx/gated_delta_net.py) operations in its order and its sums' order, so the bits are that
 * path's; the decode step's state is small (nv dk dv floats), so one thread: the step's time
 * was the NumPy path's dozens of small array operations per layer that these calls replace. */
#include "gated_delta_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

static int rows_in_range(const int64_t* src, const int64_t* slot, int64_t B, int64_t num_rows) {
    for (int64_t i = 0; i < B; i++)
        if (src[i] < 0 || src[i] >= num_rows || slot[i] < 0 || slot[i] >= num_rows) return 0;
    return 1;
}

int taper_gated_delta_conv_decode(const float* proj, int64_t proj_cols, const float* taps,
                                  float* conv_state, const int64_t* src, const int64_t* slot,
                                  const uint8_t* fresh, float* acc, int64_t B, int64_t num_rows,
                                  int64_t C, int64_t K) {
    if (!rows_in_range(src, slot, B, num_rows)) return TAPER_ERR_ARG;
    const int64_t K1 = K - 1;
    float* window = malloc(sizeof(float) * (size_t)(K * C));
    if (!window) return TAPER_ERR_NOMEM;
    for (int64_t i = 0; i < B; i++) {
        if (fresh[i]) memset(window, 0, sizeof(float) * (size_t)(K1 * C));
        else memcpy(window, conv_state + src[i] * K1 * C, sizeof(float) * (size_t)(K1 * C));
        memcpy(window + K1 * C, proj + i * proj_cols, sizeof(float) * (size_t)C);
        float* a = acc + i * C;
        for (int64_t c = 0; c < C; c++) a[c] = window[c] * taps[c];
        for (int64_t j = 1; j < K; j++)
            for (int64_t c = 0; c < C; c++) a[c] += window[j * C + c] * taps[j * C + c];
        memcpy(conv_state + slot[i] * K1 * C, window + C, sizeof(float) * (size_t)(K1 * C));
    }
    free(window);
    return TAPER_OK;
}

/* NumPy's float32 add.reduce over a contiguous run (pairwise_sum, blocks of 128). */
static float numpy_sum(const float* a, int64_t n) {
    if (n < 8) {
        float res = 0.0f;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return numpy_sum(a, n2) + numpy_sum(a + n2, n - n2);
}

/* y = x / sqrt(sum(x^2) + 1e-6) * scale (pyx/gated_delta_net.py's l2norm, then q's scale);
 * sq: n floats of scratch. */
static void l2norm_(const float* x, float* y, float* sq, int64_t n, float scale, int scaled) {
    for (int64_t j = 0; j < n; j++) sq[j] = x[j] * x[j];
    const float den = sqrtf(numpy_sum(sq, n) + 1e-6f);
    for (int64_t j = 0; j < n; j++) y[j] = scaled ? (x[j] / den) * scale : x[j] / den;
}

int taper_gated_delta_recurrent_decode(const float* mixed, const float* decay, const float* beta,
                                       const float* gate, const float* norm_weight,
                                       float* ssm_state, const int64_t* src, const int64_t* slot,
                                       const uint8_t* fresh, float* core, int64_t B,
                                       int64_t num_rows, int64_t nk, int64_t nv, int64_t dk,
                                       int64_t dv, float eps) {
    if (!rows_in_range(src, slot, B, num_rows)) return TAPER_ERR_ARG;
    const int64_t Kd = nk * dk, Vd = nv * dv, C = 2 * Kd + Vd, r = nv / nk;
    const float q_scale = (float)pow((double)dk, -0.5);    // np.float32(dk ** -0.5)
    /* q and k normalised, one head's state, the rows kv_mem / delta / o, squares to sum */
    const int64_t sq_len = dk > dv ? dk : dv;
    float* scratch = malloc(sizeof(float) * (size_t)(2 * Kd + dk * dv + 3 * dv + sq_len));
    if (!scratch) return TAPER_ERR_NOMEM;
    float* qn = scratch;
    float* kn = qn + Kd;
    float* S = kn + Kd;
    float* kv_mem = S + dk * dv;
    float* delta = kv_mem + dv;
    float* o = delta + dv;
    float* sq = o + dv;
    for (int64_t i = 0; i < B; i++) {
        const float* m = mixed + i * C;
        for (int64_t h = 0; h < nk; h++) {
            l2norm_(m + h * dk, qn + h * dk, sq, dk, q_scale, 1);
            l2norm_(m + Kd + h * dk, kn + h * dk, sq, dk, 1.0f, 0);
        }
        for (int64_t h = 0; h < nv; h++) {
            const float* qh = qn + (h / r) * dk;
            const float* kh = kn + (h / r) * dk;
            const float* vh = m + 2 * Kd + h * dv;
            const float d = decay[i * nv + h], bt = beta[i * nv + h];
            const float* S_src = ssm_state + (src[i] * nv + h) * dk * dv;
            if (fresh[i]) memset(S, 0, sizeof(float) * (size_t)(dk * dv));
            else for (int64_t e = 0; e < dk * dv; e++) S[e] = S_src[e] * d;
            for (int64_t v = 0; v < dv; v++) kv_mem[v] = 0.0f;
            for (int64_t k = 0; k < dk; k++)
                for (int64_t v = 0; v < dv; v++) kv_mem[v] += S[k * dv + v] * kh[k];
            for (int64_t v = 0; v < dv; v++) delta[v] = (vh[v] - kv_mem[v]) * bt;
            for (int64_t k = 0; k < dk; k++)
                for (int64_t v = 0; v < dv; v++) S[k * dv + v] += kh[k] * delta[v];
            for (int64_t v = 0; v < dv; v++) o[v] = 0.0f;
            for (int64_t k = 0; k < dk; k++)
                for (int64_t v = 0; v < dv; v++) o[v] += S[k * dv + v] * qh[k];
            memcpy(ssm_state + (slot[i] * nv + h) * dk * dv, S, sizeof(float) * (size_t)(dk * dv));
            for (int64_t v = 0; v < dv; v++) sq[v] = o[v] * o[v];
            // mean: NumPy divides the float32 sum by an intp count in float64
            const float mean = (float)((double)numpy_sum(sq, dv) / (double)dv);
            const float den = sqrtf(mean + eps);
            const float* g = gate + i * Vd + h * dv;
            float* out = core + i * Vd + h * dv;
            for (int64_t v = 0; v < dv; v++) out[v] = ((o[v] / den) * norm_weight[v]) * g[v];
        }
    }
    free(scratch);
    return TAPER_OK;
}

/* The routed experts of a mixture-of-experts layer in one call (moe_kernels.h).
 *
 * Why one call: the experts of the models Taper runs on a CPU are small (DeepSeek-V2-Lite's are
 * 1408 x 2048, Qwen3-Next's 512 x 2048) and a decode step routes each token to 6-10 of them, so
 * a Python loop over experts (two linears and an activation each, plus the gathers and the
 * weighted sum) spent more time calling than multiplying. Here the pairs are sorted by expert
 * (a stable counting sort: pair order within an expert, as the Python path's stable argsort),
 * each expert gathers its tokens' rows and runs gate_up, the activation and down on them, and
 * the weighted sum in slot order writes the output.
 *
 * Each expert's matmuls are the very kernels `linear` calls with the same rows (the same T), so
 * the numbers are those of one linear per expert: the linear kernels' sums for an output do not
 * depend on the thread count (cpu_kernels.c, quant_kernels.c), which lets the experts run on
 * one thread each, side by side.
 */
#include "moe_kernels.h"

#include "cpu_kernels.h"
#include "quant_kernels.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

/* out (M, N) = x (M, K) @ W.T for one expert's weight W = parts[first, last) stacked along N. */
static int project(int isa, const taper_moe_part* parts, int64_t first, int64_t last,
                   const float* x, float* out, int64_t M, int64_t K, int64_t N,
                   int batch_invariant, int prefill_int8, int nthreads) {
    int64_t col = 0;
    for (int64_t i = first; i < last; i++) {
        const taper_moe_part* p = &parts[i];
        int st;
        if (p->dtype >= 0) {  // a float weight is its own one part: out's rows are its rows
            if (p->rows != N || last - first != 1) return TAPER_ERR_ARG;
            st = taper_linear_ex(isa, x, p->data, p->dtype, NULL, out, M, K, N, batch_invariant,
                                 nthreads);
        } else {
            if (col + p->rows > N) return TAPER_ERR_ARG;
            st = taper_quant_linear(isa, p->qtype, x, p->data, NULL, out + col, M, K, p->rows, N,
                                    batch_invariant, p->act_split, prefill_int8, nthreads);
        }
        if (st != TAPER_OK) return st;
        col += p->rows;
    }
    return col == N ? TAPER_OK : TAPER_ERR_ARG;
}

/* Checks every expert's part table covers its rows, so that errors surface before any work. */
static int check_table(const taper_moe_part* parts, const int64_t* start, int64_t E, int64_t N) {
    for (int64_t e = 0; e < E; e++) {
        if (start[e] < 0 || start[e + 1] <= start[e]) return TAPER_ERR_ARG;
        int64_t rows = 0;
        for (int64_t i = start[e]; i < start[e + 1]; i++) {
            if (parts[i].rows <= 0 || (parts[i].dtype >= 0 && start[e + 1] - start[e] != 1))
                return TAPER_ERR_ARG;
            rows += parts[i].rows;
        }
        if (rows != N) return TAPER_ERR_ARG;
    }
    return TAPER_OK;
}

typedef struct {
    int64_t count, expert;
} expert_load;

static int by_load(const void* a, const void* b) {  // most pairs first, then by expert
    const expert_load *u = a, *v = b;
    if (u->count != v->count) return u->count > v->count ? -1 : 1;
    return (u->expert > v->expert) - (u->expert < v->expert);
}

/* gate_up, activation and down of expert e on its n pairs (pair ids `pairs`), writing y's rows
 * (n, H). scratch: n * (H + 3 I) floats. */
static int run_expert(int isa, int64_t e, const int64_t* pairs, int64_t n, const float* x,
                      const taper_moe_part* gate_up, const int64_t* gate_up_start,
                      const taper_moe_part* down, const int64_t* down_start, int activation,
                      float* y, float* scratch, int64_t H, int64_t inter, int64_t top_k,
                      int batch_invariant, int prefill_int8, int nthreads) {
    float* xg = scratch;             // (n, H) the pairs' tokens
    float* gu = xg + n * H;          // (n, 2I)
    float* act = gu + n * 2 * inter; // (n, I)
    for (int64_t i = 0; i < n; i++)
        memcpy(xg + i * H, x + pairs[i] / top_k * H, (size_t)H * sizeof(float));
    int st = project(isa, gate_up, gate_up_start[e], gate_up_start[e + 1], xg, gu, n, H,
                     2 * inter, batch_invariant, prefill_int8, nthreads);
    if (st != TAPER_OK) return st;
    st = activation == TAPER_MOE_SILU ? taper_silu_and_mul(isa, gu, act, n, inter, nthreads)
                                      : taper_gelu_tanh_and_mul(isa, gu, act, n, inter, nthreads);
    if (st != TAPER_OK) return st;
    return project(isa, down, down_start[e], down_start[e + 1], act, y, n, inter, H,
                   batch_invariant, prefill_int8, nthreads);
}

int taper_moe_experts(int isa, const float* x, const int64_t* topk_ids, const float* topk_weights,
                      const taper_moe_part* gate_up, const int64_t* gate_up_start,
                      const taper_moe_part* down, const int64_t* down_start, int activation,
                      float* out, int64_t T, int64_t H, int64_t inter, int64_t top_k, int64_t E,
                      int batch_invariant, int prefill_int8, int nthreads) {
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    if (T < 0 || H <= 0 || inter <= 0 || top_k <= 0 || E <= 0) return TAPER_ERR_ARG;
    if (activation != TAPER_MOE_SILU && activation != TAPER_MOE_GELU_TANH) return TAPER_ERR_ARG;
    if (check_table(gate_up, gate_up_start, E, 2 * inter) != TAPER_OK ||
        check_table(down, down_start, E, H) != TAPER_OK)
        return TAPER_ERR_ARG;
    if (T == 0) return TAPER_OK;
    const int nt = nthreads > 0 ? nthreads : 1;
    const int64_t P = T * top_k;

    // Counting sort of the routed pairs by expert; pos[p] = pair p's row in y (-1: unrouted).
    int64_t* offsets = calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t* sorted = malloc((size_t)P * sizeof(int64_t));
    int64_t* pos = malloc((size_t)P * sizeof(int64_t));
    expert_load* active = malloc((size_t)E * sizeof(expert_load));
    if (!offsets || !sorted || !pos || !active) {
        free(offsets), free(sorted), free(pos), free(active);
        return TAPER_ERR_NOMEM;
    }
    for (int64_t p = 0; p < P; p++)
        if (topk_ids[p] >= 0 && topk_ids[p] < E) offsets[topk_ids[p] + 1]++;
    int64_t nactive = 0, most = 0;
    for (int64_t e = 0; e < E; e++) {
        if (offsets[e + 1]) active[nactive++] = (expert_load){offsets[e + 1], e};
        most = MAX(most, offsets[e + 1]);
        offsets[e + 1] += offsets[e];
    }
    const int64_t routed = offsets[E];
    {
        int64_t* fill = malloc((size_t)E * sizeof(int64_t));
        if (!fill) {
            free(offsets), free(sorted), free(pos), free(active);
            return TAPER_ERR_NOMEM;
        }
        memcpy(fill, offsets, (size_t)E * sizeof(int64_t));
        for (int64_t p = 0; p < P; p++) {
            int64_t e = topk_ids[p];
            if (e >= 0 && e < E) {
                pos[p] = fill[e]++;
                sorted[pos[p]] = p;
            } else {
                pos[p] = -1;
            }
        }
        free(fill);
    }
    qsort(active, (size_t)nactive, sizeof(expert_load), by_load);

    // y: the routed pairs' outputs, expert by expert (rows offsets[e] .. offsets[e + 1]).
    float* y = malloc((size_t)MAX(routed, 1) * H * sizeof(float));
    const int64_t per_row = H + 3 * inter;
    // Side by side when every thread gets an expert; else each expert with all the threads.
    const int across = nt > 1 && nactive >= nt;
    const int teams = across ? nt : 1;
    float* scratch = malloc((size_t)teams * most * per_row * sizeof(float) + 1);
    int status = y && scratch ? TAPER_OK : TAPER_ERR_NOMEM;
    if (status == TAPER_OK && across) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t a = 0; a < nactive; a++) {
            int64_t e = active[a].expert, n = active[a].count;
            float* mine = scratch + (size_t)omp_get_thread_num() * most * per_row;
            int st = run_expert(isa, e, sorted + offsets[e], n, x, gate_up, gate_up_start, down,
                                down_start, activation, y + offsets[e] * H, mine, H, inter,
                                top_k, batch_invariant, prefill_int8, 1);
            if (st != TAPER_OK) {
#pragma omp atomic write
                status = st;
            }
        }
    } else if (status == TAPER_OK) {
        for (int64_t a = 0; a < nactive && status == TAPER_OK; a++) {
            int64_t e = active[a].expert;
            status = run_expert(isa, e, sorted + offsets[e], active[a].count, x, gate_up,
                                gate_up_start, down, down_start, activation, y + offsets[e] * H,
                                scratch, H, inter, top_k, batch_invariant, prefill_int8, nt);
        }
    }

    // The weighted sum in slot order from 0 (each product rounded, then added: NumPy's order).
    if (status == TAPER_OK) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * H * top_k > 65536)
        for (int64_t t = 0; t < T; t++) {
            float* o = out + t * H;
            for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
            for (int64_t j = 0; j < top_k; j++) {
                int64_t r = pos[t * top_k + j];
                if (r < 0) continue;
                const float w = topk_weights[t * top_k + j];
                const float* yr = y + r * H;
                for (int64_t h = 0; h < H; h++) {
                    float v = w * yr[h];
                    o[h] += v;
                }
            }
        }
    }
    free(scratch);
    free(y);
    free(active);
    free(pos);
    free(sorted);
    free(offsets);
    return status;
}

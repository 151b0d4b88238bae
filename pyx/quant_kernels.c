/* Dispatch by quant type, and the quantized matmul loop (see quant_kernels.h).
 *
 * Up to QUANT_GEMV_MAX_T token rows (decode) the loop quantizes each activation row once, then
 * walks weight rows in the outer loop so a row's blocks stay in cache while every activation row
 * is dotted with it. Beyond that (prefill) it would unpack every weight block T times, so panels
 * of weight rows are dequantized to float32 once (per-thread scratch) and go through the dense
 * GEMM of taper_linear with the float32 activations, as the int4 path does for GPTQ
 * (pyx/cpu_int4.py, GEMV_MAX_T / PANEL_BYTES): the activations are not rounded to Q8 there,
 * so results differ from the decode path's by that rounding (they are closer to x @ W.T).
 * act_split (the CPU backend's kernels act_split=on) makes the loop nearly as exact, at twice its
 * integer work: each activation row becomes two 8-bit rows (quantize_act_split).
 * With prefill_int8 (kernels quant_prefill=int8, the default) the K types on AVX-512 leave the
 * loop and the float32 paths from int8_min_t rows (4, or 33 for Q2_K/Q3_K) for the int8 GEMM of
 * quant_gemm.c, which takes the same quantized rows and returns the loop's bits; the legacy types
 * on AVX512_VNNI from 3 rows for quant_gemm_legacy.c's, likewise, up to 4 rows (the loop's
 * range: the results do not change), and beyond under TAPER_PREFILL_INT8_ALL.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "quant_internal.h"

/* Rows ahead of the current weight row that the matmul loop prefetches (into every cache level):
 * for T = 1 the loop is a stream of short rows (0.5-5 KB), and without it the compute and the
 * memory stalls add up instead of overlapping (Q8_0 9728x896 on 2 threads: 0.76 -> 0.47 ms with
 * the guided schedule below; the row prefetch alone or the schedule alone gives much less). */
#define PF_ROWS 2

/* Token rows up to which the vec_dot loop runs; longer inputs take the dequantize + GEMM path.
 * The loop's cost grows with T from the first row; the panel path pays the (scalar reference)
 * dequantize once, then a GEMM. Measured on 2 threads, AVX-512, Qwen2.5-0.5B shapes (loop at
 * T = 16 vs panels at T = 17, ms): Q8_0 4864x896 2.04 vs 1.30, Q5_0 2.45 vs 2.76, Q4_K
 * 896x4864 1.45 vs 1.72, Q6_K 1.34 vs 3.48 (its dequantize is the slowest); the loop's time
 * per token stays flat, so the break-even is below 17 for Q8_0, ~22-25 for Q5_0 / Q4_K and
 * ~60 for Q6_K; at T = 128 the panels are 3-4x faster for all four. 32 is the compromise (loop
 * at T = 32 vs panels at T = 33: Q8_0 4.38 vs 2.54, Q5_0 4.56 vs 3.33, Q4_K 2.81 vs 2.09, Q6_K
 * 2.70 vs 3.98). bench/HISTORY.md (2026-11-22): 128-token prefill 0.45-0.50x -> 1.09-1.30x
 * llama.cpp. */
#define QUANT_GEMV_MAX_T 32
/* Under AVX-512 the types with a SIMD dequantizer leave the loop for float32 weights
 * (quant_linear_chunks up to QUANT_GEMV_MAX_T rows, the panels beyond) from fewer rows: a block
 * dequantizes with a few shuffles and scales, and the AVX-512 small-M float32 kernel beats one
 * int8 dot product per block and row. One Zen 4 core, loop -> float32:
 * - legacy (Q4_0 .. Q8_0), from 5 rows: 9728x896 Q8_0 T=8 3.69 -> 2.2-2.8 ms, T=16 7.37 ->
 *   3.5-4.1; Q5_0 T=8 4.97 -> 2.87, T=16 9.27 -> 4.44; T=4 about even, T=2 the loop 1.7x faster.
 * - Q4_K and Q6_K, from 13 rows (their loop unpacks a 256-value super-block more cheaply):
 *   896x4864 T=16 Q4_K 2.52-2.65 -> 2.18-2.29 ms, Q6_K 2.79-3.61 -> 2.78-2.82; at T=8 the loop
 *   is as fast or faster.
 * Under AVX2 the loop stays ahead up to ~12 rows (Q8_0): the common cap holds there. */
#define QUANT_GEMV_MAX_T_SIMD_LEGACY 4
#define QUANT_GEMV_MAX_T_SIMD_K 12
/* Weight rows per dequantized panel: at most this many bytes of float32 (as the int4 path). */
#define PANEL_BYTES (8 << 20)
/* Batched decode's per-thread chunk of dequantized rows (quant_linear_chunks): a quarter of a
 * 1 MiB L2, beside the x rows and the output. */
#define CHUNK_BYTES (256 << 10)
/* Token rows per GEMM call, which bounds the panel's output scratch (T_CHUNK x panel rows). */
#define T_CHUNK 512

/* Per-thread scratch grown on demand and kept (a prefill calls this ~170 times; malloc'ing
 * 8 MB each time would page-fault it in every time). */
static _Thread_local float *scratch_buf[2];
static _Thread_local size_t scratch_cap[2];

static float *scratch(int i, size_t n) {
    if (scratch_cap[i] < n) {
        free(scratch_buf[i]);
        scratch_buf[i] = malloc(n * sizeof(float));
        scratch_cap[i] = scratch_buf[i] ? n : 0;
    }
    return scratch_buf[i];
}

/* The type's dequantizer for this ISA: its SIMD body above scalar where it has one. */
static void dequantize_row(int isa, const taper_quant_traits *t, const void *src, float *dst,
                           int64_t n) {
    if (isa != TAPER_ISA_SCALAR && t->dequantize_simd) t->dequantize_simd(isa, src, dst, n);
    else t->dequantize(src, dst, n);
}

/* out (T, ldo) = x (T, K) @ W.T + bias through float32 panels of W's rows (see the top). */
static int quant_linear_panels(int isa, const taper_quant_traits *t, const float *x,
                               const void *w, const float *bias, float *out, int64_t T,
                               int64_t K, int64_t N, int64_t ldo, int inv, int nt) {
    const int64_t w_row = K / t->block_size * t->type_size;
    int64_t step = PANEL_BYTES / (4 * K) / 32 * 32;
    if (step < 32) step = 32;
    if (step > N) step = N;
    const int64_t tc = T < T_CHUNK ? T : T_CHUNK;
    float *panel = scratch(0, (size_t)(step * K));
    /* a panel that is all of out (ldo == N) is written in place, others go through tmp */
    float *tmp = (step == N && ldo == N) ? NULL : scratch(1, (size_t)(tc * step));
    if (!panel || (!tmp && !(step == N && ldo == N))) return TAPER_ERR_NOMEM;
    for (int64_t n0 = 0; n0 < N; n0 += step) {
        const int64_t rows = N - n0 < step ? N - n0 : step;
        #pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < rows; r++)
            dequantize_row(isa, t, (const uint8_t *)w + (n0 + r) * w_row, panel + r * K, K);
        for (int64_t t0 = 0; t0 < T; t0 += tc) {
            const int64_t tr = T - t0 < tc ? T - t0 : tc;
            if (!tmp) {
                const int st = taper_linear_ex(isa, x + t0 * K, panel, TAPER_F32, bias,
                                               out + t0 * ldo, tr, K, rows, inv, nt);
                if (st != TAPER_OK) return st;
                continue;
            }
            const int st = taper_linear_ex(isa, x + t0 * K, panel, TAPER_F32,
                                           bias ? bias + n0 : NULL, tmp, tr, K, rows, inv, nt);
            if (st != TAPER_OK) return st;
            for (int64_t r = 0; r < tr; r++)
                memcpy(out + (t0 + r) * ldo + n0, tmp + r * rows, (size_t)rows * sizeof(float));
        }
    }
    return TAPER_OK;
}

/* out (T, ldo) = x (T, K) @ W.T + bias for a batched decode through float32 weights: each thread
 * dequantizes chunks of its own rows (CHUNK_BYTES of float32, in L2) and multiplies them at once
 * with the small-M kernel, so the float32 copy never goes to memory. The panels above would
 * write and read 8 bytes a weight beside the 1-4 its blocks take, which two threads' bandwidth
 * cannot afford at 16 rows (Q8_0 batch-16 decode fell from 64 to 57 tokens/s through them). */
static int quant_linear_chunks(int isa, const taper_quant_traits *t, const float *x,
                               const void *w, const float *bias, float *out, int64_t T,
                               int64_t K, int64_t N, int64_t ldo, int nt) {
    const int64_t w_row = K / t->block_size * t->type_size;
    int64_t step = CHUNK_BYTES / (4 * K) / 4 * 4;
    if (step < 16) step = 16;
    const int64_t nchunks = (N + step - 1) / step;
    int status = TAPER_OK;
    #pragma omp parallel num_threads(nt)
    {
        float *wf = scratch(0, (size_t)(step * K)), *of = scratch(1, (size_t)(T * step));
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            const int64_t n0 = c * step, rows = N - n0 < step ? N - n0 : step;
            if (!wf || !of) {
                #pragma omp atomic write
                status = TAPER_ERR_NOMEM;
                continue;
            }
            for (int64_t r = 0; r < rows; r++)
                dequantize_row(isa, t, (const uint8_t *)w + (n0 + r) * w_row, wf + r * K, K);
            const int st = taper_linear_ex(isa, x, wf, TAPER_F32, bias ? bias + n0 : NULL, of, T,
                                           K, rows, 0, 1);
            if (st != TAPER_OK) {
                #pragma omp atomic write
                status = st;
                continue;
            }
            for (int64_t r = 0; r < T; r++)
                memcpy(out + r * ldo + n0, of + r * rows, (size_t)rows * sizeof(float));
        }
    }
    return status;
}

/* act_split != 0: the decode loop writes each activation row as two 8-bit rows (below) instead of
   rounding it to 8 bits once, as ggml does. Off by default: the loop is compute-bound on its
   integer dot products (Q8_0 4864x896 at T = 1: 19 GB/s on one core from cache), and two rows
   double them (bench/RESULTS.md, numerics against llama.cpp). */

/* One activation row as two 8-bit rows of the activation format: hi = x rounded as ggml rounds
 * it, lo = the rounding residual x - hi rounded the same way, so hi + lo is x to about 1/250 of
 * one rounding step (|x - hi - lo| <= 0.0025 amax/127 per block instead of 0.5625 amax/127).
 * The matmul dots every weight row with both, which keeps the exact integer block dot products
 * of the vec_dot kernels while its result comes ~250x closer to x @ W.T (one 8-bit rounding
 * moves the logits of the 2-layer GGUF fixtures 0.03-0.05 from float64 on the same weights,
 * two rows 1-2e-4; bench/RESULTS.md).
 * For Q8_1 (the Q4_1/Q5_1 weights' minimum term) lo's block sum s carries what hi's f16 s lost,
 * so s_hi + s_lo is the block's sum of x, not just of its rounded levels. `res`: K floats. */
static void quantize_act_split(const taper_quant_traits *a, const float *x, uint8_t *hi,
                               uint8_t *lo, float *res, int64_t K) {
    a->quantize(x, hi, K);
    a->dequantize(hi, res, K);
    for (int64_t k = 0; k < K; k++) res[k] = x[k] - res[k];
    a->quantize(res, lo, K);
    if (a->type != TAPER_Q8_1) return;
    taper_block_q8_1 *bh = (taper_block_q8_1 *)hi, *bl = (taper_block_q8_1 *)lo;
    for (int64_t i = 0; i < K / TAPER_QK; i++) {
        float sum = 0.0f;
        for (int j = 0; j < TAPER_QK; j++) sum += x[i * TAPER_QK + j];
        bl[i].s = taper_float_to_half(sum - taper_half_to_float(bh[i].s));
    }
}

static const taper_quant_traits *traits(int type) {
    const taper_quant_traits *t = taper_legacy_traits(type);
    return t ? t : taper_k_traits(type);
}

int taper_quant_block_size(int type) {
    const taper_quant_traits *t = traits(type);
    return t ? t->block_size : 0;
}

int taper_quant_type_size(int type) {
    const taper_quant_traits *t = traits(type);
    return t ? t->type_size : 0;
}

int taper_dequantize(int isa, int type, const void *src, float *dst, int64_t n) {
    const taper_quant_traits *t = traits(type);
    if (!t || !t->dequantize || n % t->block_size) return TAPER_ERR_ARG;
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    dequantize_row(isa, t, src, dst, n);
    return TAPER_OK;
}

int taper_quantize(int type, const float *src, void *dst, int64_t rows, int64_t k, int nthreads) {
    const taper_quant_traits *t = traits(type);
    if (!t || !t->quantize || k % t->block_size || rows < 0) return TAPER_ERR_ARG;
    const int64_t row_bytes = k / t->block_size * t->type_size;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++)
        t->quantize(src + r * k, (uint8_t *)dst + r * row_bytes, k);
    return TAPER_OK;
}

int taper_quant_gemv_max_t(int isa, int type) {
    const taper_quant_traits *t = traits(type);
    if (!t || !t->dequantize_simd || isa != TAPER_ISA_AVX512) return QUANT_GEMV_MAX_T;
    return t->block_size == TAPER_QK ? QUANT_GEMV_MAX_T_SIMD_LEGACY : QUANT_GEMV_MAX_T_SIMD_K;
}

/* batch_invariant: every T takes the panel path with the invariant dense GEMM, so a row's bits
 * do not depend on T (the vec_dot loop rounds the activations to Q8 and sums per block: its
 * results differ from the panels', and the switch between the two depends on T). */
int taper_quant_prefill_int8(int isa, int type) {
    const taper_quant_traits *t = traits(type);
    if (!t || isa != TAPER_ISA_AVX512) return 0;
    if (t->k_unpack) return t->int8_min_t;
    /* the legacy GEMM multiplies with vpdpbusd (quant_gemm_legacy.c) */
    return t->legacy_unpack && __builtin_cpu_supports("avx512vnni") ? t->int8_min_t : 0;
}

int taper_quant_linear(int isa, int type, const float *x, const void *w, const float *bias,
                       float *out, int64_t T, int64_t K, int64_t N, int64_t ldo,
                       int batch_invariant, int act_split, int prefill_int8, int nthreads) {
    const taper_quant_traits *t = traits(type);
    if (!t || !t->vec_dot || K % t->block_size || ldo < N || T < 0 || N < 0) return TAPER_ERR_ARG;
    const taper_quant_traits *a = traits(t->vec_dot_type);
    if (!a || !a->quantize || K % a->block_size) return TAPER_ERR_ARG;
    if (!taper_cpu_isa_supported(isa)) return TAPER_ERR_ISA;
    if (T == 0 || N == 0) return TAPER_OK;
    const int nt = nthreads > 0 ? nthreads : 1;
    /* the int8 GEMM takes over from the float32 paths, from the same T; the vec_dot loop's
       results are its bits, so the switch at that T changes nothing but the speed */
    /* The legacy types beyond the loop's range (T > 4 on AVX-512) only under
       TAPER_PREFILL_INT8_ALL (quant_kernels.h), and then not with act_split's two rows: the
       float32 paths multiply the exact activations at no extra cost, while int8 does its work
       twice (one Zen 4 core, SmolLM2 shapes: int8 1.6-2.5x the two-row loop at T = 3, 4;
       0.6-1.0x the float32 chunks at T = 5-16, 0.4-0.7x the panels at T = 32-256). The K
       types' float32 paths pay a dearer dequantization. */
    const int int8 = prefill_int8 && !batch_invariant && taper_quant_prefill_int8(isa, type) &&
                     T >= t->int8_min_t &&
                     (t->k_unpack || T <= taper_quant_gemv_max_t(isa, type) ||
                      (prefill_int8 == TAPER_PREFILL_INT8_ALL && !act_split));
    if (!int8 && (T > taper_quant_gemv_max_t(isa, type) || batch_invariant) && t->dequantize)
        return T <= QUANT_GEMV_MAX_T && !batch_invariant
            ? quant_linear_chunks(isa, t, x, w, bias, out, T, K, N, ldo, nt)
            : quant_linear_panels(isa, t, x, w, bias, out, T, K, N, ldo, batch_invariant, nt);
    const int64_t w_row = K / t->block_size * t->type_size;
    const int64_t x_row = K / a->block_size * a->type_size;
    const int parts = act_split ? 2 : 1;
    uint8_t *xq = malloc((size_t)(parts * T * x_row));
    float *res = parts == 2 ? malloc((size_t)(T * K) * sizeof(float)) : NULL;
    if (!xq || (parts == 2 && !res)) {
        free(xq);
        free(res);
        return TAPER_ERR_NOMEM;
    }
    uint8_t *lo = xq + T * x_row;   /* the residual rows, when parts == 2 */
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < T; r++) {
            if (parts == 2)
                quantize_act_split(a, x + r * K, xq + r * x_row, lo + r * x_row, res + r * K, K);
            else
                a->quantize(x + r * K, xq + r * x_row, K);
        }
    }
    int status = TAPER_OK;
    if (int8)
        status = t->k_unpack
            ? taper_k_gemm_int8(t, __builtin_cpu_supports("avx512vnni"), xq, parts, w, bias, out,
                                T, K, N, ldo, nt)
            : taper_legacy_gemm_int8(t, xq, parts, w, bias, out, T, K, N, ldo, nt);
    else {
    #pragma omp parallel num_threads(nt)
    {
        /* guided: each thread streams long runs of consecutive rows (which the hardware
           prefetcher follows, and few scheduling atomics), shrinking to 16 rows at the end to
           balance the threads. dynamic,16 interleaved the threads' 16-row chunks and streamed
           at about half the rate (Q8_0 151936x896: 8.7 -> 5.3 ms with the prefetch above). */
        #pragma omp for schedule(guided, 16)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wr = (const uint8_t *)w + n * w_row;
            const float b = bias ? bias[n] : 0.0f;
            if (n + PF_ROWS < N) {
                const char *pf = (const char *)wr + PF_ROWS * w_row;
                for (int64_t o = 0; o < w_row; o += 64) __builtin_prefetch(pf + o, 0, 3);
            }
            for (int64_t r = 0; r < T; r++) {
                const uint8_t *xr = xq + r * x_row, *lr = lo + r * x_row;
                float v;
                if (parts == 1) v = t->vec_dot(isa, K, wr, xr);
                else if (t->vec_dot2) v = t->vec_dot2(isa, K, wr, xr, lr);
                else v = t->vec_dot(isa, K, wr, xr) + t->vec_dot(isa, K, wr, lr);
                out[r * ldo + n] = v + b;
            }
        }
    }
    }
    free(res);
    free(xq);
    return status;
}

/* ---- half <-> float, exact and without F16C */

float taper_half_to_float(taper_half h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);             /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);     /* normal */
    } else if (mant == 0) {
        bits = sign;                                          /* zero */
    } else {                                                  /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

taper_half taper_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t abs = x & 0x7fffffffu;
    if (abs > 0x7f800000u) return (taper_half)(sign | 0x7e00);     /* nan */
    if (abs >= 0x477ff000u) return (taper_half)(sign | 0x7c00);    /* rounds to inf */
    if (abs < 0x38800000u) {                                        /* subnormal or zero */
        if (abs < 0x33000000u) return (taper_half)sign;             /* below half the tiniest */
        const uint32_t e = abs >> 23, m = (abs & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e;                             /* 14..24 */
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (taper_half)(sign | h);
    }
    uint32_t h = ((abs >> 13) - (112u << 10));                      /* rebias exponent */
    const uint32_t rest = abs & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;          /* nearest even */
    return (taper_half)(sign | h);
}

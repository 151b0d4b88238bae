/* GGML block quantization on the CPU: the packed block formats of GGUF files (byte-identical to
 * ggml's), a scalar reference per type, the quantizers used by in-situ quantization (--isq), and
 * a matmul that computes on the packed blocks.
 *
 * The trick (ggml's): activations are quantized per row to 8-bit blocks of the same length as
 * the weight's blocks (Q8_0 for the 32-element types, Q8_K for the 256-element K types), so a
 * weight row times an activation row is a sum of per-block integer dot products, each scaled by
 * the two blocks' float scales.
 *
 * Files: quant_kernels.c (dispatch by type, the matmul loop), quant_legacy.c (Q4_0 Q4_1 Q5_0 Q5_1
 * Q8_0, and the Q8_0/Q8_1 activation formats), quant_k.c (Q2_K..Q6_K and Q8_K). No AMX.
 */
#ifndef TAPER_QUANT_KERNELS_H
#define TAPER_QUANT_KERNELS_H

#include <stdint.h>

/* Type ids: GGUF's GGMLQuantizationType values (the gguf package's enum). */
enum {
    TAPER_Q4_0 = 2, TAPER_Q4_1 = 3, TAPER_Q5_0 = 6, TAPER_Q5_1 = 7, TAPER_Q8_0 = 8,
    TAPER_Q8_1 = 9, TAPER_Q2_K = 10, TAPER_Q3_K = 11, TAPER_Q4_K = 12, TAPER_Q5_K = 13,
    TAPER_Q6_K = 14, TAPER_Q8_K = 15,
};

#define TAPER_QK 32       /* elements per block, legacy types */
#define TAPER_QK_K 256    /* elements per super-block, K types */
#define TAPER_K_SCALE_SIZE 12

typedef uint16_t taper_half;  /* IEEE binary16 bits */

/* ---- block structs: field order and sizes are ggml's (ggml-common.h), so file bytes map 1:1 */

typedef struct { taper_half d; uint8_t qs[TAPER_QK / 2]; } taper_block_q4_0;
typedef struct { taper_half d, m; uint8_t qs[TAPER_QK / 2]; } taper_block_q4_1;
typedef struct { taper_half d; uint8_t qh[4]; uint8_t qs[TAPER_QK / 2]; } taper_block_q5_0;
typedef struct { taper_half d, m; uint8_t qh[4]; uint8_t qs[TAPER_QK / 2]; } taper_block_q5_1;
typedef struct { taper_half d; int8_t qs[TAPER_QK]; } taper_block_q8_0;
typedef struct { taper_half d, s; int8_t qs[TAPER_QK]; } taper_block_q8_1;  /* s = d * sum(qs) */

typedef struct {
    uint8_t scales[TAPER_QK_K / 16];  /* 4-bit scale | 4-bit min per 16 elements */
    uint8_t qs[TAPER_QK_K / 4];       /* 2-bit quants */
    taper_half d, dmin;
} taper_block_q2_K;
typedef struct {
    uint8_t hmask[TAPER_QK_K / 8];    /* high bit of the 3-bit quants */
    uint8_t qs[TAPER_QK_K / 4];       /* low 2 bits */
    uint8_t scales[TAPER_K_SCALE_SIZE];  /* 16 6-bit scales */
    taper_half d;
} taper_block_q3_K;
typedef struct {
    taper_half d, dmin;
    uint8_t scales[TAPER_K_SCALE_SIZE];  /* 8 6-bit scales and 8 6-bit mins */
    uint8_t qs[TAPER_QK_K / 2];
} taper_block_q4_K;
typedef struct {
    taper_half d, dmin;
    uint8_t scales[TAPER_K_SCALE_SIZE];
    uint8_t qh[TAPER_QK_K / 8];
    uint8_t qs[TAPER_QK_K / 2];
} taper_block_q5_K;
typedef struct {
    uint8_t ql[TAPER_QK_K / 2];       /* low 4 bits */
    uint8_t qh[TAPER_QK_K / 4];       /* high 2 bits */
    int8_t scales[TAPER_QK_K / 16];
    taper_half d;
} taper_block_q6_K;
typedef struct {
    float d;
    int8_t qs[TAPER_QK_K];
    int16_t bsums[TAPER_QK_K / 16];   /* sums of qs in groups of 16 */
} taper_block_q8_K;

#define TAPER_STATIC_ASSERT(c, m) _Static_assert(c, m)
TAPER_STATIC_ASSERT(sizeof(taper_block_q4_0) == 18, "q4_0 is 18 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q4_1) == 20, "q4_1 is 20 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q5_0) == 22, "q5_0 is 22 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q5_1) == 24, "q5_1 is 24 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q8_0) == 34, "q8_0 is 34 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q8_1) == 36, "q8_1 is 36 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q2_K) == 84, "q2_K is 84 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q3_K) == 110, "q3_K is 110 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q4_K) == 144, "q4_K is 144 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q5_K) == 176, "q5_K is 176 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q6_K) == 210, "q6_K is 210 bytes");
TAPER_STATIC_ASSERT(sizeof(taper_block_q8_K) == 292, "q8_K is 292 bytes");

/* ---- public API. Status codes are cpu_kernels.h's: TAPER_OK, TAPER_ERR_ARG (unknown type,
 * length not a multiple of the block size), TAPER_ERR_ISA, TAPER_ERR_NOMEM. */

int taper_quant_block_size(int type);  /* elements per block; 0 for an unknown type */
int taper_quant_type_size(int type);   /* bytes per block; 0 for an unknown type */

/* n elements (a multiple of the block size) of `type` to float: the scalar reference with
 * TAPER_ISA_SCALAR, else the type's SIMD body where it has one (bit-identical). */
int taper_dequantize(int isa, int type, const void *src, float *dst, int64_t n);

/* ISQ: `rows` rows of k floats (k a multiple of the block size) to blocks, row after row.
 * Legacy types are byte-identical to gguf.quants.quantize; K types follow llama.cpp's reference
 * quantizers (quantize_row_*_ref, no importance matrix). OpenMP over rows. */
int taper_quantize(int type, const float *src /* (rows, k) */, void *dst, int64_t rows,
                   int64_t k, int nthreads);

/* out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]), W quantized row-major: row n is k/B blocks.
 * Up to taper_quant_gemv_max_t(isa, type) token rows, x is quantized per row to the type's activation
 * format first (decode); beyond, panels of W are dequantized to float32 and multiplied with the
 * float32 x by taper_linear's GEMM (prefill). `ldo` is out's row stride in floats (>= N), so
 * parts of a fused weight can write column slices of one output. batch_invariant != 0: the
 * panel path for every T, through the batch-invariant GEMM (taper_linear_ex). act_split != 0:
 * the decode path writes each activation row as two 8-bit rows, the value and its rounding
 * residual (~250x closer to x @ W.T, twice the integer work); 0 rounds it once, as ggml. */
int taper_quant_gemv_max_t(int isa, int type);
/* prefill_int8 != 0: from taper_quant_prefill_int8(isa, type) token rows (0: never; the K types
 * on AVX-512 have it), the Q8_K-quantized activations (act_split honoured) are multiplied with
 * the weights in int8 tiles (quant_gemm.c) instead of the vec_dot loop or the float32 paths:
 * the vec_dot loop's results, bit for bit, at prefill speed. batch_invariant wins over it.
 * The legacy types (AVX512_VNNI, quant_gemm_legacy.c) take it from 3 rows only up to
 * taper_quant_gemv_max_t (in the loop's place) unless prefill_int8 == TAPER_PREFILL_INT8_ALL,
 * which puts their one-row matmuls there at every T: their activations are then rounded to Q8
 * beyond 4 rows, as the loop's, rather than multiplied in float32 (farther from the file's
 * weights: the hybrid Q8_0 fixtures' first logits 0.03 -> 0.21 from the float reference). */
#define TAPER_PREFILL_INT8_ALL 2
int taper_quant_prefill_int8(int isa, int type);
int taper_quant_linear(int isa, int type, const float *x /* (T, K) */,
                       const void *w /* (N, K/B blocks) */, const float *bias /* (N) or NULL */,
                       float *out /* (T, ldo) */, int64_t T, int64_t K, int64_t N, int64_t ldo,
                       int batch_invariant, int act_split, int prefill_int8, int nthreads);

#endif

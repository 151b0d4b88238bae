/* What quant_legacy.c and quant_k.c give quant_kernels.c: per type, the scalar reference
 * dequantizer, the reference quantizer, and the dot product of one weight row with one
 * activation row already quantized to the type's activation format (`vec_dot_type`).
 *
 * vec_dot has one body per ISA (TAPER_ISA_SCALAR / AVX2 / AVX512 from cpu_kernels.h), compiled
 * with target attributes and chosen at run time; the scalar one is the reference the others are
 * tested against. n is the row length in elements (a multiple of the block size).
 */
#ifndef TAPER_QUANT_INTERNAL_H
#define TAPER_QUANT_INTERNAL_H

#include "quant_kernels.h"

typedef void (*taper_dequant_fn)(const void *src, float *dst, int64_t n);
/* the SIMD dequantizer for an ISA above scalar, bit-identical to the reference */
typedef void (*taper_dequant_isa_fn)(int isa, const void *src, float *dst, int64_t n);
typedef void (*taper_quant_fn)(const float *src, void *dst, int64_t n);
typedef float (*taper_vec_dot_fn)(int isa, int64_t n, const void *w, const void *xq);
/* w against two activation rows, summed (act_split's hi and lo, quant_kernels.c) */
typedef float (*taper_vec_dot2_fn)(int isa, int64_t n, const void *w, const void *xq,
                                   const void *xq2);

/* One K super-block unpacked for the int8 prefill GEMM (quant_gemm.c), once per weight row and
 * reused by every token row: u the levels as unsigned bytes in element order; sc the group scale
 * of elements 2k and 2k+1 (maddubs' int16 output layout, so one load per 64 elements); mn the
 * coefficient of the activation's bsums[g] per group of 16: the minimum (summs, times dmin) or,
 * for the signed types (min_in_isum), minus the level offset times the scale (added to isum). */
typedef struct {
    uint8_t u[TAPER_QK_K];
    int16_t sc[TAPER_QK_K / 2];
    int16_t mn[16];
    float d, dmin;
} taper_k_unpacked;
typedef void (*taper_k_unpack_fn)(const void *block, taper_k_unpacked *out);

/* Two legacy blocks (64 elements) of one weight row unpacked for the int8 prefill GEMM
 * (quant_gemm_legacy.c): q the codes as signed bytes in element order (as vec_dot's, the _1
 * types' unsigned codes included), c = -128 times the sum of each 4 consecutive codes, which
 * takes back the 128 added to the activations to make them vpdpbusd's unsigned operand. A row's
 * odd last block fills the low half. */
typedef struct {
    int8_t q[64];
    int32_t c[16];
} taper_legacy_unpacked;
/* One weight row of nb blocks -> (nb + 1) / 2 chunks in out; block i's d (and the _1 types' m,
 * else m is not written) to d[i * stride], m[i * stride]. */
typedef void (*taper_legacy_unpack_fn)(const void *row, int64_t nb, taper_legacy_unpacked *out,
                                       float *d, float *m, int stride);

typedef struct {
    int type;
    int block_size;          /* elements per block */
    int type_size;           /* bytes per block */
    int vec_dot_type;        /* activation format: TAPER_Q8_0, TAPER_Q8_1 or TAPER_Q8_K */
    taper_dequant_fn dequantize;
    taper_quant_fn quantize;
    taper_vec_dot_fn vec_dot;  /* NULL for the activation-only types (Q8_1, Q8_K) */
    taper_vec_dot2_fn vec_dot2;  /* NULL where none is fused: two vec_dot calls instead */
    taper_dequant_isa_fn dequantize_simd;  /* NULL where the reference is all there is */
    taper_k_unpack_fn k_unpack;  /* K types: the int8 GEMM's unpacker; NULL for the others */
    int min_in_isum;             /* k_unpack's mn belongs to isum (Q3_K, Q6_K), else to summs */
    int int8_min_t;              /* token rows from which the int8 GEMM beats the vec_dot loop */
    taper_legacy_unpack_fn legacy_unpack;  /* legacy types: the int8 GEMM's unpacker */
} taper_quant_traits;

/* The int8 x int8 prefill GEMM for the K types (quant_gemm.c): out[r, n] = sum over the rows of
 * xq[r] (one Q8_K row, or two, hi and lo, under act_split) of vec_dot(W[n], row) + bias[n],
 * bit-identical to the vec_dot loop. xq: T * parts rows of x_row bytes, the lo rows after the
 * hi ones (as taper_quant_linear lays them out). vnni: use AVX512_VNNI's vpdpwssd. */
int taper_k_gemm_int8(const taper_quant_traits *t, int vnni, const void *xq, int parts,
                      const void *w, const float *bias, float *out, int64_t T, int64_t K,
                      int64_t N, int64_t ldo, int nthreads);

/* The same for the legacy types (quant_gemm_legacy.c, AVX512_VNNI only): xq holds Q8_0 or Q8_1
 * rows (the type's vec_dot_type), bit-identical to the AVX-512 vec_dot loop. */
int taper_legacy_gemm_int8(const taper_quant_traits *t, const void *xq, int parts, const void *w,
                           const float *bias, float *out, int64_t T, int64_t K, int64_t N,
                           int64_t ldo, int nthreads);

/* Each file fills the entries of its types; quant_kernels.c looks them up by type id. */
const taper_quant_traits *taper_legacy_traits(int type);  /* quant_legacy.c, NULL if not its */
const taper_quant_traits *taper_k_traits(int type);       /* quant_k.c, NULL if not its */

/* IEEE half <-> float, exact (no F16C needed), shared by both files (quant_kernels.c). */
float taper_half_to_float(taper_half h);
taper_half taper_float_to_half(float f);  /* round to nearest even, as numpy's float16 */

#endif

/* W4A16 on the CPU: out = x @ dequant(W)^T + bias with W kept as packed 4-bit codes and the
 * activations in f32 (no activation quantization). Serves GPTQ, AWQ and compressed-tensors
 * pack-quantized checkpoints: the loaders (engine/loader/quant_int4.py, quant_compressed.py)
 * repack each of them once, at load, into the one layout below.
 *
 * Layout of an (N, K) weight quantized in groups of G consecutive elements of a row (K and G
 * multiples of 32, G divides K; per-channel quantization is G = K):
 *   qs     (N, K/2) uint8. Row n is K/32 blocks of 16 bytes; byte j of block b holds the code of
 *          element 32b + j in its low nibble and of element 32b + 16 + j in its high nibble
 *          (ggml's Q4_0 order: one 16-byte load gives 16 codes in order as low nibbles and the
 *          next 16 as high nibbles, with no shuffles).
 *   scales (N, K/G) f32, zeros (N, K/G) f32:  W[n, k] = scales[n, g] * (code - zeros[n, g]),
 *          g = k / G. Zeros are floats, not nibbles: a GPTQ v1 checkpoint can say 16 (it stores
 *          zero - 1 per nibble, and 15 reads back as 16).
 *
 * The trick (AVX-512): the 16 values a group's codes can take fit one zmm register, so
 * dequantizing 16 codes is one vpermps with the zero-extended code bytes as indices. vpermps
 * reads only the low 4 bits of each index, so the low nibble needs no mask and the high nibble is
 * one shift. AVX2 has no 16-entry float permute: it converts codes to float and applies
 * (code - zero) * scale. Every path computes each weight as the f32 product
 * scale * (code - zero), so dequantized values are bit-identical on all ISAs.
 */
#ifndef TAPER_INT4_KERNELS_H
#define TAPER_INT4_KERNELS_H

#include <stdint.h>

/* Status codes and ISA ids are cpu_kernels.h's (TAPER_OK, TAPER_ERR_ARG, TAPER_ERR_ISA,
 * TAPER_ISA_SCALAR / AVX2 / AVX512). TAPER_ERR_ARG here: K or G not a multiple of 32, or G not
 * dividing K. */

/* out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]). `ldo` is out's row stride in floats (>= N), so
 * the parts of a fused weight can write column slices of one output. OpenMP over blocks of 4
 * rows; each block's codes are decoded once per tile of 4 token rows. */
int taper_int4_linear(int isa,
                      const float* x,        // (T, K)
                      const uint8_t* qs,     // (N, K/2)
                      const float* scales,   // (N, K/G)
                      const float* zeros,    // (N, K/G)
                      const float* bias,     // (N,) or NULL
                      float* out,            // (T, ldo)
                      int64_t T, int64_t K, int64_t N, int64_t G, int64_t ldo, int nthreads);

/* W as f32 (N, K), row after row; OpenMP over rows. With `isa` TAPER_ISA_SCALAR this is the
 * scalar reference. */
int taper_int4_dequantize(int isa,
                          const uint8_t* qs,     // (N, K/2)
                          const float* scales,   // (N, K/G)
                          const float* zeros,    // (N, K/G)
                          float* out,            // (N, K)
                          int64_t N, int64_t K, int64_t G, int nthreads);

#endif

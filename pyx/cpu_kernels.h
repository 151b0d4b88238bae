/* Taper CPU kernels: the C ABI behind pyx/cpu_backend.pyx (DESIGN.md section 2).
 *
 * Every kernel takes raw pointers, sizes and a thread count, allocates at most small per-thread
 * scratch, and returns an int status (TAPER_OK or one of the TAPER_ERR_* codes below). Shapes are
 * validated in Cython before the call; the kernels still check what only they can see cheaply
 * (indices inside the data: token ids, positions, slots, block ids).
 * All kernels are reentrant: no global mutable state. The ISA used by `linear` is an argument.
 */
#ifndef TAPER_CPU_KERNELS_H
#define TAPER_CPU_KERNELS_H

#include <stdint.h>

#define TAPER_OK 0
#define TAPER_ERR_ARG 1     /* bad index inside the data (token id, position, slot, block id) */
#define TAPER_ERR_ISA 2     /* the requested ISA is unknown or not supported by this CPU */
#define TAPER_ERR_NOMEM 3   /* per-thread scratch allocation failed */

/* weight dtypes */
#define TAPER_F32 0
#define TAPER_BF16 1
#define TAPER_F16 2

/* ISA paths of `linear` */
#define TAPER_ISA_SCALAR 0
#define TAPER_ISA_AVX2 1    /* AVX2 + FMA + F16C */
#define TAPER_ISA_AVX512 2  /* AVX-512F + BW + VL */

int taper_cpu_isa_supported(int isa);
int taper_cpu_best_isa(void);
int taper_cpu_max_threads(void);

int taper_embedding(const int32_t* token_ids,  // (T,)
                    const void* table,         // (V, H) f32|bf16|f16
                    int dtype, int64_t T, int64_t V, int64_t H,
                    float* out,                // (T, H)
                    int nthreads);

int taper_linear(int isa,
                 const float* x,       // (T, K)
                 const void* weight,   // (N, K) f32|bf16|f16
                 int dtype,
                 const float* bias,    // (N,) or NULL
                 float* out,           // (T, N)
                 int64_t T, int64_t K, int64_t N, int nthreads);

/* taper_linear with a switch: batch_invariant != 0 makes each output row's bits independent of T
 * (and of the other rows): one kernel for every T (see cpu_kernels.c). */
int taper_linear_ex(int isa,
                    const float* x,       // (T, K)
                    const void* weight,   // (N, K) f32|bf16|f16
                    int dtype,
                    const float* bias,    // (N,) or NULL
                    float* out,           // (T, N)
                    int64_t T, int64_t K, int64_t N, int batch_invariant, int nthreads);

/* The AVX-512 small-M kernel's software prefetch (kernels gemv_prefetch): auto (from the L1 size),
 * the next tile into L1, or two tiles ahead into L2. */
enum { TAPER_PREFETCH_AUTO = 0, TAPER_PREFETCH_L1 = 1, TAPER_PREFETCH_L2 = 2 };

/* taper_linear_ex with the prefetch chosen; the results do not depend on it. */
int taper_linear_pf(int isa, const float* x, const void* weight, int dtype, const float* bias,
                    float* out, int64_t T, int64_t K, int64_t N, int batch_invariant, int prefetch,
                    int nthreads);

int taper_rms_norm(const float* x,       // (T, H)
                   const float* weight,  // (H,)
                   float eps,
                   float* out,           // (T, H)
                   int64_t T, int64_t H, int nthreads);

int taper_fused_add_rms_norm(float* x,             // (T, H) in: x, out: rms_norm(residual + x)
                             float* residual,      // (T, H) in place += x
                             const float* weight,  // (H,)
                             float eps, int64_t T, int64_t H, int nthreads);

/* LayerNorm (StableLM): out = (x - mean) / sqrt(var + eps) * weight + bias, bias NULL = none. */
int taper_layer_norm(const float* x,       // (T, H)
                     const float* weight,  // (H,)
                     const float* bias,    // (H,) or NULL
                     float eps,
                     float* out,           // (T, H)
                     int64_t T, int64_t H, int nthreads);

/* residual += x; x = layer_norm(residual). */
int taper_fused_add_layer_norm(float* x,             // (T, H)
                               float* residual,      // (T, H)
                               const float* weight,  // (H,)
                               const float* bias,    // (H,) or NULL
                               float eps, int64_t T, int64_t H, int nthreads);

int taper_rotary_embedding(const int32_t* positions,     // (T,)
                           float* q,                     // (T, Hq, D)
                           float* k,                     // (T, Hkv, D)
                           const float* cos_sin_cache,   // (max_pos, rot_dim)
                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t rot_dim,
                           int64_t max_pos, int is_neox, int nthreads);

int taper_silu_and_mul(int isa,
                       const float* x,  // (T, 2I)
                       float* out,      // (T, I)
                       int64_t T, int64_t inter, int nthreads);

/* GeGLU gate: out = gelu_tanh(x[:, :I]) * x[:, I:],
 * gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))). */
int taper_gelu_tanh_and_mul(int isa,
                            const float* x,  // (T, 2I)
                            float* out,      // (T, I)
                            int64_t T, int64_t inter, int nthreads);

/* In place x = cap * tanh(x / cap) (Gemma-2 soft-capping), cap > 0. */
int taper_softcap(int isa,
                  float* x,  // (n,)
                  int64_t n, float cap, int nthreads);

/* In place x *= s (Gemma's embedding scaled by sqrt(hidden)). */
int taper_scale(float* x,  // (n,)
                int64_t n, float s, int nthreads);

int taper_reshape_and_cache(const float* k,              // (T, Hkv, D)
                            const float* v,              // (T, Hkv, D)
                            float* k_cache,              // (NB, BS, Hkv, D)
                            float* v_cache,              // (NB, BS, Hkv, D)
                            const int32_t* slot_mapping, // (T,)
                            int64_t T, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                            int nthreads);

/* FP8 KV cache write (DESIGN.md section 5): cache = e4m3(x / scale[h]) for KV head h, rounded to
 * nearest even and saturated to +-448. */
int taper_reshape_and_cache_fp8(const float* k,              // (T, Hkv, D)
                                const float* v,              // (T, Hkv, D)
                                uint8_t* k_cache,            // (NB, BS, Hkv, D) e4m3
                                uint8_t* v_cache,            // (NB, BS, Hkv, D) e4m3
                                const float* k_scale,        // (Hkv,)
                                const float* v_scale,        // (Hkv,)
                                const int32_t* slot_mapping, // (T,)
                                int64_t T, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                                int nthreads);

/* Causal paged attention (pyx/backend.pyx). softcap > 0 caps every scaled score s to
 * softcap * tanh(s / softcap) before the softmax (Gemma-2); 0 = off (the other code is unchanged).
 * sinks (Hq,) or NULL: a logit per query head that joins each row's softmax with no value
 * (GPT-OSS's attention sinks).
 * batch_invariant != 0: each query row is computed the same way whatever else the call holds
 * (decode or prefill, chunking, other sequences, thread count): no split-K, key chunks aligned
 * to absolute positions, one piece kernel for every tile. */
int taper_paged_attention(int isa,
                          float* out,                    // (T, Hq, D)
                          const float* q,                // (T, Hq, D)
                          const float* k_cache,          // (NB, BS, Hkv, D)
                          const float* v_cache,          // (NB, BS, Hkv, D)
                          const int32_t* block_tables,   // (B, MB)
                          const int32_t* seq_lens,       // (B,)
                          const int32_t* query_start_loc,// (B+1,)
                          int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                          int64_t NB, int64_t BS, int64_t MB, float scale, int64_t sliding_window,
                          float softcap, const float* sinks, int batch_invariant, int nthreads);

/* The same over an FP8 cache: K/V read back as decode(code) * scale[h] of their KV head. */
int taper_paged_attention_fp8(int isa,
                              float* out,                    // (T, Hq, D)
                              const float* q,                // (T, Hq, D)
                              const uint8_t* k_cache,        // (NB, BS, Hkv, D) e4m3
                              const uint8_t* v_cache,        // (NB, BS, Hkv, D) e4m3
                              const float* k_scale,          // (Hkv,)
                              const float* v_scale,          // (Hkv,)
                              const int32_t* block_tables,   // (B, MB)
                              const int32_t* seq_lens,       // (B,)
                              const int32_t* query_start_loc,// (B+1,)
                              int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                              int64_t NB, int64_t BS, int64_t MB, float scale,
                              int64_t sliding_window, float softcap, const float* sinks,
                              int batch_invariant, int nthreads);

int taper_argmax(const float* logits,  // (B, V)
                 int64_t* out,         // (B,)
                 int64_t B, int64_t V, int nthreads);

int taper_gumbel_sample(const float* logits,     // (B, V)
                        const uint64_t* seeds,   // (B,)
                        const int64_t* positions,// (B,)
                        int64_t* out,            // (B,)
                        int64_t B, int64_t V, int nthreads);

/* Structured outputs: logits[rows[r], v] = -inf where bit v % 32 of word v / 32 of
 * bitmask[rows[r]] is 0. Rows not listed are untouched. TAPER_ERR_ARG for a row outside [0, B). */
int taper_apply_token_bitmask(float* logits,           // (B, V)
                              const int32_t* bitmask,  // (B, ceil(V / 32))
                              const int32_t* rows,     // (R,)
                              int64_t B, int64_t V, int64_t R, int nthreads);

/* Philox4x32-10 block (exposed for known-answer tests). ctr (4,) in place; key (2,). */
void taper_philox4x32_10(uint32_t* ctr, const uint32_t* key);

#endif

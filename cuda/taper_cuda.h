/* Taper CUDA kernels: the C ABI behind pyx/cuda_backend.pyx (DESIGN.md section 2).
 *
 * Every launcher takes device pointers, sizes, a workspace where it needs one and a stream, and
 * returns an int status: 0, TAPER_CUDA_ERR_ARG for arguments it cannot run with, or the
 * cudaError_t of the launch. Launchers never allocate, never synchronize and keep no state, so
 * every one of them can be captured in a CUDA Graph. Shapes are validated in Cython first; the
 * launchers re-check only what a bad call would turn into an out-of-bounds access.
 *
 * Element types: `dtype` is the activation type, TAPER_DT_F32, TAPER_DT_BF16 or TAPER_DT_F16
 * (float accumulation everywhere). Vectors that the CPU backend keeps in float32 (norm weights,
 * biases, the RoPE cos/sin cache, FP8 scales, logits) are float32 here too. `cache_dtype` is the
 * KV cache's element type: the activation type, or TAPER_DT_FP8 (OCP e4m3 codes with one float
 * scale per KV head, DESIGN.md section 5).
 *
 * Shapes: T tokens, B sequences, H hidden, Hq / Hkv query / KV heads, D head dim, I intermediate,
 * NB blocks, BS block size, MB max blocks per sequence, V vocabulary.
 */
#ifndef TAPER_CUDA_H
#define TAPER_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* taper_stream_t;  /* a cudaStream_t, without the runtime header */

#define TAPER_CUDA_OK 0
#define TAPER_CUDA_ERR_ARG -1   /* sizes or a variant the launcher cannot run */

#define TAPER_DT_F32 0
#define TAPER_DT_BF16 1
#define TAPER_DT_F16 2
#define TAPER_DT_FP8 3          /* KV cache only: e4m3fn codes, one byte each */

/* ---- runtime helpers (no device needed to call them) */

/* Number of visible devices; 0 (never an error) without a driver or a device. */
int taper_cuda_device_count(void);
/* cudaGetErrorString of a status, or a sentence for TAPER_CUDA_ERR_ARG. */
const char* taper_cuda_error_string(int status);

/* ---- embedding.cu */

int taper_cuda_embedding(const int32_t* token_ids,  // (T,)
                         const void* table,         // (V, H) dtype
                         void* out,                 // (T, H) dtype
                         int64_t T, int64_t V, int64_t H, int dtype, taper_stream_t stream);

/* ---- norm.cu */

int taper_cuda_rms_norm(const void* x,        // (T, H) dtype
                        const float* weight,  // (H,)
                        void* out,            // (T, H) dtype
                        int64_t T, int64_t H, float eps, int dtype, taper_stream_t stream);

/* residual += x (kept in dtype); x = rms_norm(residual) * weight. */
int taper_cuda_fused_add_rms_norm(void* x,              // (T, H) dtype
                                  void* residual,       // (T, H) dtype
                                  const float* weight,  // (H,)
                                  int64_t T, int64_t H, float eps, int dtype,
                                  taper_stream_t stream);

/* LayerNorm: out = (x - mean) / sqrt(var + eps) * weight + bias (bias NULL = none). */
int taper_cuda_layer_norm(const void* x,        // (T, H) dtype
                          const float* weight,  // (H,)
                          const float* bias,    // (H,) or NULL
                          void* out,            // (T, H) dtype
                          int64_t T, int64_t H, float eps, int dtype, taper_stream_t stream);

/* residual += x (kept in dtype); x = layer_norm(residual). */
int taper_cuda_fused_add_layer_norm(void* x,              // (T, H) dtype
                                    void* residual,       // (T, H) dtype
                                    const float* weight,  // (H,)
                                    const float* bias,    // (H,) or NULL
                                    int64_t T, int64_t H, float eps, int dtype,
                                    taper_stream_t stream);

/* ---- rotary.cu: in place on the first rot_dim dims of every head (the CPU op's contract) */

int taper_cuda_rotary_embedding(const int32_t* positions,    // (T,)
                                void* q,                     // (T, Hq, D) dtype
                                void* k,                     // (T, Hkv, D) dtype
                                const float* cos_sin_cache,  // (max_pos, rot_dim)
                                int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t rot_dim,
                                int64_t max_pos, int is_neox, int dtype, taper_stream_t stream);

/* ---- activation.cu */

/* out = act(x[:, :I]) * x[:, I:], act = silu or gelu(tanh approximation). */
int taper_cuda_silu_and_mul(const void* x,  // (T, 2I) dtype
                            void* out,      // (T, I) dtype
                            int64_t T, int64_t I, int dtype, taper_stream_t stream);
int taper_cuda_gelu_tanh_and_mul(const void* x,  // (T, 2I) dtype
                                 void* out,      // (T, I) dtype
                                 int64_t T, int64_t I, int dtype, taper_stream_t stream);
/* GPT-OSS's clamped SwiGLU: g = min(x[:, :I], limit), u = clip(x[:, I:], -limit, limit),
 * out = (u + 1) * g * sigmoid(alpha * g). limit > 0, alpha finite. */
int taper_cuda_clamped_swiglu(const void* x,  // (T, 2I) dtype
                              void* out,      // (T, I) dtype
                              int64_t T, int64_t I, float alpha, float limit, int dtype,
                              taper_stream_t stream);

/* In place x = cap * tanh(x / cap) (Gemma-2 logit soft-capping); dtype may be F32 (logits). */
int taper_cuda_softcap(void* x,  // (n,) dtype
                       int64_t n, float cap, int dtype, taper_stream_t stream);

/* In place x *= s, computed in float (Gemma's embedding times sqrt(hidden)). */
int taper_cuda_scale(void* x,  // (n,) dtype
                     int64_t n, float s, int dtype, taper_stream_t stream);

/* In place out[t, n] += bias[n]; out may be F32 (logits) or the activation dtype. */
int taper_cuda_add_bias(void* out,          // (T, N) dtype
                        const float* bias,  // (N,)
                        int64_t T, int64_t N, int dtype, taper_stream_t stream);

/* ---- vision.cu: vision encoders' ops */

/* out = 0.5 x erfc(-x / sqrt(2)), the exact GELU, elementwise; out may be x. */
int taper_cuda_gelu(const void* x,  // (n,) dtype
                    void* out,      // (n,) dtype
                    int64_t n, int dtype, taper_stream_t stream);

/* Bidirectional attention within packed segments: rows [cu_seqlens[s], cu_seqlens[s+1]) attend
 * to every row of their segment, out = softmax(scale q.k) v per head; no mask, no cache.
 * cu_seqlens from 0 to N, non-decreasing (not checked on the device); D <= 256. */
int taper_cuda_encoder_attention(void* out,                   // (N, H, D) dtype
                                 const void* q,               // (N, H, D) dtype
                                 const void* k,               // (N, H, D) dtype
                                 const void* v,               // (N, H, D) dtype
                                 const int32_t* cu_seqlens,   // (S + 1,)
                                 int64_t N, int64_t S, int64_t H, int64_t D, float scale,
                                 int dtype, taper_stream_t stream);

/* ---- kv_cache.cu: cache.flat_slot[slot_mapping[t]] = kv[t]; slot -1 skipped. FP8 stores
 * e4m3(x / scale[h]), round to nearest even, saturated to +-448, NaN kept. */

int taper_cuda_reshape_and_cache(const void* k,               // (T, Hkv, D) dtype
                                 const void* v,               // (T, Hkv, D) dtype
                                 void* k_cache,               // (NB, BS, Hkv, D) cache_dtype
                                 void* v_cache,               // (NB, BS, Hkv, D) cache_dtype
                                 const int32_t* slot_mapping, // (T,)
                                 const float* k_scale,        // (Hkv,), FP8 only, else NULL
                                 const float* v_scale,        // (Hkv,), FP8 only, else NULL
                                 int64_t T, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                                 int dtype, int cache_dtype, taper_stream_t stream);

/* ---- attention_decode.cu: one query token per sequence (T == B).
 * Causal over the sequence's whole context, sliding_window 0 = off, softcap 0 = off. A KV head's
 * query group shares each K/V load. num_splits > 1 cuts long contexts into that many partitions
 * whose partial softmax results go to the workspace and are merged by a second kernel; 1 is the
 * simple one-pass kernel (the reference). Head sizes 64, 80, 96, 128, 256 are compiled for
 * speed; any other D that is a multiple of 8 up to 256 runs a generic loop. */

/* Bytes of workspace the decode launcher needs for (B, Hq, D, num_splits); 0 for num_splits 1. */
int64_t taper_cuda_decode_workspace_bytes(int64_t B, int64_t Hq, int64_t D, int num_splits);

/* The partition count is the caller's choice (1..64); the engine's rule is the pure function
 * pyx/decode_splits.py, tested on the CPU, fed with the device's SM count and this: how many
 * blocks of the decode kernel for (Hq, Hkv, D, dtype, cache_dtype) an SM holds at once. */
int taper_cuda_decode_blocks_per_sm(int64_t Hq, int64_t Hkv, int64_t D, int dtype,
                                    int cache_dtype, int* blocks);

int taper_cuda_paged_attention_decode(void* out,                   // (B, Hq, D) dtype
                                      const void* q,               // (B, Hq, D) dtype
                                      const void* k_cache,         // (NB, BS, Hkv, D)
                                      const void* v_cache,         // (NB, BS, Hkv, D)
                                      const float* k_scale,        // (Hkv,) FP8, else NULL
                                      const float* v_scale,        // (Hkv,) FP8, else NULL
                                      const int32_t* block_tables, // (B, MB)
                                      const int32_t* seq_lens,     // (B,)
                                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t NB,
                                      int64_t BS, int64_t MB, float scale, int64_t sliding_window,
                                      float softcap, int dtype, int cache_dtype, int num_splits,
                                      void* workspace, int64_t workspace_bytes,
                                      taper_stream_t stream);

/* ---- attention_prefill.cu: any mix of prefill chunks and decode rows (the CPU op's contract:
 * row i of sequence b sits at position seq_lens[b] - (query_start_loc[b+1] - i)).
 * variant 0: the simple kernel (reference; one warp per (row, head), online softmax), any
 * dtype, cache type and D (a multiple of 8 up to 256): the fallback for inputs 1 and 2 lack.
 * variant 1: FlashAttention-2 style (attention_prefill_fa2.cu: the query heads of one KV head
 * packed into one block, cp.async double-buffered K/V, ldmatrix, mma.sync) for sm80+, bf16/f16
 * with a same-type cache, D in {64, 128}; other inputs return TAPER_CUDA_ERR_ARG (the caller
 * falls back to variant 0).
 * variant 2: warp-specialized Hopper form of 1 (attention_prefill_fa3.cu: a producer warpgroup
 * filling an mbarrier ring, wgmma in the consumer warpgroup), same inputs, on compute capability
 * 9.0 with the sm_90a build; elsewhere it runs variant 1. */

int taper_cuda_paged_attention_prefill(void* out,                      // (T, Hq, D) dtype
                                       const void* q,                  // (T, Hq, D) dtype
                                       const void* k_cache,            // (NB, BS, Hkv, D)
                                       const void* v_cache,            // (NB, BS, Hkv, D)
                                       const float* k_scale,           // (Hkv,) FP8, else NULL
                                       const float* v_scale,           // (Hkv,) FP8, else NULL
                                       const int32_t* block_tables,    // (B, MB)
                                       const int32_t* seq_lens,        // (B,)
                                       const int32_t* query_start_loc, // (B+1,)
                                       int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                       int64_t NB, int64_t BS, int64_t MB, float scale,
                                       int64_t sliding_window, float softcap, int dtype,
                                       int cache_dtype, int variant, taper_stream_t stream);

/* The simple kernel (variant 0 above) over any batch, decode rows included, with the masks and
 * widths the tuned kernels lack: sinks (Hq,) or NULL, GPT-OSS's attention sinks (each row's
 * softmax denominator gains exp(sinks[h] - max score)); attention_chunk > 0, Llama 4's chunked
 * attention (a row at position p attends no key before p / attention_chunk * attention_chunk);
 * D a multiple of 8 up to 512. sliding_window, softcap and FP8 caches as variant 0. */
int taper_cuda_paged_attention_masked(void* out,                      // (T, Hq, D) dtype
                                      const void* q,                  // (T, Hq, D) dtype
                                      const void* k_cache,            // (NB, BS, Hkv, D)
                                      const void* v_cache,            // (NB, BS, Hkv, D)
                                      const float* k_scale,           // (Hkv,) FP8, else NULL
                                      const float* v_scale,           // (Hkv,) FP8, else NULL
                                      const int32_t* block_tables,    // (B, MB)
                                      const int32_t* seq_lens,        // (B,)
                                      const int32_t* query_start_loc, // (B+1,)
                                      const float* sinks,             // (Hq,) or NULL
                                      int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                      int64_t NB, int64_t BS, int64_t MB, float scale,
                                      int64_t sliding_window, int64_t attention_chunk,
                                      float softcap, int dtype, int cache_dtype,
                                      taper_stream_t stream);

/* ---- mla_decode.cu: decode attention over multi-head latent attention's cache: one query row
 * per sequence, every query head reads the one cached head (D <= 1024), the value is a row's
 * first Dv values. Cache of the activation type (no FP8). */
int taper_cuda_mla_decode_attention(void* out,                    // (B, Hq, Dv) dtype
                                    const void* q,                // (B, Hq, D) dtype
                                    const void* cache,            // (NB, BS, 1, D) dtype
                                    const int32_t* block_tables,  // (B, MB)
                                    const int32_t* seq_lens,      // (B,), each >= 1
                                    int64_t B, int64_t Hq, int64_t D, int64_t Dv, int64_t NB,
                                    int64_t BS, int64_t MB, float scale, int dtype,
                                    taper_stream_t stream);

/* ---- sampling.cu (logits float32). Randomness is the CPU backend's exactly (DESIGN.md 5):
 * Philox4x32-10 with counter (v, pos_lo, pos_hi, 0), key (seed_lo, seed_hi); u = (x0 + 0.5) / 2^32
 * in double; Gumbel-max value logit - log(-log(u)) in double; lowest index wins ties. */

int taper_cuda_argmax(const float* logits,  // (B, V)
                      int64_t* out,         // (B,)
                      int64_t B, int64_t V, taper_stream_t stream);

int taper_cuda_gumbel_sample(const float* logits,       // (B, V)
                             const uint64_t* seeds,     // (B,)
                             const int64_t* positions,  // (B,)
                             int64_t* out,              // (B,)
                             int64_t B, int64_t V, taper_stream_t stream);

/* ---- token_bitmask.cu: structured outputs. For each listed row b = rows[r], logits[b, v] = -inf
 * where bit v % 32 of bitmask[b, v / 32] is 0 (llguidance's layout); R <= 65535. Rows outside
 * [0, B) are skipped (the CPU backend reports them). */
int taper_cuda_apply_token_bitmask(float* logits,           // (B, V)
                                   const int32_t* bitmask,  // (B, ceil(V / 32))
                                   const int32_t* rows,     // (R,)
                                   int64_t B, int64_t V, int64_t R, taper_stream_t stream);

/* For each of N distinct (row, col) entries, in vLLM's order:
 * x = logits[row, col] + bias; x = x > 0 ? x / rep : x * rep; x -= pres_freq. */
int taper_cuda_apply_penalties(float* logits,         // (B, V)
                               const int32_t* rows,   // (N,)
                               const int32_t* cols,   // (N,)
                               const float* bias,     // (N,) logit_bias sum, -inf masks a token
                               const float* rep,      // (N,) repetition penalty, 1 = none
                               const float* pres_freq,// (N,) presence + frequency * count
                               int64_t B, int64_t V, int64_t N, taper_stream_t stream);

/* In place, per row: x /= max(temperature, 1e-5) when temperature != 1; then every token below
 * the row's threshold becomes -inf. The threshold is the largest of: the k-th largest value
 * (top_k in (0, V)), the logit of the last token of the smallest most-likely set holding top_p of
 * the mass of the top-k survivors (top_p < 1), and max + log(min_p) (min_p > 0). */
int taper_cuda_filter_logits(float* logits,             // (B, V)
                             const float* temperature,  // (B,)
                             const int32_t* top_k,      // (B,) 0 = off
                             const float* top_p,        // (B,) 1 = off
                             const float* min_p,        // (B,) 0 = off
                             int64_t B, int64_t V, taper_stream_t stream);

/* The whole sampler in one launch, one block per row (kernels sampling=fused): the row's
 * penalty entries (as taper_cuda_apply_penalties, written in place; pen_rows sorted ascending),
 * then out[b] = the argmax for a greedy row, else the Gumbel-max draw (key seeds[b], counter
 * positions[b]) over the row after temperature and the top-k / top-p / min-p filter. The same
 * token as those ops one after the other (apply_penalties, argmax or filter_logits and
 * gumbel_sample), except that each threshold is found by a radix select, 8 bits of the key per
 * pass, instead of bisection: top-k the same; top-p's mass summed in 2^-k fixed point (k from V,
 * so the sum stays exact integer arithmetic) instead of double, so the kept set can differ only
 * where a prefix's mass lies within ~V^2 2^-62 of top_p times the total; rows with a NaN or a
 * non-finite max bisect for top-p as filter_logits does. Temperature and the mask are applied as
 * the row is read, not written back. N = 0: no penalties (the pen_* pointers may be NULL). */
int taper_cuda_sample_fused(float* logits,               // (B, V)
                            const uint8_t* greedy,       // (B,) nonzero: argmax
                            const float* temperature,    // (B,)
                            const int32_t* top_k,        // (B,) 0 = off
                            const float* top_p,          // (B,) 1 = off
                            const float* min_p,          // (B,) 0 = off
                            const uint64_t* seeds,       // (B,)
                            const int64_t* positions,    // (B,)
                            const int32_t* pen_rows,     // (N,) sorted
                            const int32_t* pen_cols,     // (N,)
                            const float* pen_bias,       // (N,)
                            const float* pen_rep,        // (N,)
                            const float* pen_pres_freq,  // (N,)
                            int64_t* out,                // (B,)
                            int64_t B, int64_t V, int64_t N, taper_stream_t stream);

/* ---- quant_gguf.cu: ggml's block formats on the GPU (issue 6). qtype: GGUF's
 * GGMLQuantizationType ids, the CPU's set: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10,
 * Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14. A weight is N rows of K / block_elems blocks, each row
 * row_bytes long, byte-identical to the file (pyx/quant_kernels.h has the structs). */

/* 1 if the GPU kernels handle qtype, else 0. */
int taper_cuda_gguf_supported(int qtype);

/* out = dequantize(w): the CPU's scalar reference, element for element (prefill multiplies the
 * dequantized panels with cuBLAS). */
int taper_cuda_gguf_dequantize(int qtype,
                               const void* w,  // (N, row_bytes) blocks
                               void* out,      // (N, K) dtype
                               int64_t N, int64_t K, int dtype, taper_stream_t stream);

/* Small-batch matmul on the blocks: out[m, n] = sum_k x[m, k] * dequantize(w)[n, k]. Each row
 * of x is first quantized to Q8_1-style int8 blocks of 32 (with the block's float scale and sum)
 * in the workspace, then rows of w are dotted with int8 products (dp4a), float accumulation.
 * out rows are ldo elements apart (a fused weight writes column slices). */
int64_t taper_cuda_gguf_mmvq_workspace_bytes(int64_t M, int64_t K);
int taper_cuda_gguf_mmvq(int qtype,
                         const void* x,    // (M, K) dtype
                         const void* w,    // (N, row_bytes) blocks
                         void* out,        // (M, ldo) dtype, columns [0, N) written
                         int64_t M, int64_t N, int64_t K, int64_t ldo, int dtype,
                         void* workspace, int64_t workspace_bytes, taper_stream_t stream);

/* ---- marlin.cu: W4A16 GEMM on the Marlin layout (issue 6; pyx/weights/marlin.py defines the
 * layout). W (N, K) is int4 codes with float32 scales and optional uint8 zeros per group of G
 * along K (G = K per channel): W[n, k] = scale[g, n] * (code[n, k] - zero[g, n]), zero 8 when
 * zeros is NULL. Np = ceil(N / 64) * 64; K and G multiples of 16, G dividing K. */

/* One Int4Weight part (canonical layout of pyx/int4_kernels.h, one group size) -> the Marlin
 * layout, bit-identical to pyx/weights/marlin.py repack_int4. Pass zeros NULL (and m_zeros NULL)
 * exactly when repack_int4 gives zeros None (every zero 8); zeros must be integers 0..255. */
int taper_cuda_marlin_repack(const uint8_t* qs,      // (N, K/2) packed codes
                             const float* scales,    // (N, K/G)
                             const float* zeros,     // (N, K/G), or NULL
                             uint32_t* qweight,      // (K/16, Np*2) Marlin tiles
                             float* m_scales,        // (K/G, Np) permuted columns
                             uint8_t* m_zeros,       // (K/G, Np) permuted columns, or NULL
                             int64_t N, int64_t K, int64_t group_size, taper_stream_t stream);

/* out = x @ W.T, float accumulation, dtype BF16 or F16 (F32 is TAPER_CUDA_ERR_ARG). The B
 * operand is W dequantized to dtype element by element (round(scale * (code - zero))).
 * variant 0: the simple kernel (reference, the default). variant 1 (behind a switch until a GPU
 * run verifies it): multi-stage cp.async pipeline, magic-number dequantization in registers with
 * the scale rounded to dtype first (B may differ from variant 0's by one rounding), split K with
 * a global reduce for M <= 16; needs K and G multiples of 64 and x, scales, zeros 16-byte
 * aligned, else TAPER_CUDA_ERR_ARG (fall back to variant 0). Its workspace (counters, then
 * float partial tiles) is workspace_bytes(M, N, K, 1), 0 when it does not split; the counters
 * are zeroed on the stream by each call, so the workspace may be shared and hold garbage. */
int64_t taper_cuda_marlin_workspace_bytes(int64_t M, int64_t N, int64_t K, int variant);
int taper_cuda_marlin_gemm(const void* x,            // (M, K) dtype
                           const uint32_t* qweight,  // (K/16, Np*2) Marlin tiles
                           const float* scales,      // (K/G, Np) permuted columns
                           const uint8_t* zeros,     // (K/G, Np) permuted columns, or NULL
                           void* out,                // (M, N) dtype
                           int64_t M, int64_t N, int64_t K, int64_t group_size, int dtype,
                           int variant, void* workspace, int64_t workspace_bytes,
                           taper_stream_t stream);

/* ---- moe.cu: the fused mixture-of-experts path (pyx/moe.py; issue 16). P = T * top_k (token,
 * slot) pairs, pair p = t * top_k + j; E experts; pair rows are sorted by expert and each
 * expert's run padded to a multiple of block_m (16 or 64 for the GEMM). */

/* Rows of sorted_ids for the worst case: P + min(E, P) * (block_m - 1), rounded up to a multiple
 * of block_m (block_expert then has capacity / block_m entries). */
int64_t taper_cuda_moe_align_capacity(int64_t P, int64_t E, int64_t block_m);

/* sorted_ids[expert_offsets[e] + i] = the i-th pair routed to expert e (order within the run
 * unspecified), the rest of each padded run and of the buffer = P; block_expert[b] = the expert
 * of rows [b * block_m, (b + 1) * block_m), -1 past *num_padded (the padded total). Expert ids
 * outside [0, E) are left out. E <= 4096. */
int taper_cuda_moe_align(const int64_t* topk_ids,  // (P,)
                         int32_t* sorted_ids,      // (capacity,)
                         int32_t* block_expert,    // (capacity / block_m,)
                         int32_t* expert_offsets,  // (E + 1,)
                         int32_t* num_padded,      // (1,)
                         int64_t P, int64_t E, int64_t block_m, taper_stream_t stream);

/* Weight formats of the grouped GEMM: the activation dtype (E, N, K), or GGUF Q8_0 blocks
 * (E, N, K / 32 * 34 bytes, byte-identical to the file). */
#define TAPER_MOE_W_DTYPE 0
#define TAPER_MOE_W_Q8_0 8

/* One launch for all experts: out[p, n] = sum_k x[p / x_div, k] * W[e(p)][n, k] for every pair
 * row p of moe_align's output (x_div = top_k for gate_up on the tokens, 1 for down on the pair
 * rows). dtype BF16 or F16 (mma.sync, float accumulation); block_m 16 or 64, as given to
 * moe_align. Rows of out whose pair is not routed (an expert id outside [0, E)) are not written. */
int taper_cuda_moe_grouped_gemm(const void* x,               // (rows, K) dtype
                                const void* w,               // (E, N, K) dtype or Q8_0 blocks
                                int wtype,                   // TAPER_MOE_W_*
                                const int32_t* sorted_ids,   // (capacity,)
                                const int32_t* block_expert, // (capacity / block_m,)
                                const int32_t* num_padded,   // (1,)
                                void* out,                   // (P, N) dtype
                                int64_t P, int64_t E, int64_t N, int64_t K, int64_t x_div,
                                int64_t block_m, int dtype, taper_stream_t stream);

/* out[t, h] = sum_j weights[t, j] * y[t * top_k + j, h] in float, j in slot order, pairs whose
 * expert id lies outside [0, E) skipped. */
int taper_cuda_moe_combine(const void* y,            // (T * top_k, H) dtype
                           const float* weights,     // (T, top_k)
                           const int64_t* topk_ids,  // (T, top_k)
                           void* out,                // (T, H) dtype
                           int64_t T, int64_t top_k, int64_t H, int64_t E, int dtype,
                           taper_stream_t stream);

/* ---- lora.cu */

/* LoRA deltas with each row's adapter slot on the device (Backend.lora_linear_slots): for each
 * row t with s = slot_of_row[t] in [0, S) and each column c of part p ([parts[p], parts[p+1])):
 *     out[t, c] += sum_j<R (x[t] . a[s, p*R + j]) * b[s, j, c]
 * in float32, the shrink rounded to dtype in y; rows of slot -1 untouched. parts is a HOST array
 * (P <= 8), slot_of_row a device one: graph-safe, nothing read back. */
int taper_cuda_lora_linear_slots(const void* x,               // (T, K) dtype
                                 const void* a,               // (S, P*R, K) dtype
                                 const void* b,               // (S, R, N) dtype
                                 const int32_t* slot_of_row,  // (T,) device
                                 const int32_t* parts,        // (P+1,) host
                                 void* y,                     // (T, P*R) dtype scratch
                                 void* out,                   // (T, N) dtype
                                 int64_t T, int64_t K, int64_t N, int64_t S, int64_t P,
                                 int64_t R, int dtype, taper_stream_t stream);

#ifdef __cplusplus
}
#endif

#endif

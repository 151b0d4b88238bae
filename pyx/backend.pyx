"""The op table every backend implements (DESIGN.md section 2).

Tensors are NumPy arrays on the CPU backend and CuPy arrays on the CUDA backend, C-contiguous.
Activations are float32. Weights may be float32, bfloat16 (ml_dtypes.bfloat16) or float16 and are
read in their stored dtype. Every op writes into caller-given buffers (`out`, or in place where
said), allocates nothing on the hot path and returns None. A bad shape or dtype raises ValueError
naming the op and the shapes. No op silently falls back to another implementation.

Shapes: T tokens in the step, B sequences, H hidden size, D head dim, Hq/Hkv query/KV heads,
NB blocks, BS block size, MB max blocks per sequence, V vocabulary.
"""


cdef class Backend:
    def __init__(self, name):
        self.name = name

    def embedding(self, token_ids, table, out):
        """out[t] = table[token_ids[t]] as float32.
        token_ids (T,) int32; table (V, H) f32|bf16|f16; out (T, H) f32."""
        raise NotImplementedError

    def linear(self, x, weight, bias, out):
        """out = x @ weight.T (+ bias); float32 accumulation.
        x (T, K) f32; weight (N, K) f32|bf16|f16; bias (N,) f32 or None; out (T, N) f32."""
        raise NotImplementedError

    def rms_norm(self, x, weight, eps, out):
        """out = x / sqrt(mean(x^2) + eps) * weight.  x, out (T, H) f32; weight (H,) f32."""
        raise NotImplementedError

    def fused_add_rms_norm(self, x, residual, weight, eps):
        """In place: residual += x; x = rms_norm(residual) * weight.  x, residual (T, H) f32."""
        raise NotImplementedError

    def rotary_embedding(self, positions, q, k, cos_sin_cache, head_dim, is_neox):
        """In place RoPE on the first rot_dim dims of every head of q (T, Hq*D) and k (T, Hkv*D).
        positions (T,) int32; cos_sin_cache (max_pos, rot_dim) f32: cos in the first rot_dim/2
        columns, sin in the last rot_dim/2. is_neox: rotate halves (x[i], x[i + rot_dim/2]),
        else interleaved pairs (x[2i], x[2i+1])."""
        raise NotImplementedError

    def silu_and_mul(self, x, out):
        """out = silu(x[:, :I]) * x[:, I:].  x (T, 2I) f32; out (T, I) f32."""
        raise NotImplementedError

    def reshape_and_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        """k_cache.flat_slot[slot_mapping[t]] = k[t] (same for v); slot -1 is skipped.
        k, v (T, Hkv, D) f32; k_cache, v_cache (NB, BS, Hkv, D) f32; slot_mapping (T,) int32;
        slot = block_id * BS + offset.
        FP8 cache (DESIGN.md section 5): k_cache, v_cache uint8 OCP e4m3 (e4m3fn) codes of the same
        shape, with k_scale, v_scale (Hkv,) f32 (required then, and only then): element d of KV
        head h is stored as e4m3(k[t, h, d] / k_scale[h]), rounded to nearest even, |x| >= 448
        (and inf) saturated to +-448, NaN kept NaN."""
        raise NotImplementedError

    def paged_attention(self, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window, k_scale=None, v_scale=None):
        """Causal attention for a mixed prefill/decode batch over the paged KV cache.
        Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]); those are its last
        q_len tokens, so row i sits at position p = seq_lens[b] - (query_start_loc[b+1] - i).
        It attends keys j with max(0, p - sliding_window + 1) <= j <= p (sliding_window 0 = off);
        key j is at slot block_tables[b, j // BS] * BS + j % BS. Query head h reads KV head
        h // (Hq / Hkv). The new tokens' K/V must already be written (reshape_and_cache).
        out, q (T, Hq, D) f32; caches (NB, BS, Hkv, D) f32; block_tables (B, MB) int32;
        seq_lens (B,) int32; query_start_loc (B+1,) int32.
        FP8 cache: uint8 e4m3 caches with k_scale, v_scale (Hkv,) f32 (as reshape_and_cache);
        K/V of KV head h are read back as decode(code) * k_scale[h] (v_scale[h])."""
        raise NotImplementedError

    def argmax(self, logits, out):
        """out[b] = argmax(logits[b]), lowest index on ties.  logits (B, V) f32; out (B,) int64."""
        raise NotImplementedError

    def gumbel_sample(self, logits, seeds, positions, out):
        """Gumbel-max sampling with a counter-based RNG (DESIGN.md section 5).
        For row b and token v: (x0, x1, x2, x3) = Philox4x32-10(counter=(v, pos_lo, pos_hi, 0),
        key=(seed_lo, seed_hi)) with pos = positions[b], seed = seeds[b];
        u = (x0 + 0.5) / 2^32 (float64); out[b] = argmax_v(logits[b, v] + -log(-log(u))).
        Rows hold already-filtered, temperature-scaled logits; -inf never wins.
        logits (B, V) f32; seeds (B,) uint64; positions (B,) int64 (output position); out (B,) int64."""
        raise NotImplementedError

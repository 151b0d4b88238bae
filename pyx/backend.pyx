"""The op table every backend implements (DESIGN.md section 2).

Tensors are NumPy arrays on the CPU backend and CuPy arrays on the CUDA backend, C-contiguous.
The shapes and dtypes below are the CPU backend's: activations float32, weights float32,
bfloat16 (ml_dtypes.bfloat16) or float16 read in their stored dtype. The CUDA backend
(pyx/cuda_backend.pyx) takes activations and weight matrices in its `act_dtype` (bf16, f16 or
f32) and everything else as here. Every op writes into caller-given buffers (`out`, or in place where
said), allocates nothing on the hot path and returns None. A bad shape or dtype raises ValueError
naming the op and the shapes. No op silently falls back to another implementation.

Shapes: T tokens in the step, B sequences, H hidden size, D head dim, Hq/Hkv query/KV heads,
NB blocks, BS block size, MB max blocks per sequence, V vocabulary, N penalty entries.

Besides the ops, every backend has these members, so that code above it (layers, the sampler,
the MoE block) is written once and never probes for one with getattr:
  name       "cpu" or "cuda".
  kernels    the pyx.kernel_config.KernelConfig it was built with (EngineConfig.kernels).
  xp         the array module of its tensors: numpy (CPU) or cupy (CUDA).
  act_dtype  the activation dtype: numpy.float32 on the CPU.
  batch_invariant  every op computes a row in an order independent of the other rows (CPU
             only; always False on CUDA).
  fused_moe  MoE blocks built on it stack their experts for moe_align / moe_grouped_linear /
             moe_combine instead of one linear per expert (kernels moe=fused).
  moe_experts_op   MoE blocks not on the fused path stack their experts and run them with one
             moe_experts call per layer (CPU), instead of one linear per expert (CUDA).
  fused_sampling   the sampler calls sample_fused (CUDA, kernels sampling=fused; always False on
             the CPU, which has no sample_fused).
The weight formats `linear`, `embedding` and `place_weight` take besides float arrays are the
types of pyx/weights/ (ggml blocks, FP8, int4), recognised with isinstance.

The device half (memory_info and the graph ops) is CUDA's; the CPU backend raises
NotImplementedError for it, and the engine calls it on a CUDA backend only.
"""
import numpy as np

from pyx.kernel_config import KernelConfig


cdef str describe_arrays(dict arrays):
    """"name (shape) dtype" for each array (CPU or device), "name repr" for anything else: the
    bracketed part of every op's error message."""
    return ", ".join(f"{n} {tuple(a.shape)} {a.dtype}"
                     if hasattr(a, "shape") and hasattr(a, "dtype") else f"{n} {a!r}"
                     for n, a in arrays.items())


cdef fail(str op, str msg, dict arrays):
    """ValueError naming the op, the problem and the arguments."""
    raise ValueError(f"{op}: {msg} [{describe_arrays(arrays)}]")


cdef class Backend:
    moe_experts_op = False

    def __init__(self, name, kernels=None):
        """kernels: a KernelConfig, or what KernelConfig.parse takes (None: every default)."""
        self.name = name
        self.kernels = KernelConfig.parse(kernels, f"{type(self).__name__}(kernels=...)")
        self.batch_invariant = False
        self.fused_moe = self.kernels.moe == "fused"
        self.fused_sampling = False

    # ---- arrays and weights

    def asarray(self, a):
        """A host NumPy array as this backend's array: `a` itself on the CPU, a device copy on
        CUDA (small per-step arrays: token ids, sampling parameters, penalty entries)."""
        raise NotImplementedError

    def to_host(self, a):
        """This backend's array as a NumPy array: `a` itself on the CPU, a copy on CUDA (which
        waits for the work that writes it)."""
        raise NotImplementedError

    def place_weight(self, a, role=None):
        """A checkpoint tensor as the graph keeps it: as loaded on the CPU; on CUDA matrices in
        act_dtype and vectors in float32, on the device (a pyx/weights/ type in the device form
        its kernels read). role: what the matrix does in the graph, where a backend's numerics
        differ by it ("qkv": the attention's input projection, whose ggml blocks the CPU's
        default act_split=qkv multiplies with exact activations); None for any other tensor."""
        raise NotImplementedError

    def kv_cache_dtype(self, kind):
        """The KV cache element type for EngineConfig.kv_cache_dtype ("auto", "fp8": uint8 e4m3
        codes, ...); ValueError for one the backend lacks."""
        raise NotImplementedError

    def bind_thread(self):
        """Makes the backend usable from the calling thread (CUDA: its device and stream become
        current there); the engine calls it each step. Call it again after using another
        backend on the same thread: CuPy allocates, copies and frees on the current stream, so
        work of this backend queued while another one's stream is current races with its own
        kernels."""
        raise NotImplementedError

    def synchronize(self):
        """Waits for all queued work."""
        raise NotImplementedError

    def adapt_threads(self):
        """Called before each forward pass: a backend whose host threads share the machine's
        cores (the CPU's OpenMP team) resizes them to the cores other processes leave free. A
        device backend has nothing to resize."""

    # ---- the device half (CUDA): memory, CUDA graphs, async copies

    def memory_info(self):
        """(free, total) bytes of the device."""
        raise NotImplementedError(f"the {self.name} backend has no device memory")

    def new_graph_pool(self):
        """A private device memory pool for CUDA graphs' allocations, with total_bytes()."""
        raise NotImplementedError(f"the {self.name} backend has no CUDA graphs")

    def use_graph_pool(self, pool):
        """Context manager: device allocations inside come from `pool`."""
        raise NotImplementedError(f"the {self.name} backend has no CUDA graphs")

    def capture_graph(self, fn):
        """Calls fn() under stream capture and returns the graph (.launch() replays it)."""
        raise NotImplementedError(f"the {self.name} backend has no CUDA graphs")

    def pinned_empty(self, n, dtype):
        """A NumPy array of n elements in page-locked host memory."""
        raise NotImplementedError(f"the {self.name} backend has no pinned host memory")

    def copy_to_device_async(self, dst, src):
        """Enqueues a host-to-device copy of `src` into `dst` without synchronizing."""
        raise NotImplementedError(f"the {self.name} backend has no device memory")

    # ---- the ops

    def embedding(self, token_ids, table, out):
        """out[t] = table[token_ids[t]] as float32.
        token_ids (T,) int32; table (V, H) f32|bf16|f16; out (T, H) f32."""
        raise NotImplementedError

    def linear(self, x, weight, bias, out):
        """out = x @ weight.T (+ bias); float32 accumulation.
        x (T, K) f32; weight (N, K) f32|bf16|f16; bias (N,) f32 or None; out (T, N) f32."""
        raise NotImplementedError

    def lora_linear(self, x, lora_a, lora_b, ranks, parts, rows, seg_offsets, seg_slots, out):
        """Adds LoRA adapters' deltas to a linear's output, grouped by adapter (the segmented
        shrink and expand of punica's SGMV): segment g holds the rows
        rows[seg_offsets[g]:seg_offsets[g+1]], all of adapter slot s = seg_slots[g]. For each
        such row t and each part p of the output (columns c = [parts[p], parts[p+1]): q, k and v
        of a fused projection), with R = lora_a.shape[1] / P and r = ranks[s, p]:
            out[t, c] += (x[t] @ lora_a[s, p*R:p*R+r].T) @ lora_b[s, :r, c]
        accumulated in float32; the adapter's scaling is folded into lora_b. The parts stack
        their A rows (they read the same x) and share lora_b's rows (they write disjoint
        columns). Rows in no segment are left exactly as they were. Slots keep zeros wherever the
        formula reads nothing (rank rows past r), so a backend may multiply whole R-row blocks.
        x (T, K) f32; lora_a (S, P*R, K) f32|bf16; lora_b (S, R, N) of lora_a's dtype (CUDA: the
        activation dtype for both); out (T, N) f32, not overlapping x; ranks (S, P) int32 in
        [0, R]; parts (P+1,) int32 from 0 up to N; rows (L,) int32, distinct, in [0, T) (on the
        backend's device); seg_offsets (G+1,) int32 from 0 up to L; seg_slots (G,) int32 in
        [0, S). ranks, parts, seg_offsets and seg_slots are host (NumPy) arrays on every
        backend."""
        raise NotImplementedError

    def lora_linear_slots(self, x, lora_a, lora_b, parts, slot_of_row, out):
        """lora_linear with the rows' adapters given per row, as a CUDA graph reads them:
        slot_of_row (T,) int32 on the backend's device, row t of slot slot_of_row[t], -1 for a
        row of the base model (left exactly as it was); every part at the slots' full rank R
        (their zeros past each part's rank add nothing). Nothing about the rows reaches the
        host on CUDA (pyx/cuda_lora.pxi: kernels that read slot_of_row on the device), so a
        graph captured once serves any mix of adapters. This generic form, the CPU's, groups the
        rows by slot on the host and runs lora_linear."""
        slots = np.asarray(self.to_host(slot_of_row), np.int32)
        order = np.argsort(slots, kind="stable")
        order = order[slots[order] >= 0].astype(np.int32)
        sorted_slots = slots[order]
        seg_slots = np.unique(sorted_slots).astype(np.int32)
        seg_offsets = np.append(np.searchsorted(sorted_slots, seg_slots),
                                len(order)).astype(np.int32)
        P = parts.shape[0] - 1
        ranks = np.full((lora_a.shape[0], P), lora_a.shape[1] // P, np.int32)
        self.lora_linear(x, lora_a, lora_b, ranks, parts, self.asarray(order), seg_offsets,
                         seg_slots, out)

    def batched_linear(self, x, weight, out):
        """out[g] = x[g] @ weight[g].T for each of G groups; float32 accumulation (MLA's per-head
        absorbed projections). x (G, T, K) f32; weight (G, N, K) f32|bf16|f16; out (G, T, N) f32."""
        raise NotImplementedError

    def rms_norm(self, x, weight, eps, out):
        """out = x / sqrt(mean(x^2) + eps) * weight.  x, out (T, H) f32; weight (H,) f32."""
        raise NotImplementedError

    def fused_add_rms_norm(self, x, residual, weight, eps):
        """In place: residual += x; x = rms_norm(residual) * weight.  x, residual (T, H) f32."""
        raise NotImplementedError

    def layer_norm(self, x, weight, bias, eps, out):
        """out = (x - mean(x)) / sqrt(var(x) + eps) * weight (+ bias), var the biased variance
        (torch.nn.LayerNorm). x, out (T, H) f32; weight (H,) f32; bias (H,) f32 or None."""
        raise NotImplementedError

    def fused_add_layer_norm(self, x, residual, weight, bias, eps):
        """In place: residual += x; x = layer_norm(residual) (as fused_add_rms_norm)."""
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

    def gelu_tanh_and_mul(self, x, out):
        """out = gelu_tanh(x[:, :I]) * x[:, I:] (GeGLU, Gemma), with
        gelu_tanh(g) = 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3))).
        x (T, 2I) f32; out (T, I) f32."""
        raise NotImplementedError

    def clamped_swiglu(self, x, out, alpha, limit):
        """GPT-OSS's experts' activation, gate first as silu_and_mul: g = min(x[:, :I], limit),
        u = clip(x[:, I:], -limit, limit), out = (u + 1) * g * sigmoid(alpha * g), in float32.
        x (T, 2I) f32; out (T, I) f32; alpha finite, limit finite and > 0 (ValueError
        otherwise)."""
        raise NotImplementedError

    def gelu(self, x, out):
        """out = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2))), the exact GELU (torch.nn.GELU(),
        vision encoders' projectors). x, out (T, N) f32."""
        raise NotImplementedError(f"the {self.name} backend has no gelu op")

    def encoder_attention(self, out, q, k, v, cu_seqlens, scale):
        """Bidirectional attention over packed segments (a vision encoder's windows or whole
        images): rows [cu_seqlens[s], cu_seqlens[s+1]) attend to every row of their segment,
        out = softmax(scale * q.k) v per head, no cache, no mask. out, q, k, v (N, H, D) f32;
        cu_seqlens (S+1,) int32, from 0 to N, non-decreasing."""
        raise NotImplementedError(f"the {self.name} backend has no encoder_attention op")

    def stack_experts(self, weights):
        """E experts' weights of one projection, each (N, K) as place_weight returned it, as one
        moe_grouped_linear operand: a pyx.moe.StackedExperts of shape (E, N, K). CPU: the list
        (every format linear takes); CUDA: one stack of the activation dtype or of GGUF Q8_0
        blocks (other formats are a ValueError naming them)."""
        raise NotImplementedError

    def moe_align(self, topk_ids, num_experts, block_m, sorted_ids, block_expert, expert_offsets,
                  num_padded):
        """Top-k routing's P = T * top_k pairs (pair p = t * top_k + j) sorted by expert, each
        expert's run padded to a multiple of block_m (vLLM's moe_align_block_size):
        expert_offsets[e] = the padded start of expert e's run (expert_offsets[E] = the padded
        total = num_padded[0]); sorted_ids[expert_offsets[e] + i] = the i-th pair routed to e
        (pair order on the CPU, unspecified on CUDA), every other entry P; block_expert[b] = the
        expert of rows [b * block_m, (b + 1) * block_m) below the total, -1 above. Ids outside
        [0, E) are routed nowhere. topk_ids (T, top_k) int64; block_m 16 or 64; 1 <= E <= 4096;
        sorted_ids (C,), block_expert (C / block_m,), expert_offsets (E + 1,), num_padded (1,),
        all int32, C = pyx.moe.moe_align_capacity(P, E, block_m)."""
        raise NotImplementedError

    def moe_grouped_linear(self, x, weights, sorted_ids, block_expert, num_padded, x_div,
                           block_m, out):
        """out[p] = x[p // x_div] @ weights[e].T for every pair p that moe_align put in expert e's
        run (x_div = top_k: x holds the tokens; 1: x holds the pair rows); rows of unrouted pairs
        are left as they were. x (P / x_div, K) f32; weights a StackedExperts (E, N, K); out
        (P, N) f32; the moe_align outputs for the same P, E and block_m."""
        raise NotImplementedError

    def moe_combine(self, y, topk_weights, topk_ids, num_experts, out):
        """out[t] = sum over slots j, in order, of topk_weights[t, j] * y[t * top_k + j], in
        float32, skipping slots whose expert id lies outside [0, num_experts).
        y (T * top_k, H) f32; topk_weights (T, top_k) f32; topk_ids (T, top_k) int64;
        out (T, H) f32."""
        raise NotImplementedError

    def moe_experts(self, x, gate_up, down, topk_ids, topk_weights, activation, out):
        """A MoE layer's routed experts: out[t] = sum over slots j, in order, of
        topk_weights[t, j] * down[e] @ act(gate_up[e] @ x[t]) with e = topk_ids[t, j] and
        act(g) = f(g[:I]) * g[I:], f silu ("silu") or gelu_tanh ("gelu_tanh"); slots whose id
        lies outside [0, E) add nothing. Each expert's matmuls are `linear` on its pairs' tokens
        in pair order, so the numbers are those of one linear per expert. x (T, H) f32;
        gate_up, down stack_experts' stacks (E, 2I, H) and (E, H, I); topk_ids (T, top_k)
        int64; topk_weights (T, top_k) f32; out (T, H) f32. The backends with moe_experts_op."""
        raise NotImplementedError(f"the {self.name} backend has no moe_experts op")

    def softcap(self, x, cap):
        """In place x = cap * tanh(x / cap) (Gemma-2 soft-capping of final logits).
        x (T, N) f32; cap a float > 0 (ValueError otherwise)."""
        raise NotImplementedError

    def scale(self, x, s):
        """In place x = x * s in x's dtype (Gemma's embedding times sqrt(hidden)); the caller
        rounds s to that dtype first, as transformers does. x (T, H) f32; s a finite float
        (ValueError otherwise)."""
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
                        scale, sliding_window, k_scale=None, v_scale=None, softcap=0.0,
                        sinks=None, attention_chunk=0):
        """Causal attention for a mixed prefill/decode batch over the paged KV cache.
        Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]); those are its last
        q_len tokens, so row i sits at position p = seq_lens[b] - (query_start_loc[b+1] - i).
        It attends keys j with max(0, p - sliding_window + 1) <= j <= p (sliding_window 0 = off);
        key j is at slot block_tables[b, j // BS] * BS + j % BS. Query head h reads KV head
        h // (Hq / Hkv). The new tokens' K/V must already be written (reshape_and_cache).
        out, q (T, Hq, D) f32; caches (NB, BS, Hkv, D) f32; block_tables (B, MB) int32;
        seq_lens (B,) int32; query_start_loc (B+1,) int32.
        FP8 cache: uint8 e4m3 caches with k_scale, v_scale (Hkv,) f32 (as reshape_and_cache);
        K/V of KV head h are read back as decode(code) * k_scale[h] (v_scale[h]).
        softcap > 0 (Gemma-2): each scaled score s = scale * q.k becomes softcap * tanh(s / softcap)
        before the causal mask and the softmax; 0 = off, and then the results are bit-identical
        to the op without the option. A negative or non-finite softcap is a ValueError.
        sinks (Hq,) f32 (GPT-OSS's attention sinks): query head h's softmax takes one more
        logit, sinks[h], with no value, so each row's weights are
        exp(s_j) / (sum_j exp(s_j) + exp(sinks[h])); None = off.
        attention_chunk > 0 (Llama 4's chunked attention): row i at position p also attends no
        key j < p // attention_chunk * attention_chunk; 0 = off. The CPU backend needs it to be
        a multiple of BS (pyx/chunked_attention.py). A negative or non-integer value is a
        ValueError. Backends other than these two may lack sinks and attention_chunk: callers
        pass them only when set."""
        raise NotImplementedError

    def mla_decode_attention(self, out, q, cache, block_tables, seq_lens, scale):
        """Decode attention over multi-head latent attention's cache (DeepSeek's absorbed
        form): one query row per sequence, its last token, and every query head reads the one
        cached head: scores scale * q.row over the sequence's seq_lens[b] rows, softmax, and the
        weighted sum of each row's first Dv values. Rows are paged as paged_attention's.
        out (B, Hq, Dv) f32; q (B, Hq, D) f32; cache (NB, BS, 1, D) f32 with Dv <= D;
        block_tables (B, MB) int32; seq_lens (B,) int32, each >= 1."""
        raise NotImplementedError

    def argmax(self, logits, out):
        """out[b] = argmax(logits[b]), lowest index on ties.  logits (B, V) f32; out (B,) int64."""
        raise NotImplementedError

    def apply_penalties(self, logits, rows, cols, bias, rep, pres_freq):
        """In place, for each of N distinct (row, col) = (rows[n], cols[n]) entries, in float32:
            x = logits[row, col] + bias[n]
            x = x / rep[n] if x > 0 else x * rep[n]      (skipped where rep[n] == 1)
            x = x - pres_freq[n]
            logits[row, col] = x
        This is vLLM's order (logit_bias, min_tokens mask, repetition, presence/frequency) with the
        sampler's per-token terms merged into one entry: bias = the logit_bias sum, -inf for a
        token min_tokens forbids, -0.0 for none (x + -0.0 == x exactly); rep = the repetition
        penalty of a token in the prompt or the output, else 1; pres_freq = presence +
        frequency * count over the output, else 0.
        logits (B, V) f32; rows, cols (N,) int32; bias, rep, pres_freq (N,) f32. Entries must lie
        inside (B, V) and be distinct; the CPU backend checks both (ValueError)."""
        raise NotImplementedError

    def filter_logits(self, logits, temperature, top_k, top_p, min_p):
        """In place, per row b, on the penalised logits of a sampled (non-greedy) row:
        1. temperature: x /= max(temperature[b], 1e-5) where temperature[b] != 1.
        2. A threshold, the largest of those that apply (-inf when none):
           top_k[b] in (0, V): the k-th largest value (ties with it are kept);
           top_p[b] < 1: the value of the last token of the smallest most-likely set of tokens
             whose probability mass reaches top_p[b] of the mass of the top-k survivors (all
             tokens without top-k); at least one token is always kept;
           min_p[b] > 0: max(x) + log(min_p[b])  (prob < min_p * max prob).
        3. Every x < threshold becomes -inf (one pass); kept values are left exactly as scaled.
        logits (B, V) f32; temperature (B,) f32; top_k (B,) int32 (0 = off); top_p (B,) f32 in
        (0, 1] (1 = off); min_p (B,) f32 in [0, 1] (0 = off)."""
        raise NotImplementedError

    def apply_token_bitmask(self, logits, bitmask, rows):
        """In place, structured outputs: for each row b in rows, logits[b, v] = -inf wherever bit
        v % 32 of bitmask[b, v // 32] is 0 (bits are allowed tokens; llguidance's layout). Rows
        not listed and allowed tokens are left exactly as they were.
        logits (B, V) f32; bitmask (B, ceil(V/32)) int32; rows (R,) int32, each in [0, B)
        (ValueError otherwise)."""
        raise NotImplementedError

    def gumbel_sample(self, logits, seeds, positions, out):
        """Gumbel-max sampling with a counter-based RNG (DESIGN.md section 5).
        For row b and token v: (x0, x1, x2, x3) = Philox4x32-10(counter=(v, pos_lo, pos_hi, 0),
        key=(seed_lo, seed_hi)) with pos = positions[b], seed = seeds[b];
        u = (x0 + 0.5) / 2^32 (float64); out[b] = argmax_v(logits[b, v] + -log(-log(u))).
        Rows hold already-filtered, temperature-scaled logits; -inf never wins.
        logits (B, V) f32; seeds (B,) uint64; positions (B,) int64 (output position); out (B,) int64."""
        raise NotImplementedError

    def sample_fused(self, logits, greedy, temperature, top_k, top_p, min_p, seeds, positions,
                     out, penalties=None):
        """The sampler's whole step in one launch, where `fused_sampling` is on (CUDA): the
        penalties (rows, cols, bias, rep, pres_freq as apply_penalties, rows ascending) applied
        to logits in place, then per row the argmax where greedy[b], else gumbel_sample after
        filter_logits' temperature and thresholds (not written back).
        logits (B, V) f32; greedy (B,) uint8; temperature, top_p, min_p (B,) f32; top_k (B,)
        int32; seeds (B,) uint64; positions (B,) int64; out (B,) int64."""
        raise NotImplementedError(f"the {self.name} backend has no fused sampler")

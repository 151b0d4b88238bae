# cython: language_level=3
"""Per-layer code of the Llama-family graph, written once against the op table (backend.pyx).

No device code here: every bit of math is a backend op, and the only array calls are the NumPy /
CuPy API the two share (slices, reshape, copyto), taken from `backend.xp` (NumPy when absent).
Activations (backend.act_dtype) live in a Workspace whose buffers are shared by all layers and grow on demand, so a
step allocates nothing once warmed up at its largest token count.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head dim, I intermediate size.
"""
import numpy as np


cdef class Workspace:
    """Named scratch buffers (rows, cols) of the activation dtype (float32 on the CPU, bf16/f16 on
    CUDA); a view of the first `rows` rows is handed out."""
    cdef object xp, dtype
    cdef dict buffers

    def __init__(self, xp, dtype=np.float32):
        self.xp = xp
        self.dtype = dtype
        self.buffers = {}

    cpdef object get(self, str name, Py_ssize_t rows, Py_ssize_t cols):
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols:
            capacity = rows if buf is None else max(rows, buf.shape[0])
            buf = self.xp.empty((max(capacity, 1), cols), dtype=self.dtype)
            self.buffers[name] = buf
        return buf[:rows]


cdef class Attention:
    """Fused qkv projection, optional per-head q/k RMSNorm (one weight for all heads) or
    LayerNorm (StableLM: one weight per head, no bias), RoPE, KV cache write, paged attention
    (optionally soft-capped), output projection."""
    cdef object backend, xp
    cdef object qkv_weight, qkv_bias, o_weight, o_bias, q_norm, k_norm, cos_sin_cache
    cdef readonly object k_scale, v_scale, sinks
    # LoRA adapters' deltas on the qkv and output projections: None, or an object whose
    # add(x, out) adds them to the projection's output (engine/lora/slots.py)
    cdef public object lora_qkv, lora_o
    # None, or an object whose apply(batch, q, attn, k_cache, v_cache, scale, sliding_window,
    # softcap) rewrites rows of the attention output after the causal paged attention: a mask
    # the op has not (Gemma 3's bidirectional image tokens, engine/vision/gemma3_attention.py)
    cdef public object mask_overlay
    cdef readonly int num_heads, num_kv_heads, head_dim, sliding_window
    cdef int q_size, kv_size
    cdef double scale, eps, softcap
    cdef bint is_neox, qk_layernorm

    def __init__(self, backend, qkv_weight, qkv_bias, o_weight, o_bias, q_norm, k_norm,
                 cos_sin_cache, int num_heads, int num_kv_heads, int head_dim, double eps,
                 int sliding_window, bint is_neox=True, k_scale=None, v_scale=None,
                 scale=None, double softcap=0.0, bint qk_layernorm=False, sinks=None):
        """k_scale, v_scale (Hkv,) f32: the FP8 KV cache's per-head scales, passed to the cache ops
        when the caches are FP8 (uint8); None: 1.0. scale: the attention scores' multiplier
        (None: head_dim ** -0.5); softcap > 0 caps the scaled scores (Gemma-2). qk_layernorm:
        q_norm and k_norm are lists of per-head (D,) LayerNorm weights, not one RMSNorm weight.
        sinks (Hq,) f32: GPT-OSS's attention sinks, a logit per head in every row's softmax
        (paged_attention's sinks; on CUDA the masked kernel); None: none."""
        self.backend = backend
        self.xp = backend.xp
        self.qkv_weight, self.qkv_bias = qkv_weight, qkv_bias
        self.o_weight, self.o_bias = o_weight, o_bias
        self.q_norm, self.k_norm = q_norm, k_norm
        self.cos_sin_cache = cos_sin_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        self.eps = eps
        self.sliding_window = sliding_window
        self.is_neox = is_neox
        self.qk_layernorm = qk_layernorm
        self.sinks = sinks
        ones = np.ones(num_kv_heads, np.float32)
        self.k_scale = ones if k_scale is None else k_scale
        self.v_scale = ones if v_scale is None else v_scale

    def forward(self, batch, x, out, k_cache, v_cache, Workspace ws):
        """x (T, H) -> out (T, H)."""
        cdef Py_ssize_t T = x.shape[0]
        cdef int qs = self.q_size, kvs = self.kv_size, D = self.head_dim
        b, xp = self.backend, self.xp
        qkv = ws.get("qkv", T, qs + 2 * kvs)
        b.linear(x, self.qkv_weight, self.qkv_bias, qkv)
        if self.lora_qkv is not None:
            self.lora_qkv.add(x, qkv)
        q = ws.get("q", T, qs)
        k = ws.get("k", T, kvs)
        v = ws.get("v", T, kvs)
        # The ops take C-contiguous tensors, so the fused output is split by copies (cheap next to
        # the GEMM that made it).
        if self.q_norm is not None:
            raw_q = ws.get("raw_q", T, qs)
            raw_k = ws.get("raw_k", T, kvs)
            xp.copyto(raw_q, qkv[:, :qs])
            xp.copyto(raw_k, qkv[:, qs:qs + kvs])
            if self.qk_layernorm:
                self._per_head_layer_norm(raw_q, q, self.q_norm, self.num_heads, ws, "q")
                self._per_head_layer_norm(raw_k, k, self.k_norm, self.num_kv_heads, ws, "k")
            else:
                b.rms_norm(raw_q.reshape(T * self.num_heads, D), self.q_norm, self.eps,
                           q.reshape(T * self.num_heads, D))
                b.rms_norm(raw_k.reshape(T * self.num_kv_heads, D), self.k_norm, self.eps,
                           k.reshape(T * self.num_kv_heads, D))
        else:
            xp.copyto(q, qkv[:, :qs])
            xp.copyto(k, qkv[:, qs:qs + kvs])
        xp.copyto(v, qkv[:, qs + kvs:])
        b.rotary_embedding(batch.positions, q, k, self.cos_sin_cache, D, self.is_neox)
        k3 = k.reshape(T, self.num_kv_heads, D)
        v3 = v.reshape(T, self.num_kv_heads, D)
        attn = ws.get("attn", T, qs)
        if k_cache.dtype.itemsize == 1:  # FP8 cache: codes with per-head scales
            b.reshape_and_cache(k3, v3, k_cache, v_cache, batch.slot_mapping, self.k_scale,
                                self.v_scale)
            b.paged_attention(attn.reshape(T, self.num_heads, D), q.reshape(T, self.num_heads, D),
                              k_cache, v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, self.scale, self.sliding_window,
                              self.k_scale, self.v_scale, **self._attention_options())
        else:
            b.reshape_and_cache(k3, v3, k_cache, v_cache, batch.slot_mapping)
            b.paged_attention(attn.reshape(T, self.num_heads, D), q.reshape(T, self.num_heads, D),
                              k_cache, v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, self.scale, self.sliding_window,
                              **self._attention_options())
        if self.mask_overlay is not None:
            self.mask_overlay.apply(batch, q, attn, k_cache, v_cache, self.scale,
                                    self.sliding_window, self.softcap)
        b.linear(attn, self.o_weight, self.o_bias, out)
        if self.lora_o is not None:
            self.lora_o.add(attn, out)

    def _attention_options(self):
        # sinks only when set: a backend without them keeps its signature for every other model
        if self.sinks is None:
            return {"softcap": self.softcap}
        return {"softcap": self.softcap, "sinks": self.sinks}

    def _per_head_layer_norm(self, x, out, norms, int heads, Workspace ws, str name):
        """out (T, heads*D) = each head of x LayerNormed with its own weight: the layer_norm op
        once per head on a head-major copy, whose per-head (T, D) slices are contiguous."""
        cdef Py_ssize_t T = x.shape[0]
        cdef int D = self.head_dim, h
        xh = ws.get(name + "_heads", heads * T, D).reshape(heads, T, D)
        yh = ws.get(name + "_heads_out", heads * T, D).reshape(heads, T, D)
        self.xp.copyto(xh, x.reshape(T, heads, D).transpose(1, 0, 2))
        for h in range(heads):
            self.backend.layer_norm(xh[h], norms[h], None, self.eps, yh[h])
        self.xp.copyto(out.reshape(T, heads, D), yh.transpose(1, 0, 2))


cdef class MLP:
    """Gated MLP: down(act(gate(x)) * up(x)) with gate and up fused into one (2I, H) matrix;
    act "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    cdef object backend, gate_up_weight, gate_up_bias, down_weight, down_bias, act_and_mul
    cdef int intermediate_size
    cdef public object lora_gate_up, lora_down    # as Attention's lora_qkv

    def __init__(self, backend, gate_up_weight, gate_up_bias, down_weight, down_bias,
                 str act="silu"):
        self.backend = backend
        self.gate_up_weight, self.gate_up_bias = gate_up_weight, gate_up_bias
        self.down_weight, self.down_bias = down_weight, down_bias
        self.intermediate_size = gate_up_weight.shape[0] // 2
        if act == "silu":
            self.act_and_mul = backend.silu_and_mul
        elif act == "gelu_tanh":
            self.act_and_mul = backend.gelu_tanh_and_mul
        else:
            raise ValueError(f"MLP: unknown activation {act!r}, expected silu or gelu_tanh")

    def forward(self, x, out, Workspace ws):
        """x (T, H) -> out (T, H)."""
        cdef Py_ssize_t T = x.shape[0]
        b = self.backend
        gate_up = ws.get("gate_up", T, 2 * self.intermediate_size)
        b.linear(x, self.gate_up_weight, self.gate_up_bias, gate_up)
        if self.lora_gate_up is not None:
            self.lora_gate_up.add(x, gate_up)
        act = ws.get("act", T, self.intermediate_size)
        self.act_and_mul(gate_up, act)
        b.linear(act, self.down_weight, self.down_bias, out)
        if self.lora_down is not None:
            self.lora_down.add(act, out)


cdef class DecoderLayer:
    """Pre-norm block. Residual convention (vLLM's): `hidden` enters holding the previous block's
    MLP output (or nothing, for the first layer) and leaves holding this block's MLP output;
    `residual` holds the running sum of everything before."""
    cdef object backend, input_norm, post_norm
    # an Attention, or any block with forward(batch, x, out, k_cache, v_cache, ws) (pyx/mla.py)
    cdef readonly object attention
    cdef readonly object mlp          # an MLP, or any block with forward(x, out, ws) (pyx/moe.py)
    cdef double eps
    cdef bint first

    def __init__(self, backend, attention, mlp, input_norm, post_norm, double eps,
                 bint first):
        self.backend = backend
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        self.eps = eps
        self.first = first

    cdef norm_input(self, hidden, residual):
        """hidden = input_norm(residual), residual += hidden first after the first layer."""
        if self.first:
            self.backend.rms_norm(residual, self.input_norm, self.eps, hidden)
        else:
            self.backend.fused_add_rms_norm(hidden, residual, self.input_norm, self.eps)

    cdef attend(self, batch, hidden, residual, k_cache, v_cache, Workspace ws):
        """The input norm, then attention into the workspace's attn_out, which it returns."""
        self.norm_input(hidden, residual)
        attn_out = ws.get("attn_out", hidden.shape[0], hidden.shape[1])
        self.attention.forward(batch, hidden, attn_out, k_cache, v_cache, ws)
        return attn_out

    def forward(self, batch, hidden, residual, k_cache, v_cache, Workspace ws):
        attn_out = self.attend(batch, hidden, residual, k_cache, v_cache, ws)
        self.backend.fused_add_rms_norm(attn_out, residual, self.post_norm, self.eps)
        self.mlp.forward(attn_out, hidden, ws)


cdef class SandwichDecoderLayer(DecoderLayer):
    """Pre- and post-norms around both blocks (Gemma-2/3; GLM-4's post norms too):
    h += post_attn_norm(attn(input_norm(h))); h += post_mlp_norm(mlp(pre_mlp_norm(h))).
    Same residual convention as DecoderLayer: `hidden` leaves holding the post-normed MLP output
    that the next layer's fused add folds into `residual`."""
    cdef object post_attn_norm, pre_mlp_norm, post_mlp_norm

    def __init__(self, backend, attention, mlp, input_norm, post_attn_norm,
                 pre_mlp_norm, post_mlp_norm, double eps, bint first):
        DecoderLayer.__init__(self, backend, attention, mlp, input_norm, pre_mlp_norm, eps, first)
        self.post_attn_norm, self.pre_mlp_norm = post_attn_norm, pre_mlp_norm
        self.post_mlp_norm = post_mlp_norm

    def forward(self, batch, hidden, residual, k_cache, v_cache, Workspace ws):
        b = self.backend
        block_out = self.attend(batch, hidden, residual, k_cache, v_cache, ws)
        b.rms_norm(block_out, self.post_attn_norm, self.eps, hidden)
        b.fused_add_rms_norm(hidden, residual, self.pre_mlp_norm, self.eps)
        self.mlp.forward(hidden, block_out, ws)
        b.rms_norm(block_out, self.post_mlp_norm, self.eps, hidden)


cdef class LayerNormDecoderLayer(DecoderLayer):
    """DecoderLayer with LayerNorm (weight and bias, StableLM) instead of RMSNorm. parallel
    (GPT-NeoX's parallel residual): attention and MLP both read input_norm(h), h += attn + mlp."""
    cdef object input_bias, post_bias
    cdef bint parallel

    def __init__(self, backend, attention, mlp, input_norm, input_bias, post_norm,
                 post_bias, double eps, bint first, bint parallel):
        DecoderLayer.__init__(self, backend, attention, mlp, input_norm, post_norm, eps, first)
        self.input_bias, self.post_bias = input_bias, post_bias
        self.parallel = parallel

    cdef norm_input(self, hidden, residual):
        if self.first:
            self.backend.layer_norm(residual, self.input_norm, self.input_bias, self.eps, hidden)
        else:
            self.backend.fused_add_layer_norm(hidden, residual, self.input_norm, self.input_bias,
                                              self.eps)

    def forward(self, batch, hidden, residual, k_cache, v_cache, Workspace ws):
        b = self.backend
        attn_out = self.attend(batch, hidden, residual, k_cache, v_cache, ws)
        if self.parallel:
            # The MLP reads `hidden` only in its first GEMM, so it may write its output there.
            self.mlp.forward(hidden, hidden, ws)
            # residual += attn_out through the fused op, whose normalized output (left in
            # attn_out) is unused: the op table has no plain add, and this is one pass over (T, H).
            b.fused_add_layer_norm(attn_out, residual, self.input_norm, self.input_bias, self.eps)
        else:
            b.fused_add_layer_norm(attn_out, residual, self.post_norm, self.post_bias, self.eps)
            self.mlp.forward(attn_out, hidden, ws)


def run_layers(list layers, batch, hidden, residual, list kv_caches, Workspace ws):
    """Every decoder layer in order; one Python-visible call per step for the whole stack."""
    cdef Py_ssize_t i
    cdef DecoderLayer layer
    for i in range(len(layers)):
        layer = layers[i]
        k_cache, v_cache = kv_caches[i]
        layer.forward(batch, hidden, residual, k_cache, v_cache, ws)

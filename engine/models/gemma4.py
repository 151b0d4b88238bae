"""Gemma 4 text (Gemma4ForCausalLM): Gemma-3's layout (engine/models/gemma.py: sandwich norms,
GeGLU, the embedding scaled by sqrt(hidden), sliding layers beside full ones, the final logit
soft-cap) with

- RMSNorms that multiply by w, not 1 + w;
- per-head RMSNorm on q and k (weights) and on v (none), attention scores not scaled (1.0);
- the full-attention layers' own head size and KV heads (global_head_dim,
  num_global_key_value_heads), their values equal to their keys before the norms when
  attention_k_eq_v (no v_proj), and their proportional RoPE: the first partial_rotary_factor of
  each head's rotate-half pairs turn at frequencies theta ** (-2j / head_dim), the others not;
- layer_scalar: each layer's output stream multiplied by a scalar of its own;
- with enable_moe_block (26B-A4B), a mixture of experts beside every layer's dense MLP
  (Gemma4FeedForward): both read the stream after attention, each through its own pre-norm, each
  output post-normed, their sum post-normed again (post_feedforward_layernorm). The router
  normalizes the stream (no weight), scales it by scale / sqrt(hidden), takes the softmax top-k
  renormalized, then multiplies each chosen expert's weight by its per_expert_scale; the experts
  are GeGLU, stored stacked (experts.gate_up_proj (E, 2I, H), gate rows first; down_proj).

The per-layer settings are engine/models/family_config.py's Gemma4Settings. Every layer's KV
cache has the wider layer kind's shape; a narrower layer uses the front of that buffer reshaped
to its own (NB, BS, Hkv, D), contiguous, so the pool's blocks mean the same in every layer.

The E2B/E4B models add

- per-layer input embeddings (engine/models/gemma4_per_layer.py): a vector per token and layer,
  computed once per step, gated into the stream after each layer's MLP;
- KV sharing (num_kv_shared_layers): the last layers have no K/V projections and no cache of
  their own; each attends with its own queries over the cache of the last layer of its kind
  before them (kv_sources), which that layer wrote earlier in the same step. The pool allocates
  caches for the other layers only (ModelConfig.num_kv_layers, so the bytes per token shrink);
  the list of caches the graph runs over names the source's cache for a shared layer, so prefix
  caching, chunked prefill and preemption see the blocks every layer reads. Writing no cache,
  the shared layers run only on the rows whose outputs are read (Gemma4ForCausalLM.forward).
  Under use_double_wide_mlp their MLPs are twice as wide.

Gemma 4 as released (Gemma4ForConditionalGeneration: the text model's tensors under
model.language_model., beside vision and audio towers) is served for its text, the towers not
loaded. Across processes: engine/parallel/sharding_gemma4.py (tensor and expert parallel) and
stages_gemma4.py (pipeline stages). On CUDA the full layers' wider heads (512 in the released
models) take the masked attention kernel (pyx/attention_dispatch.py: the tuned ones stop at 256).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from engine.models.composed_attention import ComposedAttention, rms_norm_in_place
from engine.models.gemma import Gemma2ForCausalLM
from engine.models.gemma4_per_layer import PerLayerInputGate, PerLayerInputs
from engine.models.model_config import ModelConfig
from engine.models.moe import held_experts
from engine.models.rotary import _cos_sin
from engine.parallel import layers as tensor_parallel, stages_gemma4
from pyx.layers import SandwichDecoderLayer, run_layers
from pyx.moe import MoE

logger = logging.getLogger("taper.models")

_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
           "model.embed_audio.")


def _language_model_only(weights: dict) -> None:
    """In place: a multimodal checkpoint's language model under the causal LM's names, its
    vision and audio towers dropped."""
    prefix, dropped = "model.language_model.", 0
    for name in list(weights):
        if name.startswith(prefix):
            weights["model." + name[len(prefix):]] = weights.pop(name)
        elif name.startswith(_TOWERS):
            del weights[name]
            dropped += 1
    if dropped:
        logger.info("not loaded: %d vision and audio tower tensors", dropped)


def _layer_dims(c: ModelConfig, i: int) -> tuple[int, int]:
    """(KV heads, head size) of layer i."""
    s = c.family
    return (s.full_kv_heads, s.full_head_dim) if s.full_layers[i] else (c.num_key_value_heads,
                                                                        c.head_dim)


def gemma4_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = Gemma2ForCausalLM.expected_shapes(c)
    s, H, Hq, L = c.family, c.hidden_size, c.num_attention_heads, c.num_hidden_layers
    P = s.per_layer_input_size
    if P:       # (under tensor parallel: the rank's rows, gemma4_per_layer.py)
        ranks = 1 if c.tensor_parallel is None else c.tensor_parallel.size
        shapes.update({"model.embed_tokens_per_layer.weight": (s.per_layer_vocab_size, L * P),
                       "model.per_layer_model_projection.weight": (L * P // ranks, H),
                       "model.per_layer_projection_norm.weight": (P,)})
    for i in range(L):
        p = f"model.layers.{i}."
        kv_heads, D = _layer_dims(c, i)
        a = f"{p}self_attn."
        shapes.update({f"{a}q_proj.weight": (Hq * D, H), f"{a}k_proj.weight": (kv_heads * D, H),
                       f"{a}v_proj.weight": (kv_heads * D, H), f"{a}o_proj.weight": (H, Hq * D),
                       f"{a}q_norm.weight": (D,), f"{a}k_norm.weight": (D,),
                       f"{p}layer_scalar": (1,)})
        if s.kv_shared[i]:      # no K/V projections of its own
            for name in ("k_proj", "v_proj", "k_norm"):
                del shapes[f"{a}{name}.weight"]
            if s.double_wide_mlp:
                I2 = 2 * c.intermediate_size
                shapes.update({f"{p}mlp.gate_proj.weight": (I2, H),
                               f"{p}mlp.up_proj.weight": (I2, H),
                               f"{p}mlp.down_proj.weight": (H, I2)})
        elif s.full_layers[i] and s.k_eq_v:
            del shapes[f"{a}v_proj.weight"]
        if P:
            shapes.update({f"{p}per_layer_input_gate.weight": (P, H),
                           f"{p}per_layer_projection.weight": (H, P),
                           f"{p}post_per_layer_input_norm.weight": (H,)})
        if c.moe is not None:       # (under expert parallel: the rank's experts)
            E, I, held = c.moe.num_experts, c.moe.intermediate_size, len(held_experts(c))
            shapes.update({f"{p}router.proj.weight": (E, H), f"{p}router.scale": (H,),
                           f"{p}router.per_expert_scale": (E,),
                           f"{p}experts.gate_up_proj": (held, 2 * I, H),
                           f"{p}experts.down_proj": (held, H, I)})
            for norm in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                         "post_feedforward_layernorm_2"):
                shapes[f"{p}{norm}.weight"] = (H,)
    return shapes


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    norm_offset = 0.0
    expected_shapes = staticmethod(gemma4_shapes)

    def __init__(self, config: ModelConfig, weights: dict, backend):
        s = config.family
        _language_model_only(weights)
        if config.pipeline is not None and s.per_layer_input_size:
            stages_gemma4.take_per_layer_inputs(
                weights, config.pipeline, s,
                1 if config.tensor_parallel is None else config.tensor_parallel.size)
        for i, shared in enumerate(s.kv_shared):
            for name in ("k_proj", "v_proj", "k_norm"):     # unused where a checkpoint has them
                if shared:
                    weights.pop(f"model.layers.{i}.self_attn.{name}.weight", None)
        self.per_layer_inputs = None
        # proportional RoPE over the full layers' whole head (rotate-half pairs j, j + D/2)
        D = s.full_head_dim
        angles = int(s.full_rotary_factor * D // 2)
        inv_freq = np.zeros(D // 2)
        inv_freq[:angles] = 1.0 / s.full_theta ** (np.arange(0, 2 * angles, 2) / D)
        self._full_cache = backend.asarray(_cos_sin(inv_freq / s.full_rope_factor, 1.0,
                                                    config.max_model_len))
        super().__init__(config, weights, backend)
        shared = [i for i, x in enumerate(s.kv_shared) if x]
        if shared:
            c, per_layer = config, config.kv_cache_elements_per_token
            logger.info("KV sharing: layers %d-%d read the caches of layers %s; the pool holds "
                        "%d of %d layers' caches: %d cached values per token instead of %d",
                        shared[0], shared[-1], sorted({s.kv_sources[i] for i in shared}),
                        c.num_kv_layers, c.num_hidden_layers, per_layer * c.num_kv_layers,
                        per_layer * c.num_hidden_layers)

    def _take_ends(self, weights):
        inputs, c = self.per_layer_inputs, self.config
        if inputs is not None:
            name = "model.embed_tokens_per_layer.weight"
            if c.tensor_parallel is not None:       # vocab-parallel, as the embedding
                weights[name] = tensor_parallel.with_zero_row(weights[name])
            inputs.table = self._take(weights, name)
        super()._take_ends(weights)
        if inputs is not None:
            inputs.embed = lambda ids, out: tensor_parallel.embed(self.backend, c, ids,
                                                                  self.embed_tokens, out)

    def _per_layer_inputs(self, weights) -> PerLayerInputs:
        """The step's per-layer inputs, made with the first layer (their table and the input
        embedding are filled in by _take_ends, after the layers)."""
        c = self.config
        return PerLayerInputs(
            self.backend, self.embed_scale, None,
            self._take(weights, "model.per_layer_model_projection.weight"),
            self._norm(weights, "model.per_layer_projection_norm.weight"), c.num_hidden_layers,
            c.family.per_layer_input_size, c.hidden_size, c.rms_norm_eps, c.tensor_parallel,
            c.family.per_layer_vocab_size)

    def _attention(self, weights, p, i):
        c, s = self.config, self.config.family
        kv_heads, D = _layer_dims(c, i)
        a = f"{p}self_attn."
        if s.kv_shared[i]:
            return tensor_parallel.all_reduced_attention(Gemma4SharedKVAttention(
                self.backend, self._take(weights, f"{a}q_proj.weight"),
                self._take(weights, f"{a}o_proj.weight"),
                self._full_cache if s.full_layers[i] else self.cos_sin_cache,
                c.num_attention_heads, kv_heads, D, c.rms_norm_eps, True, 1.0,
                q_norm=self._norm(weights, f"{a}q_norm.weight"),
                sliding_window=c.sliding_windows[i]), c)
        k_eq_v = s.full_layers[i] and s.k_eq_v
        names = [f"{a}q_proj.weight", f"{a}k_proj.weight"] + ([] if k_eq_v else
                                                               [f"{a}v_proj.weight"])
        return tensor_parallel.all_reduced_attention(Gemma4Attention(
            self.backend, self._fuse(weights, names, role="qkv"),
            self._take(weights, f"{a}o_proj.weight"),
            self._full_cache if s.full_layers[i] else self.cos_sin_cache,
            c.num_attention_heads, kv_heads, D, c.rms_norm_eps, True, 1.0,
            q_norm=self._norm(weights, f"{a}q_norm.weight"),
            k_norm=self._norm(weights, f"{a}k_norm.weight"),
            v_norm=self.backend.place_weight(np.ones(D, np.float32)), k_eq_v=k_eq_v,
            sliding_window=c.sliding_windows[i]), c)

    def _mlp(self, weights, p, i):
        if self.config.moe is None:
            return super()._mlp(weights, p, i)
        c, m, b = self.config, self.config.moe, self.backend

        def f32(name):
            return np.asarray(weights.pop(name), dtype=np.float32)
        gate_up = weights.pop(f"{p}experts.gate_up_proj")        # (E, 2I, H), gate rows first
        down = weights.pop(f"{p}experts.down_proj")              # (E, H, I)
        router_scale = f32(f"{p}router.scale") * np.float32(c.hidden_size ** -0.5)
        experts = MoE(b, self._take(weights, f"{p}router.proj.weight"),
                      [b.place_weight(np.ascontiguousarray(w)) for w in gate_up],
                      [b.place_weight(np.ascontiguousarray(w)) for w in down], m.top_k,
                      m.normalize, fused=b.fused_moe, activation="gelu_tanh",
                      expert_scale=b.asarray(f32(f"{p}router.per_expert_scale")),
                      first_expert=held_experts(c).start, num_experts=m.num_experts)
        # (under tensor parallel each branch is all-reduced before its post-norm: the dense
        # MLP's partial sums, and the experts' sums over the rank's slice of each expert or,
        # under expert parallel, over its whole experts)
        return Gemma4FeedForward(
            b, tensor_parallel.all_reduced(super()._mlp(weights, p, i), c), experts,
            self._norm(weights, f"{p}pre_feedforward_layernorm.weight"),
            self._norm(weights, f"{p}pre_feedforward_layernorm_2.weight"),
            b.place_weight(router_scale),
            self._norm(weights, f"{p}post_feedforward_layernorm_1.weight"),
            self._norm(weights, f"{p}post_feedforward_layernorm_2.weight"), c.rms_norm_eps,
            None if c.tensor_parallel is None else c.tensor_parallel.comm)

    def _layer(self, weights, p, i, attn, mlp):
        names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        if self.config.moe is not None:     # Gemma4FeedForward took it; it reads the unit norm
            names[2] = None
        ones = self.backend.place_weight(np.ones(self.config.hidden_size, np.float32))
        norms = [ones if n is None else self._norm(weights, f"{p}{n}.weight") for n in names]
        scalar = float(np.asarray(weights.pop(f"{p}layer_scalar"), dtype=np.float32)[0])
        per_layer = None
        if self.config.family.per_layer_input_size:
            if self.per_layer_inputs is None:
                self.per_layer_inputs = self._per_layer_inputs(weights)
            per_layer = PerLayerInputGate(
                self.backend, self.per_layer_inputs, i,
                self._take(weights, f"{p}per_layer_input_gate.weight"),
                self._take(weights, f"{p}per_layer_projection.weight"),
                self._norm(weights, f"{p}post_per_layer_input_norm.weight"),
                self.config.rms_norm_eps)
        return ScaledSandwichDecoderLayer(self.backend, attn, mlp, *norms,
                                          self.config.rms_norm_eps, i == 0, scalar=scalar,
                                          per_layer=per_layer, unit_norm=ones)

    def new_kv_caches(self, num_blocks, block_size, dtype):
        """Caches for the layers that own one; a KV-shared layer's entry is its source's."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        own = {src: (self.xp.zeros(shape, dtype), self.xp.zeros(shape, dtype))
               for src in sorted(set(self.config.family.kv_sources))}
        return [own[src] for src in self.config.family.kv_sources]

    def forward(self, batch, kv_caches, hidden_indices=None, capture=None):
        """LlamaForCausalLM.forward with each KV-shared layer given its source's cache (whatever
        the list holds at a shared layer's place) and the step's per-layer inputs computed
        first. The KV-shared layers (the last ones) write no cache, so they run only on the
        rows whose outputs are read: each sequence's rows from its first sampled (or pooled)
        row on, as transformers slices them (_maybe_slice_kv_shared_inputs); a prompt chunk
        that samples nothing skips them. A pipeline stage runs them on every row (what they
        compute for the rows read is the same)."""
        s = self.config.family
        kv_caches = [kv_caches[src] for src in s.kv_sources]
        if self.per_layer_inputs is not None:
            self.per_layer_inputs.compute(batch.token_ids, self.workspace)
        rows = None
        num_read = len(batch.logits_indices) + (0 if hidden_indices is None else
                                                len(hidden_indices))
        # (a decode step reads every row: no look at the indices, which on a device would wait
        # for them, and could not inside a CUDA graph's capture)
        if (any(s.kv_shared) and capture is None and batch.vision is None
                and self.config.pipeline is None and num_read < batch.num_tokens):
            rows = self._rows_read(batch, hidden_indices)
        if rows is None:
            return super().forward(batch, kv_caches, hidden_indices, capture)
        return self._forward_read_rows(batch, kv_caches, hidden_indices, rows)

    def _rows_read(self, batch, hidden_indices):
        """(kept rows, their sequences' row offsets, logits_indices and hidden_indices among
        them), host arrays; None where every row is read."""
        to_host = self.backend.to_host
        qsl = np.asarray(to_host(batch.query_start_loc), np.int64)
        read = [np.asarray(to_host(batch.logits_indices), np.int64)]
        if hidden_indices is not None:
            read.append(np.asarray(to_host(hidden_indices), np.int64))
        read = np.unique(np.concatenate(read))
        # each sequence's first read row, or its end where it has none
        j = np.searchsorted(read, qsl[:-1])
        first = read[np.minimum(j, len(read) - 1)] if len(read) else qsl[1:]
        starts = np.where((j < len(read)) & (first < qsl[1:]), first, qsl[1:])
        counts = qsl[1:] - starts
        if counts.sum() == qsl[-1]:
            return None
        kept = np.concatenate([np.arange(a, b) for a, b in zip(starts, qsl[1:])]
                              + [np.zeros(0, np.int64)])
        kept_qsl = np.zeros(len(qsl), np.int32)
        np.cumsum(counts, out=kept_qsl[1:])

        def among_kept(idx):
            return np.searchsorted(kept, np.asarray(to_host(idx), np.int64))
        return (kept, kept_qsl, among_kept(batch.logits_indices),
                None if hidden_indices is None else among_kept(hidden_indices))

    def _forward_read_rows(self, batch, kv_caches, hidden_indices, rows):
        """LlamaForCausalLM.forward's steps for a model that is one stage and has no images,
        with the KV-shared layers on the rows `rows` keeps (_rows_read)."""
        c, b, xp, ws = self.config, self.backend, self.xp, self.workspace
        kept, kept_qsl, logits_rows, hidden_rows = rows
        T, K, H = batch.num_tokens, len(kept), c.hidden_size
        first_shared = c.family.kv_shared.index(True)
        residual, hidden = ws.get("residual", T, H), ws.get("hidden", T, H)
        tensor_parallel.embed(b, c, batch.token_ids, self.embed_tokens, residual)
        if self.embed_scale is not None:
            b.scale(residual, self.embed_scale)
        run_layers(self.layers[:first_shared], batch, hidden, residual,
                   kv_caches[:first_shared], ws)
        on_device = self.backend.asarray
        kept_d = on_device(kept.astype(np.int32))
        kept_hidden, kept_residual = ws.get("kept_hidden", K, H), ws.get("kept_residual", K, H)
        xp.take(hidden, kept_d, axis=0, out=kept_hidden)
        xp.take(residual, kept_d, axis=0, out=kept_residual)
        inputs = self.per_layer_inputs
        if inputs is not None:
            kept_inputs = ws.get("ple_kept_rows", K, inputs.rows.shape[1])
            xp.take(inputs.rows, kept_d, axis=0, out=kept_inputs)
            inputs.rows = kept_inputs
        kept_batch = dataclasses.replace(
            batch, token_ids=xp.take(batch.token_ids, kept_d), positions=xp.take(
                batch.positions, kept_d), slot_mapping=xp.take(batch.slot_mapping, kept_d),
            query_start_loc=on_device(kept_qsl),
            logits_indices=on_device(logits_rows.astype(np.int32)))
        if K:
            run_layers(self.layers[first_shared:], kept_batch, kept_hidden, kept_residual,
                       kv_caches[first_shared:], ws)
        idx = on_device(logits_rows)
        if hidden_rows is not None:
            idx = xp.concatenate([idx, on_device(hidden_rows)])
        rows_hidden = xp.ascontiguousarray(kept_hidden[idx])
        rows_residual = xp.ascontiguousarray(kept_residual[idx])
        if len(idx):
            self._final_norm(rows_hidden, rows_residual)
        logits = self.logits(rows_hidden[:len(logits_rows)])
        if hidden_indices is None:
            return logits
        return logits, rows_hidden[len(logits_rows):]

    def kv_cache_shape(self, num_blocks, block_size):
        """The wider layer kind's (module docstring)."""
        c = self.config
        full = (c.family.full_kv_heads, c.family.full_head_dim)
        sliding = (c.num_key_value_heads, c.head_dim)
        kv_heads, D = max(full, sliding, key=lambda d: d[0] * d[1])
        return (num_blocks, block_size, kv_heads, D)


class Gemma4Attention(ComposedAttention):
    def __init__(self, *args, q_norm, k_norm, v_norm, k_eq_v: bool, sliding_window: int):
        """q_norm, k_norm, v_norm (head_dim,): per-head RMSNorm weights (v's all ones).
        k_eq_v: the fused projection has q and k only, and v is k's copy."""
        super().__init__(*args)
        self.q_norm, self.k_norm, self.v_norm = q_norm, k_norm, v_norm
        self.k_eq_v = k_eq_v
        self.sliding_window = sliding_window

    def _project(self, x, ws):
        if not self.k_eq_v:
            return super()._project(x, ws)
        xp, T, qs, kvs = self.xp, x.shape[0], self.q_size, self.kv_size
        qk = ws.get("qkv", T, qs + kvs)
        self.backend.linear(x, self.qkv_weight, None, qk)
        q, k, v = ws.get("q", T, qs), ws.get("k", T, kvs), ws.get("v", T, kvs)
        xp.copyto(q, qk[:, :qs])
        xp.copyto(k, qk[:, qs:])
        xp.copyto(v, qk[:, qs:])
        return q, k, v

    def _before_rope(self, batch, q, k, v, ws):
        b, xp, T, D = self.backend, self.xp, q.shape[0], self.head_dim
        Hq, Hkv = self.num_heads, self.num_kv_heads
        rms_norm_in_place(b, xp, q, self.q_norm, self.eps, T * Hq, D, ws, "raw_q")
        rms_norm_in_place(b, xp, k, self.k_norm, self.eps, T * Hkv, D, ws, "raw_k")
        rms_norm_in_place(b, xp, v, self.v_norm, self.eps, T * Hkv, D, ws, "raw_v")

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        super().forward(batch, x, out, *self._cache_views(k_cache, v_cache), ws)

    def _cache_views(self, k_cache, v_cache):
        """This layer's (NB, BS, Hkv, D) views of the front of the wider caches."""
        NB, BS = k_cache.shape[:2]
        shape = (NB, BS, self.num_kv_heads, self.head_dim)
        size = NB * BS * self.num_kv_heads * self.head_dim
        return (k_cache.reshape(-1)[:size].reshape(shape),
                v_cache.reshape(-1)[:size].reshape(shape))


class Gemma4SharedKVAttention(Gemma4Attention):
    """A KV-shared layer's attention: its own queries (q_proj, q_norm, RoPE) over the cache its
    source layer wrote, this step's rows included (the source runs first); no K/V projections,
    no cache write."""

    def __init__(self, backend, q_weight, o_weight, cos_sin_cache, num_heads, num_kv_heads,
                 head_dim, eps, is_neox, scale, *, q_norm, sliding_window):
        super().__init__(backend, q_weight, o_weight, cos_sin_cache, num_heads, num_kv_heads,
                         head_dim, eps, is_neox, scale, q_norm=q_norm, k_norm=None,
                         v_norm=None, k_eq_v=False, sliding_window=sliding_window)

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        b, xp, T, D, Hq = self.backend, self.xp, x.shape[0], self.head_dim, self.num_heads
        q = ws.get("q", T, self.q_size)
        b.linear(x, self.qkv_weight, None, q)
        rms_norm_in_place(b, xp, q, self.q_norm, self.eps, T * Hq, D, ws, "raw_q")
        # the op turns q and k together; k is a one-head scratch row, its result unused
        b.rotary_embedding(batch.positions, q, ws.get("shared_kv_rope_k", T, D),
                           self.cos_sin_cache, D, self.is_neox)
        k_view, v_view = self._cache_views(k_cache, v_cache)
        attn = ws.get("attn", T, self.q_size)
        b.paged_attention(attn.reshape(T, Hq, D), q.reshape(T, Hq, D), k_view, v_view,
                          batch.block_tables, batch.seq_lens, batch.query_start_loc, self.scale,
                          self.sliding_window)
        b.linear(attn, self.o_weight, None, out)


class ScaledSandwichDecoderLayer(SandwichDecoderLayer):
    """SandwichDecoderLayer whose output stream, residual + this layer's MLP output, is
    multiplied by `scalar` (Gemma 4's layer_scalar): both parts are, as the stream is their sum
    until the next layer's fused add. With `per_layer` (a PerLayerInputGate) the stream first
    gets that block's output: the sum is made, and the block's output is the part left to add.
    unit_norm: a norm weight of ones (the op table has no plain add: a fused add-and-norm's sum
    is one, its normalized output unused)."""

    def __init__(self, backend, attention, mlp, input_norm, post_attn_norm, pre_mlp_norm,
                 post_mlp_norm, eps, first, scalar: float, per_layer=None, unit_norm=None):
        super().__init__(backend, attention, mlp, input_norm, post_attn_norm, pre_mlp_norm,
                         post_mlp_norm, eps, first)
        self.ops, self.scalar, self.per_layer = backend, scalar, per_layer
        self.unit_norm, self.eps_value = unit_norm, eps

    def forward(self, batch, hidden, residual, k_cache, v_cache, ws):
        super().forward(batch, hidden, residual, k_cache, v_cache, ws)
        if self.per_layer is not None:
            self.ops.fused_add_rms_norm(hidden, residual, self.unit_norm, self.eps_value)
            self.per_layer.forward(residual, hidden, ws)
        if self.scalar != 1.0:
            self.ops.scale(hidden, self.scalar)
            self.ops.scale(residual, self.scalar)


class Gemma4FeedForward:
    """Gemma 4's dense MLP and mixture of experts side by side (module docstring). The layer's
    pre-MLP norm has weight one, so `x` arrives as the stream after attention divided by its RMS:
    each branch's pre-norm (and the router's scale) is that times its own weight, as
    transformers' RMSNorms compute it."""

    # (tensor parallel: the dense MLP comes all-reduced, the experts' sum is all-reduced here)
    all_reduced_inside = True

    def __init__(self, backend, mlp, experts: MoE, pre_norm, pre_norm_2, router_scale,
                 post_norm_1, post_norm_2, eps: float, comm=None):
        self.backend, self.xp = backend, backend.xp
        self.mlp, self.experts = mlp, experts
        self.pre_norm, self.pre_norm_2, self.router_scale = pre_norm, pre_norm_2, router_scale
        self.post_norm_1, self.post_norm_2 = post_norm_1, post_norm_2
        self.eps = eps
        self.comm = comm

    def forward(self, x, out, ws):
        """x (T, H): the stream after attention, RMS-normalized without a weight -> out (T, H)."""
        b, xp, (T, H) = self.backend, self.xp, x.shape
        branch_in = ws.get("gemma4_ffn_in", T, H)
        branch_out = ws.get("gemma4_ffn_out", T, H)
        normed = ws.get("gemma4_ffn_normed", T, H)
        xp.multiply(x, self.pre_norm, out=branch_in)
        self.mlp.forward(branch_in, branch_out, ws)
        b.rms_norm(branch_out, self.post_norm_1, self.eps, out)
        xp.multiply(x, self.router_scale, out=branch_in)
        ids, weights = self.experts.select(branch_in, ws)
        xp.multiply(x, self.pre_norm_2, out=branch_in)
        self.experts.run_experts(branch_in, ids, weights, branch_out, ws)
        if self.comm is not None:
            self.comm.all_reduce(branch_out)
        b.rms_norm(branch_out, self.post_norm_2, self.eps, normed)
        out += normed

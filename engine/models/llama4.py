"""Llama 4 text (Llama4ForCausalLM): the Llama graph with

- NoPE layers: the layers no_rope_layers marks 0 rotate nothing;
- chunked local attention on the layers layer_types calls chunked (the RoPE layers by default): a
  query sees the keys of its own attention_chunk_size-aligned chunk, up to itself. Composed from
  the paged attention op (ChunkedView): each sequence's rows are cut at the chunk boundaries and
  each piece attends as a sequence of its own whose block table starts at its chunk's first
  block, so the chunk size must be a multiple of the KV block size;
- an L2 norm (RMSNorm without a weight) on every q and k head after RoPE, on the RoPE layers
  (use_qk_norm);
- attention temperature tuning on the NoPE layers: q *= 1 + attn_scale * log1p(floor((position
  + 1) / floor_scale));
- its mixture of experts (Llama4MoE) on the layers moe_layers (or interleave_moe_layer_step)
  names, a dense MLP of intermediate_size_mlp on the others, all under `feed_forward.`.

Llama 4 as released (Llama4ForConditionalGeneration: the text model's tensors under
language_model., beside a vision model and its projector) is served for its text, the vision
parts not loaded.

The settings are engine/models/family_config.py's Llama4Settings. The chunk cutting and the
temperature are computed on the host, so the family runs on the CPU backend; the CUDA backend is
refused by name.
"""
from __future__ import annotations

import logging

import numpy as np

from engine.models.composed_attention import ComposedAttention, rms_norm_in_place
from engine.models.llama import LlamaForCausalLM, expected_shapes
from engine.models.model_config import ModelConfig
from engine.runner.forward_batch import ForwardBatch
from pyx.layers import MLP
from pyx.moe import MoE, _top_k_by_argmax

logger = logging.getLogger("taper.models")


def _language_model_only(weights: dict) -> None:
    """In place: a multimodal checkpoint's language model under the causal LM's names, the
    vision model and projector dropped."""
    dropped = 0
    for name in list(weights):
        if name.startswith("language_model."):
            weights[name[len("language_model."):]] = weights.pop(name)
        elif name.startswith(("vision_model.", "multi_modal_projector.")):
            del weights[name]
            dropped += 1
    if dropped:
        logger.info("not loaded: %d vision model and projector tensors", dropped)


def llama4_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = expected_shapes(c)
    m, H = c.moe, c.hidden_size
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            shapes[f"{p}feed_forward.{name}.weight"] = shapes.pop(f"{p}mlp.{name}.weight")
        if not m.sparse_layers[i]:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}feed_forward.{name}.weight"]
        q = f"{p}feed_forward."
        E, I, S = m.num_experts, m.intermediate_size, m.shared_intermediate_size
        shapes[f"{q}router.weight"] = (E, H)
        shapes[f"{q}experts.gate_up_proj"] = (E, H, 2 * I)
        shapes[f"{q}experts.down_proj"] = (E, I, H)
        shapes.update({f"{q}shared_expert.gate_proj.weight": (S, H),
                       f"{q}shared_expert.up_proj.weight": (S, H),
                       f"{q}shared_expert.down_proj.weight": (H, S)})
    return shapes


class Llama4ForCausalLM(LlamaForCausalLM):
    expected_shapes = staticmethod(llama4_shapes)

    def __init__(self, config: ModelConfig, weights: dict, backend):
        if backend.name != "cpu":
            raise ValueError(f"{config.architecture}: chunked attention and the attention "
                             f"temperature are composed on the host; the {backend.name} "
                             f"backend is not supported, use the CPU backend")
        if config.tensor_parallel is not None:
            raise ValueError(f"{config.architecture}: tensor parallel is not supported")
        _language_model_only(weights)
        self.chunks = ChunkedView(config.family.attention_chunk_size)
        super().__init__(config, weights, backend)

    def _attention(self, weights, p, i):
        c, s = self.config, self.config.family
        ones = self.backend.place_weight(np.ones(c.head_dim, np.float32))
        return Llama4Attention(
            self.backend, self._qkv(weights, p)[0],
            self._take(weights, f"{p}self_attn.o_proj.weight"),
            self.cos_sin_cache if s.rope_layers[i] else None, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope.is_neox,
            l2_norm=ones if s.qk_l2_norm and s.rope_layers[i] else None,
            temperature=None if s.rope_layers[i] else s.temperature,
            chunks=self.chunks if s.chunked_layers[i] else None)

    def _qkv(self, weights, p):
        if self.config.qkv_bias:
            raise ValueError(f"{self.config.architecture}: attention_bias is not supported")
        return super()._qkv(weights, p)

    def _mlp(self, weights, p, i):
        m = self.config.moe
        q = f"{p}feed_forward."
        if not m.sparse_layers[i]:
            return MLP(self.backend, self._fuse(weights, [f"{q}gate_proj.weight",
                                                          f"{q}up_proj.weight"]),
                       None, self._take(weights, f"{q}down_proj.weight"), None)
        gate_up = weights.pop(f"{q}experts.gate_up_proj")
        down = weights.pop(f"{q}experts.down_proj")
        place = self.backend.place_weight
        # stored (E, H, 2I) and (E, I, H), x @ w; the gate is the first half of 2I
        gate_ups = [place(np.ascontiguousarray(gate_up[e].T)) for e in range(m.num_experts)]
        downs = [place(np.ascontiguousarray(down[e].T)) for e in range(m.num_experts)]
        s = f"{q}shared_expert."
        shared = MLP(self.backend, self._fuse(weights, [f"{s}gate_proj.weight",
                                                        f"{s}up_proj.weight"]),
                     None, self._take(weights, f"{s}down_proj.weight"), None)
        return Llama4MoE(self.backend, self._take(weights, f"{q}router.weight"), gate_ups, downs,
                         m.top_k, shared, fused=self.backend.fused_moe)

    def forward(self, batch, kv_caches, *args, **kwargs):
        self.chunks.forget()        # a batch object may come again with other contents
        return super().forward(batch, kv_caches, *args, **kwargs)

    def kv_cache_shape(self, num_blocks, block_size):
        chunk = self.config.family.attention_chunk_size
        if any(self.config.family.chunked_layers) and chunk % block_size:
            raise ValueError(f"{self.config.architecture}: attention_chunk_size {chunk} is not a "
                             f"multiple of the KV block size {block_size}")
        return super().kv_cache_shape(num_blocks, block_size)


class ChunkedView:
    """A batch's chunked-attention form (module docstring), made once per forward and shared by
    the chunked layers: each sequence's rows cut where their positions cross a chunk boundary,
    each piece a sequence whose keys start at its chunk: its seq_len counts from the chunk's
    first position, its block table row from the chunk's first block."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self._batch = self._view = None

    def forget(self) -> None:
        self._batch = self._view = None

    def of(self, batch: ForwardBatch, block_size: int) -> ForwardBatch:
        if batch is self._batch:
            return self._view
        C = self.chunk_size
        qsl = np.asarray(batch.query_start_loc)
        lens = np.asarray(batch.seq_lens)
        tables = np.asarray(batch.block_tables)
        starts, seq_lens, rows = [0], [], []
        for b in range(len(lens)):
            s0, s1, S = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
            first = S - (s1 - s0)                   # the position of the row s0
            pos = first
            while pos < S:
                chunk_start = pos // C * C
                end = min(S, chunk_start + C)       # positions [pos, end) in this piece
                starts.append(starts[-1] + end - pos)
                seq_lens.append(end - chunk_start)
                rows.append(tables[b, chunk_start // block_size:])
                pos = end
        width = max([len(r) for r in rows], default=1)
        block_tables = np.zeros((len(rows), max(width, 1)), np.int32)
        for j, r in enumerate(rows):
            block_tables[j, :len(r)] = r
        self._view = ForwardBatch(batch.token_ids, batch.positions, batch.slot_mapping,
                                  np.asarray(starts, np.int32), np.asarray(seq_lens, np.int32),
                                  block_tables, batch.logits_indices)
        self._batch = batch
        return self._view


class Llama4Attention(ComposedAttention):
    """Llama 4's steps around RoPE: the L2 norm of each q and k head after it (RoPE layers), the
    temperature on q (NoPE layers); paged attention over the chunked view (chunked layers)."""

    def __init__(self, *args, l2_norm=None, temperature: tuple[float, float] | None = None,
                 chunks: ChunkedView | None = None):
        """l2_norm: a (head_dim,) weight of ones (the norm has none) or None. temperature:
        (attn_scale, floor_scale) or None. chunks: the model's ChunkedView on a chunked layer,
        None on a full one."""
        super().__init__(*args)
        self.l2_norm, self.temperature, self.chunks = l2_norm, temperature, chunks

    def _after_rope(self, batch, q, k, ws):
        b, xp, T, D = self.backend, self.xp, q.shape[0], self.head_dim
        if self.l2_norm is not None:
            rms_norm_in_place(b, xp, q, self.l2_norm, self.eps, T * self.num_heads, D, ws, "raw_q")
            rms_norm_in_place(b, xp, k, self.l2_norm, self.eps, T * self.num_kv_heads, D, ws,
                              "raw_k")
        if self.temperature is not None:
            attn_scale, floor_scale = self.temperature
            pos = batch.positions.astype(np.float32)
            scales = np.log1p(np.floor((pos + np.float32(1.0)) / np.float32(floor_scale)))
            scales = scales * np.float32(attn_scale) + np.float32(1.0)
            q *= scales.astype(q.dtype)[:, None]

    def _view(self, batch, block_size):
        return batch if self.chunks is None else self.chunks.of(batch, block_size)


class Llama4MoE(MoE):
    """Llama4TextMoe: each token's top_k router logits, their sigmoids scaling the token's input
    to those experts (not their outputs), the experts' outputs summed, plus the ungated shared
    expert. pyx/moe.py's expert paths run each (token, expert) pair as a token routed to one
    expert with weight 1."""

    def __init__(self, backend, router, experts_gate_up, experts_down, top_k, shared,
                 fused=False):
        super().__init__(backend, router, experts_gate_up, experts_down, 1, False, shared,
                         None, fused)
        self.route_k = top_k

    def forward(self, x, out, ws):
        b, xp = self.backend, self.xp
        T, H = x.shape
        k = self.route_k
        logits = ws.get("router_logits", T, self.num_experts)
        b.linear(x, self.router, None, logits)
        logits = logits.astype(xp.float32)
        ids = _top_k_by_argmax(logits.copy(), k, xp)
        scores = 1.0 / (1.0 + xp.exp(-xp.take_along_axis(logits, ids, axis=1)))
        pairs_in = ws.get("llama4_moe_in", T * k, H)
        xp.multiply(x[:, None, :], scores.astype(x.dtype)[:, :, None],
                    out=pairs_in.reshape(T, k, H))
        pairs_out = ws.get("llama4_moe_out", T * k, H)
        ones = xp.ones((T * k, 1), xp.float32)
        pair_ids = xp.ascontiguousarray(ids.reshape(T * k, 1))
        self.run_experts(pairs_in, pair_ids, ones, pairs_out, ws)
        pairs_out.reshape(T, k, H).sum(axis=1, out=out)
        shared_out = ws.get("moe_shared", T, H)
        self.shared.forward(x, shared_out, ws)
        out += shared_out

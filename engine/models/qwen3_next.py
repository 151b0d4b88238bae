"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: hybrid models whose layers are gated DeltaNet linear
attention (pyx/gated_delta_net.py) or gated full attention (pyx/gated_attention.py), in the
config's layer_types (by default three linear layers, then one full), each followed by a dense MLP
or the Qwen2-MoE-style mixture of experts with a sigmoid-gated shared expert (pyx/moe.py).

Quirks over the Qwen3 graph: every RMSNorm but the DeltaNet's gated one multiplies by 1 + w
(norm_offset); q_proj yields each head's query and then its output gate; a quarter of each head
is rotated by default (ModelConfig). Qwen3-Next stores the DeltaNet input projections as
in_proj_qkvz / in_proj_ba grouped per key head; Qwen3.5 as in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a. Both are placed as one matrix whose output is [q k v z b a], each in head order.

Only the full-attention layers have a paged K/V cache; the linear layers keep per-sequence state
rows (engine/core/hybrid_state.py), which `allocate_caches` makes. A pipeline stage's model
(engine/parallel/pipeline.py) holds its layers' caches and state rows only, under the slot
numbers of rank 0's plan; its layer_types are the stage's.
"""
from __future__ import annotations

import numpy as np

from engine.models.kv_scales import take_kv_scales
from engine.models.llama import LlamaForCausalLM, check_weights, expected_shapes, logger
from engine.models.model_config import ModelConfig
from engine.models.moe import MoeForCausalLM, moe_shapes
from engine.models.rotary import build_cos_sin_cache
from engine.parallel import layers as tensor_parallel
from pyx.gated_attention import GatedAttention
from pyx.gated_delta_net import GatedDeltaNet
from pyx.layers import Workspace


def take_mtp_weights(weights: dict) -> dict:
    """The checkpoint's mtp.* tensors (the MTP head's: engine/models/qwen3_next_mtp.py), popped
    from `weights`."""
    return {n: weights.pop(n) for n in [n for n in weights if n.startswith("mtp.")]}


def hybrid_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = moe_shapes(c) if c.moe is not None else expected_shapes(c)
    la, H = c.linear_attention, c.hidden_size
    for i, kind in enumerate(la.layer_types):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            shapes[f"{p}self_attn.q_proj.weight"] = (2 * c.q_size, H)     # queries and gates
            if c.qkv_bias:
                shapes[f"{p}self_attn.q_proj.bias"] = (2 * c.q_size,)
            continue
        for name in [n for n in shapes if n.startswith(f"{p}self_attn.")]:
            del shapes[name]
        q = f"{p}linear_attn."
        Hv = la.num_v_heads
        if la.split_projections:
            shapes[f"{q}in_proj_qkv.weight"] = (la.conv_dim, H)
            shapes[f"{q}in_proj_z.weight"] = (la.value_dim, H)
            shapes[f"{q}in_proj_b.weight"] = (Hv, H)
            shapes[f"{q}in_proj_a.weight"] = (Hv, H)
        else:
            shapes[f"{q}in_proj_qkvz.weight"] = (2 * la.key_dim + 2 * la.value_dim, H)
            shapes[f"{q}in_proj_ba.weight"] = (2 * Hv, H)
        shapes[f"{q}conv1d.weight"] = (la.conv_dim, 1, la.conv_kernel)
        shapes[f"{q}A_log"] = (Hv,)
        shapes[f"{q}dt_bias"] = (Hv,)
        shapes[f"{q}norm.weight"] = (la.head_v_dim,)
        shapes[f"{q}out_proj.weight"] = (H, la.value_dim)
    return shapes


def _language_model_only(weights: dict, first_expert: int = 0) -> None:
    """In place: a multimodal checkpoint's (Qwen3.5's) language model under the causal LM's
    names, its vision tower dropped; stacked experts split into the per-expert tensors (the
    multi-token-prediction head's, mtp.*, too), numbered from first_expert (under expert
    parallel the rank's stack holds experts first_expert onwards)."""
    prefix = "model.language_model."
    dropped = 0
    for name in list(weights):
        if name.startswith(prefix):
            weights["model." + name[len(prefix):]] = weights.pop(name)
        elif name.startswith("model.visual."):
            del weights[name]
            dropped += 1
    if dropped:
        logger.info("not loaded: %d vision-tower tensors", dropped)
    # experts stacked as transformers 5 holds them: gate_up_proj (E, 2I, H), down_proj (E, H, I)
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]:
        base = name[:-len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(base + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            weights[f"{base}{first_expert + e}.gate_proj.weight"] = gate_up[e, :inter]
            weights[f"{base}{first_expert + e}.up_proj.weight"] = gate_up[e, inter:]
            weights[f"{base}{first_expert + e}.down_proj.weight"] = down[e]


class HybridDecoderLayer:
    """Pre-norm block around either mixer, with DecoderLayer's residual convention
    (pyx/layers.pyx): `hidden` enters holding the previous block's MLP output and leaves holding
    this one's; `residual` holds the running sum."""

    def __init__(self, backend, mixer, mlp, input_norm, post_norm, eps: float, first: bool,
                 is_linear: bool):
        self.backend, self.mixer, self.mlp = backend, mixer, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        self.eps, self.first = eps, first
        self.is_linear = is_linear

    def forward(self, batch, hidden, residual, caches, ws):
        b = self.backend
        if self.first:
            b.rms_norm(residual, self.input_norm, self.eps, hidden)
        else:
            b.fused_add_rms_norm(hidden, residual, self.input_norm, self.eps)
        mixed = ws.get("attn_out", hidden.shape[0], hidden.shape[1])
        self.mixer.forward(batch, hidden, mixed, caches[0], caches[1], ws)
        b.fused_add_rms_norm(mixed, residual, self.post_norm, self.eps)
        self.mlp.forward(mixed, hidden, ws)


class Qwen3NextForCausalLM(MoeForCausalLM):
    norm_offset = 1.0       # Qwen3NextRMSNorm: x_normed * (1 + w)
    expected_shapes = staticmethod(hybrid_shapes)

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend):
        """Takes ownership of `weights` (tensors are popped as they are placed)."""
        tp = config.tensor_parallel
        _language_model_only(weights, tp.experts[0] if tp is not None and tp.experts else 0)
        # the MTP head's, for speculative decoding (engine/models/qwen3_next_mtp.py); the
        # engine's builder drops them when nothing drafts with them
        self.mtp_weights = take_mtp_weights(weights)
        check_weights(config, weights, self.held_shapes(config))
        self.config, self.backend, self.xp = config, backend, backend.xp
        self._to_device = backend.asarray
        c = config
        self.cos_sin_cache = self._to_device(
            build_cos_sin_cache(c.rope, c.max_position_embeddings, c.max_model_len))
        self.workspace = Workspace(self.xp, backend.act_dtype)
        self.embed_scale = None
        self._unit_norm = None        # (a pipeline stage's hand-over: LlamaForCausalLM._ones)
        self.kv_scales_from_checkpoint = False
        self.layers = []
        for i, kind in enumerate(c.linear_attention.layer_types):
            p = f"model.layers.{i}."
            mixer = (self._gated_attention(weights, p, i) if kind == "full_attention"
                     else self._delta_net(weights, p))
            # under tensor parallel o_proj / out_proj and down_proj are row-parallel
            self.layers.append(HybridDecoderLayer(
                backend, tensor_parallel.all_reduced_attention(mixer, c),
                tensor_parallel.all_reduced(self._mlp(weights, p, i), c),
                self._norm(weights, f"{p}input_layernorm.weight"),
                self._norm(weights, f"{p}post_attention_layernorm.weight"), c.rms_norm_eps,
                i == 0, kind != "full_attention"))
        self._take_ends(weights)

    # ---- the layers

    def _gated_attention(self, weights, p: str, i: int) -> GatedAttention:
        c = self.config
        kv_scales = take_kv_scales(weights, i, c.num_key_value_heads)
        self.kv_scales_from_checkpoint |= kv_scales is not None
        qkv_weight, qkv_bias = self._qkv(weights, p)
        return GatedAttention(
            self.backend, qkv_weight, qkv_bias,
            self._take(weights, f"{p}self_attn.o_proj.weight"),
            self._take(weights, f"{p}self_attn.o_proj.bias") if c.o_bias else None,
            *self._qk_norms(weights, p), self.cos_sin_cache, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
            *((None, None) if kv_scales is None else (self._to_device(s) for s in kv_scales)))

    def _delta_net(self, weights, p: str) -> GatedDeltaNet:
        c, la = self.config, self.config.linear_attention
        q = f"{p}linear_attn."
        if la.split_projections:
            in_proj = self._fuse(weights, [f"{q}in_proj_{n}.weight"
                                           for n in ("qkv", "z", "b", "a")])
        else:
            in_proj = self.backend.place_weight(self._ungroup_projections(weights, q))
        conv = np.asarray(weights.pop(f"{q}conv1d.weight"), np.float32)[:, 0, :]   # (C, K)
        return GatedDeltaNet(
            self.backend, in_proj, conv, weights.pop(f"{q}A_log"), weights.pop(f"{q}dt_bias"),
            weights.pop(f"{q}norm.weight"), self._take(weights, f"{q}out_proj.weight"),
            la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, c.rms_norm_eps)

    def _ungroup_projections(self, weights, q: str) -> np.ndarray:
        """Qwen3-Next's in_proj_qkvz rows, per key head [q (dk), k (dk), v (r dv), z (r dv)],
        and in_proj_ba's, per key head [b (r), a (r)] (r = v heads per key head), as one
        matrix of rows [q k v z b a], each in head order (fix_query_key_value_ordering)."""
        la = self.config.linear_attention
        qkvz, ba = weights.pop(f"{q}in_proj_qkvz.weight"), weights.pop(f"{q}in_proj_ba.weight")
        if not (isinstance(qkvz, np.ndarray) and isinstance(ba, np.ndarray)):
            raise ValueError(f"{q}in_proj_qkvz / in_proj_ba: the gated DeltaNet projections "
                             f"must be float tensors, not {type(qkvz).__name__}")
        nk, dk, dv = la.num_k_heads, la.head_k_dim, la.head_v_dim
        r = la.num_v_heads // nk
        H = qkvz.shape[1]
        groups = qkvz.reshape(nk, 2 * dk + 2 * r * dv, H)
        cuts = np.cumsum([0, dk, dk, r * dv, r * dv])
        parts = [groups[:, a:b].reshape(-1, H) for a, b in zip(cuts[:-1], cuts[1:])]
        ba = ba.reshape(nk, 2 * r, H)
        parts += [ba[:, :r].reshape(-1, H), ba[:, r:].reshape(-1, H)]
        return np.ascontiguousarray(np.concatenate(parts, axis=0))

    def _mlp(self, weights, p: str, i: int):
        if self.config.moe is None:          # Qwen3.5 (dense)
            return LlamaForCausalLM._mlp(self, weights, p, i)
        return super()._mlp(weights, p, i)

    # ---- caches and the forward

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype, num_state_rows: int):
        """Per layer: (K, V) paged caches for a full-attention layer, (conv state, recurrent
        state) float32 rows for a linear one (engine/core/hybrid_state.py: slots, then
        snapshots)."""
        xp, caches = self.xp, []
        for layer in self.layers:
            if layer.is_linear:
                caches.append(tuple(xp.zeros(shape, np.float32)
                                    for shape in layer.mixer.state_shapes(num_state_rows)))
            else:
                shape = self.kv_cache_shape(num_blocks, block_size)
                caches.append((xp.zeros(shape, kv_dtype), xp.zeros(shape, kv_dtype)))
        return caches

    def copy_state_rows(self, caches: list, src: list[int], dst: list[int]) -> None:
        """Every linear layer's state rows src copied onto rows dst (a verify step's accepted
        state into its slot: engine/core/hybrid_state.py)."""
        s = self.backend.asarray(np.asarray(src, np.int64))
        d = self.backend.asarray(np.asarray(dst, np.int64))
        for layer, (conv, recurrent) in zip(self.layers, caches):
            if layer.is_linear:
                conv[d] = conv[s]
                recurrent[d] = recurrent[s]

    def forward(self, batch, kv_caches: list, hidden_indices=None, capture=None):
        """LlamaForCausalLM.forward's contract; the batch carries its state plan
        (ForwardBatch.state_plan) for the linear layers. `capture`: a FinalCapture only (an MTP
        head's: every row's final-norm hidden state)."""
        if capture is not None and not capture.final:
            raise ValueError("a hybrid model hands only its final-norm hidden states to a head")
        c, b, ws, xp = self.config, self.backend, self.workspace, self.xp
        T = batch.num_tokens
        residual = ws.get("residual", T, c.hidden_size)
        hidden = ws.get("hidden", T, c.hidden_size)
        stage = c.pipeline
        if stage is None or stage.first:
            tensor_parallel.embed(b, c, batch.token_ids, self.embed_tokens, residual)
        else:           # the stream from the stage before (engine/parallel/pipeline.py)
            stage.receive_stream(residual)
        for layer, caches in zip(self.layers, kv_caches):
            layer.forward(batch, hidden, residual, caches, ws)
        if stage is not None and not stage.last:
            self._send_to_next_stage(hidden, residual)
            return None
        idx = batch.logits_indices
        num_logits = len(idx)
        if hidden_indices is not None:
            idx = xp.concatenate([idx, hidden_indices])
        if capture is not None:
            states = xp.empty(hidden.shape, dtype=hidden.dtype)
            xp.copyto(states, hidden)
            if T:
                self._final_norm(states, residual)
            capture.states = states
            rows_hidden = xp.ascontiguousarray(states[idx])
        else:
            rows_hidden = xp.ascontiguousarray(hidden[idx])
            rows_residual = xp.ascontiguousarray(residual[idx])
            if len(idx):
                self._final_norm(rows_hidden, rows_residual)
        logits = self.logits(rows_hidden[:num_logits])
        if hidden_indices is None:
            return logits
        return logits, rows_hidden[num_logits:]

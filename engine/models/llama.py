"""One graph for Llama, Yi, Mistral, Qwen2 and Qwen3 (config flags cover the differences:
attention biases, per-head q/k RMSNorm, per-layer sliding windows, RoPE variants), and the base the
other families' files build on: they override the hooks below (`_qkv`, `_qk_norms`, `_gate_up`,
`_layer`, `_mlp`, `_rope_cache`, `_final_norm`, `norm_offset`, `embedding_multiplier`,
`expected_shapes`) with just their quirks.

Weights use Hugging Face names. At load q/k/v are fused into one matrix and gate/up into another,
popping the parts from the weight dict as each layer is built so two copies never coexist.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from engine.runner.forward_batch import ForwardBatch
from engine.models.model_config import ModelConfig
from engine.models.kv_scales import take_kv_scales
from engine.models.rotary import build_cos_sin_cache, longrope_positions
from engine.parallel import layers as tensor_parallel
from pyx.layers import MLP, Attention, DecoderLayer, Workspace, run_layers

logger = logging.getLogger("taper.models")


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads, by its Hugging Face name."""
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if c.has_lm_head and not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        proj = {"q_proj": (c.q_size, H), "k_proj": (c.kv_size, H), "v_proj": (c.kv_size, H)}
        for name, shape in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
        shapes[f"{p}self_attn.o_proj.weight"] = (H, c.q_size)
        if c.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (H,)
        if c.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (D,)
            shapes[f"{p}self_attn.k_norm.weight"] = (D,)
        mlp = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        for name, shape in mlp.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
        shapes[f"{p}input_layernorm.weight"] = (H,)
        shapes[f"{p}post_attention_layernorm.weight"] = (H,)
    return shapes


def check_weights(c: ModelConfig, weights: dict, shapes: dict) -> None:
    problems = []
    for name, shape in shapes.items():
        if name not in weights:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"tensor {name} has shape {list(weights[name].shape)}, "
                            f"expected {list(shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{c.architecture} checkpoint does not match its config: "
                         + "; ".join(problems[:5]) + more)


class AuxCapture:
    """EAGLE-3's view into the target's forward: the residual stream entering each layer of
    `layers` (vLLM's aux hidden state ids: id j is layer j's input, the embeddings for id 0),
    ascending and distinct; the forward sets `states` to them side by side, (T, len(layers) *
    hidden) in the activation dtype."""
    __slots__ = ("layers", "states")
    final = False

    def __init__(self, layers):
        self.layers = tuple(layers)
        self.states = None


class FinalCapture:
    """An MTP head's view into the target's forward (engine/spec/mtp.py): every row's final-norm
    hidden state, the lm_head's input, (T, hidden) in the activation dtype, a new array."""
    __slots__ = ("states",)
    layers = ()
    final = True

    def __init__(self):
        self.states = None


class LlamaForCausalLM:
    # Added to every RMSNorm weight at load (Gemma's norms multiply by 1 + w).
    norm_offset = 0.0

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend):
        """Takes ownership of `weights` (tensors are popped as they are placed)."""
        # Under tensor parallel, config is the rank's share (engine/parallel/sharding.py).
        check_weights(config, weights, self.held_shapes(config))
        self.config = config
        self.backend = backend
        self.xp = backend.xp
        self._to_device = backend.asarray
        c = config
        cache = build_cos_sin_cache(c.rope, c.max_position_embeddings, c.max_model_len)
        self.cos_sin_cache = self._to_device(cache)
        self.workspace = Workspace(self.xp, backend.act_dtype)
        self._unit_norm = None        # a weight of ones, for AuxCapture's additions
        # The embedding's multiplier, rounded to the activation dtype as transformers rounds it
        # to the weights' (None: 1).
        self.embed_scale = self.embedding_multiplier(c)
        if self.embed_scale is not None:
            self.embed_scale = float(np.asarray(self.embed_scale, dtype=backend.act_dtype))

        self.layers = []
        # FP8 KV cache scales per layer and KV head (DESIGN.md section 5): the checkpoint's, else
        # 1.0. Read only when the KV cache is FP8 (a uint8 cache).
        self.kv_scales_from_checkpoint = False
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = self._attention(weights, p, i)
            mlp = tensor_parallel.all_reduced(self._mlp(weights, p, i), c)
            self.layers.append(self._layer(weights, p, i, attn, mlp))
        self._take_ends(weights)

    def _take_ends(self, weights: dict) -> None:
        """The embedding, the final norm and the LM head, after the layers took theirs; what is
        left unused is named in a warning, and the dict emptied."""
        c = self.config
        stage = c.pipeline
        if stage is not None and not stage.holds_end("model.embed_tokens.weight"):
            self.embed_tokens = None        # a middle stage (engine/parallel/pipeline.py)
        else:
            if c.tensor_parallel is not None:
                weights["model.embed_tokens.weight"] = tensor_parallel.with_zero_row(
                    weights["model.embed_tokens.weight"])
            self.embed_tokens = self._take(weights, "model.embed_tokens.weight")
        if stage is not None and not stage.last:
            self.norm = self.lm_head = None
        elif not c.has_lm_head:            # a headless transformer (LlamaModel, ...): embeddings only
            self.norm = self._norm(weights, "model.norm.weight")
            self.lm_head = None
        elif c.tie_word_embeddings:
            self.norm = self._norm(weights, "model.norm.weight")
            weights.pop("lm_head.weight", None)
            self.lm_head = self.embed_tokens
        else:
            self.norm = self._norm(weights, "model.norm.weight")
            self.lm_head = self._take(weights, "lm_head.weight")
        unused = [n for n in weights if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            logger.warning("ignoring %d unused checkpoint tensors, e.g. %s", len(unused), unused[0])
        weights.clear()

    def held_shapes(self, config) -> dict:
        """expected_shapes, less the ends (embedding, final norm, LM head) a pipeline stage does
        not hold (engine/parallel/pipeline.py)."""
        shapes = self.expected_shapes(config)
        if config.pipeline is None:
            return shapes
        return {n: s for n, s in shapes.items() if config.pipeline.holds_end(n)}

    def _send_to_next_stage(self, hidden, residual) -> None:
        """A stage before the last: the add the next stage's first layer would make (it
        normalizes what it receives, with its own norm: a LayerNorm family's too, as only the
        stored sum is sent; the RMS norm written into `hidden` is discarded), then the stream
        sent on."""
        self.backend.fused_add_rms_norm(hidden, residual, self._ones(), self.config.rms_norm_eps)
        self.config.pipeline.send_stream(residual)

    # ---- hooks a family overrides

    expected_shapes = staticmethod(expected_shapes)

    @staticmethod
    def embedding_multiplier(c: ModelConfig) -> float | None:
        return None

    def _attention(self, weights: dict, p: str, i: int):
        """Layer i's attention block (weights under prefix p): anything with
        forward(batch, x, out, k_cache, v_cache, ws)."""
        c = self.config
        kv_scales = take_kv_scales(weights, i, c.num_key_value_heads)
        self.kv_scales_from_checkpoint |= kv_scales is not None
        if kv_scales is None:
            kv_scales = (np.ones(c.num_key_value_heads, np.float32),) * 2
        return tensor_parallel.attention_class(c)(
            self.backend, *self._qkv(weights, p),
            self._take(weights, f"{p}self_attn.o_proj.weight"),
            self._take(weights, f"{p}self_attn.o_proj.bias") if c.o_bias else None,
            *self._qk_norms(weights, p),
            self._rope_cache(i), c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.rms_norm_eps, c.sliding_windows[i], c.rope.is_neox,
            *(self._to_device(s) for s in kv_scales),
            scale=c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None,
            softcap=c.attn_softcap, qk_layernorm=c.qk_layernorm,
            **self._attention_extras(weights, p, i))

    def _attention_extras(self, weights: dict, p: str, i: int) -> dict:
        """A family's further Attention keyword arguments for layer i (GPT-OSS: its sinks)."""
        return {}

    def _qkv(self, weights: dict, p: str) -> tuple:
        """(fused q/k/v weight (q_size + 2 kv_size, H), its bias or None) of layer prefix p."""
        names = [f"{p}self_attn.{n}_proj" for n in "qkv"]
        return (self._fuse(weights, [f"{n}.weight" for n in names], role="qkv"),
                self._fuse(weights, [f"{n}.bias" for n in names]) if self.config.qkv_bias else None)

    def _qk_norms(self, weights: dict, p: str) -> tuple:
        """(q norm, k norm) of layer prefix p: per-head RMSNorm weights, or None."""
        if not self.config.qk_norm:
            return None, None
        return tuple(self._norm(weights, f"{p}self_attn.{n}_norm.weight") for n in "qk")

    def _mlp(self, weights: dict, p: str, i: int):
        """Layer i's feed-forward block (weights under prefix p)."""
        c = self.config
        return MLP(self.backend, *self._gate_up(weights, p),
                   self._take(weights, f"{p}mlp.down_proj.weight"),
                   self._take(weights, f"{p}mlp.down_proj.bias") if c.mlp_bias else None,
                   act=c.hidden_act)

    def _gate_up(self, weights: dict, p: str) -> tuple:
        """(fused gate/up weight (2I, H), its bias or None) of layer prefix p."""
        names = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
        return (self._fuse(weights, [f"{n}.weight" for n in names]),
                self._fuse(weights, [f"{n}.bias" for n in names]) if self.config.mlp_bias else None)

    def _layer(self, weights: dict, p: str, i: int, attn: Attention, mlp):
        return DecoderLayer(self.backend, attn, mlp, self._norm(weights, f"{p}input_layernorm.weight"),
                            self._norm(weights, f"{p}post_attention_layernorm.weight"),
                            self.config.rms_norm_eps, i == 0)

    def _merge_inputs(self, batch, residual):
        """A multimodal family's embeddings written over its placeholder tokens' rows."""
        raise ValueError(f"{self.config.architecture} takes no images")

    def _final_norm(self, hidden, residual):
        """In place: residual += hidden; hidden = the final norm of residual."""
        self.backend.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)

    def _rope_cache(self, i: int):
        """The cos/sin cache layer i rotates with."""
        return self.cos_sin_cache

    # ---- weight placement

    def _norm(self, weights: dict, name: str):
        """An RMSNorm weight, with the family's norm_offset added in float32."""
        if not self.norm_offset:
            return self._take(weights, name)
        w = np.asarray(weights.pop(name), dtype=np.float32) + np.float32(self.norm_offset)
        return self.backend.place_weight(w)

    def _take(self, weights: dict, name: str, role: str | None = None):
        """The weight `name`, placed by the backend; role: backend.place_weight's."""
        w = weights.pop(name)
        if not isinstance(w, np.ndarray):       # packed (ggml blocks, int4, fp8): kept as is
            return self.backend.place_weight(w, role=role)
        return self.backend.place_weight(np.ascontiguousarray(w), role=role)

    def _fuse(self, weights: dict, names: list[str], role: str | None = None):
        parts = [weights.pop(n) for n in names]
        for xp in (np, self.xp):      # host arrays, or arrays made on the device
            if all(isinstance(p, xp.ndarray) for p in parts):
                return self.backend.place_weight(xp.concatenate(parts, axis=0), role=role)
        # packed weights (ggml blocks, int4, fp8) of one kind stack along N themselves
        if all(type(p) is type(parts[0]) and hasattr(p, "concat") for p in parts):
            return self.backend.place_weight(type(parts[0]).concat(parts), role=role)
        raise ValueError(f"cannot fuse {[type(p).__name__ for p in parts]}: {names}")

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of each layer's K (and V) cache: float32, or uint8 e4m3 codes for an FP8 cache."""
        return (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype) -> list:
        """Per layer (K cache, V cache) of kv_cache_shape, zeroed, on the backend."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        return [(self.xp.zeros(shape, dtype), self.xp.zeros(shape, dtype))
                for _ in range(self.num_layers)]

    def forward(self, batch: ForwardBatch, kv_caches: list, hidden_indices=None,
                capture: "AuxCapture | FinalCapture | None" = None):
        """Logits (len(batch.logits_indices), vocab) float32, a new array each call; the batch's
        arrays and the logits live where the backend computes (NumPy or CuPy). With
        `hidden_indices` (rows to pool for embeddings), returns (logits, their final-norm hidden
        states (len(hidden_indices), hidden)). With `capture`, its `states` are set to every
        row's residual stream entering its layers (an AuxCapture: EAGLE-3), or every row's
        final-norm hidden state (a FinalCapture: MTP)."""
        c, b, ws = self.config, self.backend, self.workspace
        T = batch.num_tokens
        residual = ws.get("residual", T, c.hidden_size)
        hidden = ws.get("hidden", T, c.hidden_size)
        stage = c.pipeline
        if stage is None or stage.first:
            tensor_parallel.embed(b, c, batch.token_ids, self.embed_tokens, residual)
            if self.embed_scale is not None:
                b.scale(residual, self.embed_scale)
            if batch.vision is not None:       # image embeddings at the image tokens
                self._merge_inputs(batch, residual)
        else:           # the stream from the stage before (engine/parallel/pipeline.py)
            stage.receive_stream(residual)
        if c.rope.rope_type == "longrope":
            batch = dataclasses.replace(batch, positions=longrope_positions(
                self.xp, batch.positions, batch.query_start_loc, batch.seq_lens,
                c.rope.original_max_position_embeddings, c.max_model_len))
        if capture is None or not capture.layers:
            run_layers(self.layers, batch, hidden, residual, kv_caches, ws)
        else:
            capture.states = self._run_layers_capturing(batch, hidden, residual, kv_caches,
                                                        capture.layers)
        if stage is not None and not stage.last:
            self._send_to_next_stage(hidden, residual)
            return None
        # Only the sampled (and pooled) rows go through the final norm, the sampled ones through
        # the lm_head; every row with a FinalCapture (an MTP head reads them all).
        idx = batch.logits_indices
        num_logits = len(idx)
        if hidden_indices is not None:
            idx = self.xp.concatenate([idx, hidden_indices])
        if capture is not None and capture.final:
            states = self.xp.empty(hidden.shape, dtype=hidden.dtype)
            self.xp.copyto(states, hidden)
            if T:
                self._final_norm(states, residual)
            capture.states = states
            rows_hidden = self.xp.ascontiguousarray(states[idx])
        else:
            rows_hidden = self.xp.ascontiguousarray(hidden[idx])
            rows_residual = self.xp.ascontiguousarray(residual[idx])
            if len(idx):
                self._final_norm(rows_hidden, rows_residual)
        logits = self.logits(rows_hidden[:num_logits])
        if hidden_indices is None:
            return logits
        return logits, rows_hidden[num_logits:]

    def _run_layers_capturing(self, batch, hidden, residual, kv_caches, layers):
        """run_layers, stopping before each of `layers` (ascending) to copy the residual stream
        entering it (residual + the previous layer's output in `hidden`; the embeddings for
        layer 0) into its columns of a new (T, len(layers) * hidden) array."""
        b, xp, ws, H = self.backend, self.xp, self.workspace, self.config.hidden_size
        T = hidden.shape[0]
        states = xp.empty((T, len(layers) * H), dtype=hidden.dtype)
        start = 0
        for j, layer in enumerate(layers):
            run_layers(self.layers[start:layer], batch, hidden, residual, kv_caches[start:layer],
                       ws)
            start = layer
            if layer == 0:
                xp.copyto(states[:, :H], residual)
                continue
            # The op table has no plain add: the fused add's sum (its normalized output is
            # unused), on copies so the stream is left as it was.
            total, part = ws.get("aux_total", T, H), ws.get("aux_part", T, H)
            xp.copyto(total, residual)
            xp.copyto(part, hidden)
            b.fused_add_rms_norm(part, total, self._ones(), self.config.rms_norm_eps)
            xp.copyto(states[:, j * H:(j + 1) * H], total)
        run_layers(self.layers[start:], batch, hidden, residual, kv_caches[start:], ws)
        return states

    def _ones(self):
        """A norm weight of ones: the op table has no plain add, a fused add-and-norm's sum is
        one (its normalized output unused)."""
        if self._unit_norm is None:
            self._unit_norm = self.backend.place_weight(np.ones(self.config.hidden_size,
                                                                np.float32))
        return self._unit_norm

    def logits(self, rows_hidden):
        """Logits (len(rows_hidden), vocab) float32 of final-norm hidden rows, a new array."""
        c = self.config
        if not len(rows_hidden):    # (every tensor-parallel rank has the same rows)
            vocab = c.vocab_size if c.tensor_parallel is None else c.tensor_parallel.vocab_size
            return self.xp.empty((0, vocab), dtype=np.float32)
        if self.lm_head is None:
            raise ValueError("this checkpoint has no lm_head: it computes embeddings only")
        logits = tensor_parallel.logits(self.backend, c, rows_hidden, self.lm_head)
        if c.final_softcap:
            self.backend.softcap(logits, c.final_softcap)
        return logits

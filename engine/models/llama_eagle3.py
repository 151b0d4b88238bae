"""An EAGLE-3 head (Li et al. 2025): a one-layer Llama decoder that drafts tokens for its target
from the target's own hidden states, in the checkpoint format vLLM loads (SafeAILab's EAGLE-3
checkpoints, `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM`, and vllm-project/speculators'
`Eagle3Speculator`).

The computation, for a row at position p holding token t (the token *after* p: the head reads
the target's features of p and the next token, and predicts the one after that):

    e = input_layernorm(embed(t))                    (embed: the head's, else the target's)
    h = fc(aux) for the first draft step,            aux: the target's residual stream entering
        the previous row's output (prenorm) after     its layers `aux_layer_ids` (vLLM's default
                                                      2, L // 2, L - 3), side by side
    residual = h, or hidden_norm(h) with norm_before_residual
    x = attention(concat(e, hidden_norm(h)))          q/k/v read 2H features; RoPE at p
    residual += x;  x = mlp(post_attention_layernorm(residual));  residual += x
    further layers, if any: ordinary Llama layers over (x, residual)
    prenorm = residual (fed to the next draft step);  logits = lm_head(norm(prenorm))

over the draft vocabulary, whose id i is the target's id i + d2t[i] (every other target id gets
-inf: the head never proposes it). The head keeps K/V of its own for every position, like any
decoder: engine/spec/eagle3.py says which rows it computes when.

Weight names as stored: `fc.weight`, `midlayer.*` (EAGLE's) or `layers.N.*` (speculators'),
optionally under `model.`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (not needed here),
`embed_tokens.weight` (optional).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine.models.llama import check_weights
from engine.models.model_config import ModelConfig
from engine.models.rotary import build_cos_sin_cache
from engine.runner.forward_batch import ForwardBatch
from pyx.layers import MLP, Attention, DecoderLayer, Workspace, run_layers

logger = logging.getLogger("taper.models")

# config.json `architectures` of an EAGLE-3 head (EAGLE's, vLLM's, speculators')
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's choice (and EAGLE's training code's) when the head names none: an early, the
    middle and a late layer of the target."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(slots=True)
class Eagle3Config:
    layer: ModelConfig                  # the decoder layers' shapes, RoPE and eps (Llama's)
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...] | None   # as the head's config gives them (None: the default)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @classmethod
    def from_dict(cls, cfg: dict) -> "Eagle3Config":
        archs = cfg.get("architectures") or []
        speculators = cfg.get("speculators_model_type")
        if speculators is not None or "transformer_layer_config" in cfg:
            if speculators != "eagle3":
                raise ValueError(f"a speculators checkpoint of type {speculators!r}, not eagle3")
            layer_cfg = cfg.get("transformer_layer_config")
            if not isinstance(layer_cfg, dict):
                raise ValueError("a speculators eagle3 config needs transformer_layer_config")
            default_norm_before_residual = True      # speculators' default, as vLLM reads it
        elif any(a in ARCHITECTURES for a in archs):
            layer_cfg, default_norm_before_residual = cfg, False
        else:
            raise ValueError(f"not an EAGLE-3 head: architectures {archs or '(none given)'}, "
                             f"expected one of {', '.join(ARCHITECTURES)}")
        eagle = cfg.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError("eagle_config.use_aux_hidden_state false (a head fed the target's "
                             "last hidden state, EAGLE-1/2 style) is not supported")
        if cfg.get("norm_before_fc"):
            raise ValueError("norm_before_fc is not supported")
        layer = ModelConfig.from_dict({**layer_cfg, "architectures": ["LlamaForCausalLM"]})
        layer.architecture = next((a for a in archs if a in ARCHITECTURES), "Eagle3Speculator")
        if layer.rope.rope_type == "longrope":
            raise ValueError("an EAGLE-3 head with LongRoPE is not supported")
        draft_vocab = cfg.get("draft_vocab_size") or layer.vocab_size
        target_hidden = cfg.get("target_hidden_size") or layer.hidden_size
        ids = (cfg.get("eagle_aux_hidden_state_layer_ids")
               or eagle.get("eagle_aux_hidden_state_layer_ids"))
        for name, value in (("draft_vocab_size", draft_vocab),
                            ("target_hidden_size", target_hidden)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if ids is not None:
            if (not isinstance(ids, (list, tuple)) or not ids
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a list of layer "
                                 f"indices, got {ids!r}")
            ids = tuple(ids)
        return cls(layer, draft_vocab, target_hidden,
                   bool(cfg.get("norm_before_residual", default_norm_before_residual)), ids)

    def aux_layers_for(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs the head reads, ascending (the order vLLM concatenates
        them in, whatever the config's order), checked against the target."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        named = "eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids else (
            f"the default aux layers {list(ids)} (none named in the head's config)")
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"{named}: layer {bad[0]} is not one of the target's "
                             f"{num_target_layers} layers")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{named} name a layer twice ({list(ids)}); the target "
                             f"has {num_target_layers} layers")
        return tuple(sorted(ids))


def normalize_names(weights: dict) -> dict:
    """The stored names under one scheme: `layers.N.` (EAGLE's `midlayer.` is layer 0), no
    `model.` prefix."""
    out = {}
    for name, w in weights.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        out[name] = w
    return out


def expected_shapes(config: Eagle3Config, num_aux: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the head reads by its normalized name (embed_tokens and d2t aside)."""
    c = config.layer
    H, I = c.hidden_size, c.intermediate_size
    shapes = {"fc.weight": (H, num_aux * config.target_hidden_size), "norm.weight": (H,),
              "lm_head.weight": (config.draft_vocab_size, H)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        width = 2 * H if i == 0 else H           # the first layer reads concat(embeds, hidden)
        for name, shape in {"q_proj": (c.q_size, width), "k_proj": (c.kv_size, width),
                            "v_proj": (c.kv_size, width)}.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
        shapes[f"{p}self_attn.o_proj.weight"] = (H, c.q_size)
        if c.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (H,)
        for name, shape in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
        shapes[f"{p}input_layernorm.weight"] = (H,)
        shapes[f"{p}post_attention_layernorm.weight"] = (H,)
        if i == 0:
            shapes[f"{p}hidden_norm.weight"] = (H,)
    return shapes


def draft_to_target(d2t, draft_vocab_size: int, target_vocab_size: int) -> np.ndarray:
    """The target id of each draft id (int64): i + d2t[i], or i without a d2t when the two
    vocabularies are one."""
    if d2t is None:
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} differs from the "
                             f"target's vocabulary ({target_vocab_size} ids) and the checkpoint "
                             f"has no d2t tensor mapping draft ids to target ids")
        return np.arange(draft_vocab_size, dtype=np.int64)
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab_size,) or d2t.dtype.kind not in "iu":
        raise ValueError(f"d2t must be ({draft_vocab_size},) integers "
                         f"(draft_vocab_size), got {list(d2t.shape)} {d2t.dtype}")
    targets = np.arange(draft_vocab_size, dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((targets < 0) | (targets >= target_vocab_size))
    if bad.size:
        raise ValueError(f"d2t maps draft id {int(bad[0])} to {int(targets[bad[0]])},"
                         f" outside the target's vocabulary of {target_vocab_size} ids")
    if np.unique(targets).size != targets.size:
        raise ValueError("d2t maps two draft ids to one target id")
    return targets


class Eagle3Head:
    def __init__(self, config: Eagle3Config, weights: dict, backend, aux_layers: tuple[int, ...],
                 target_embed, target_vocab_size: int, max_positions: int):
        """Takes ownership of `weights` (normalized names, popped as placed). target_embed: the
        target's placed embedding table, used when the head has none of its own; max_positions:
        the positions its RoPE cache covers (the target's context)."""
        self.config = config
        self.backend = backend
        self.xp = backend.xp
        self.aux_layers = aux_layers
        self.target_vocab_size = target_vocab_size
        c = config.layer
        check_weights(c, weights, expected_shapes(config, len(aux_layers)))
        self.draft_ids = draft_to_target(weights.pop("d2t", None), config.draft_vocab_size,
                                         target_vocab_size)
        self.draft_ids_device = backend.asarray(self.draft_ids)
        self.same_vocab = (config.draft_vocab_size == target_vocab_size
                           and bool((self.draft_ids == np.arange(target_vocab_size)).all()))
        weights.pop("t2d", None)
        embed = weights.pop("embed_tokens.weight", None)
        if embed is None:
            if target_embed is None:
                raise ValueError("it has no embed_tokens, and the target's embedding is not "
                                 "available whole (a quantized embedding split by tensor "
                                 "parallel)")
            self.embed_tokens = target_embed
            self.embed_vocab_size = target_vocab_size
        else:
            self.embed_vocab_size = c.vocab_size
            if tuple(embed.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"embed_tokens.weight has shape "
                                 f"{list(embed.shape)}, expected {[c.vocab_size, c.hidden_size]}")
            self.embed_tokens = self._place(embed)
        self.fc = self._take(weights, "fc.weight")
        cache = build_cos_sin_cache(c.rope, c.max_position_embeddings,
                                    max(max_positions, c.max_model_len))
        self.cos_sin_cache = backend.asarray(cache)
        self.workspace = Workspace(self.xp, backend.act_dtype)
        eps = c.rms_norm_eps
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            names = [f"{p}self_attn.{n}_proj" for n in "qkv"]
            attn = Attention(
                backend, self._fuse(weights, [f"{n}.weight" for n in names]),
                self._fuse(weights, [f"{n}.bias" for n in names]) if c.qkv_bias else None,
                self._take(weights, f"{p}self_attn.o_proj.weight"),
                self._take(weights, f"{p}self_attn.o_proj.bias") if c.o_bias else None,
                None, None, self.cos_sin_cache, c.num_attention_heads, c.num_key_value_heads,
                c.head_dim, eps, c.sliding_windows[i], c.rope.is_neox)
            gate_up = self._fuse(weights, [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"])
            gate_up_bias = (self._fuse(weights, [f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"])
                            if c.mlp_bias else None)
            mlp = MLP(backend, gate_up, gate_up_bias, self._take(weights, f"{p}mlp.down_proj.weight"),
                      self._take(weights, f"{p}mlp.down_proj.bias") if c.mlp_bias else None,
                      act=c.hidden_act)
            input_norm = self._take(weights, f"{p}input_layernorm.weight")
            post_norm = self._take(weights, f"{p}post_attention_layernorm.weight")
            if i == 0:
                self.attention, self.mlp = attn, mlp
                self.input_norm, self.post_norm = input_norm, post_norm
                self.hidden_norm = self._take(weights, f"{p}hidden_norm.weight")
            else:     # an ordinary layer over (hidden, residual): the first's output
                self.layers.append(DecoderLayer(backend, attn, mlp, input_norm, post_norm, eps,
                                                False))
        self.norm = self._take(weights, "norm.weight")
        self.lm_head = self._take(weights, "lm_head.weight")
        if weights:
            logger.warning("EAGLE-3 head: ignoring %d unused tensors, e.g. %s", len(weights),
                           next(iter(weights)))
        weights.clear()

    # ---- weight placement

    def _place(self, w):
        return self.backend.place_weight(np.ascontiguousarray(w))

    def _take(self, weights: dict, name: str):
        return self._place(weights.pop(name))

    def _fuse(self, weights: dict, names: list[str]):
        return self._place(np.concatenate([weights.pop(n) for n in names], axis=0))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        c = self.config.layer
        return (num_blocks, block_size, c.num_key_value_heads, c.head_dim)

    # ---- the graph

    def fuse(self, aux):
        """The first draft step's hidden input: fc over the target's aux states (T, n * Ht)
        -> (T, H), a new array in the activation dtype."""
        out = self.xp.empty((aux.shape[0], self.config.hidden_size), dtype=aux.dtype)
        if len(aux):
            self.backend.linear(aux, self.fc, None, out)
        return out

    def forward(self, batch: ForwardBatch, kv_caches: list, hidden, kv_only: bool = False):
        """Rows of `batch` (tokens, positions, slots: module docstring) with their hidden inputs
        `hidden` (T, H) (fused target features, or a previous step's prenorm output). Writes the
        rows' K/V; returns (final-norm hidden, prenorm hidden), new (T, H) arrays, or with
        `kv_only` None once every layer's K/V is written."""
        c, b, xp, ws = self.config.layer, self.backend, self.xp, self.workspace
        T, H, eps = batch.num_tokens, c.hidden_size, c.rms_norm_eps
        embeds = ws.get("embeds", T, H)
        b.embedding(batch.token_ids, self.embed_tokens, embeds)
        normed = ws.get("normed", T, H)
        x = ws.get("x", T, 2 * H)
        b.rms_norm(embeds, self.input_norm, eps, normed)
        xp.copyto(x[:, :H], normed)
        b.rms_norm(hidden, self.hidden_norm, eps, normed)
        xp.copyto(x[:, H:], normed)
        residual = xp.empty((T, H), dtype=normed.dtype)      # returned: not a workspace buffer
        xp.copyto(residual, normed if self.config.norm_before_residual else hidden)
        out = ws.get("attn_out", T, H)
        k_cache, v_cache = kv_caches[0]
        self.attention.forward(batch, x, out, k_cache, v_cache, ws)
        if kv_only and not self.layers:
            return None
        b.fused_add_rms_norm(out, residual, self.post_norm, eps)
        mlp_out = ws.get("mlp_out", T, H)
        self.mlp.forward(out, mlp_out, ws)
        if self.layers:
            run_layers(self.layers, batch, mlp_out, residual, kv_caches[1:], ws)
        final = xp.empty((T, H), dtype=normed.dtype)
        xp.copyto(final, mlp_out)
        b.fused_add_rms_norm(final, residual, self.norm, eps)
        return final, residual

    def logits(self, rows_hidden):
        """Logits over the target's vocabulary (len(rows_hidden), V) float32 of final-norm rows:
        the draft vocabulary's at their target ids, -inf elsewhere."""
        xp = self.xp
        n = len(rows_hidden)
        draft = xp.empty((n, self.config.draft_vocab_size), dtype=np.float32)
        if n:
            self.backend.linear(rows_hidden, self.lm_head, None, draft)
        if self.same_vocab:
            return draft
        out = xp.full((n, self.target_vocab_size), -np.inf, dtype=np.float32)
        out[:, self.draft_ids_device] = draft
        return out

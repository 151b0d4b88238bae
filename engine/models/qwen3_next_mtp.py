"""The multi-token-prediction (MTP) head Qwen3-Next and Qwen3.5 checkpoints ship (the mtp.*
tensors transformers skips on load), as speculative decoding's drafter (engine/spec/mtp.py),
computed as vLLM's qwen3_next_mtp.py computes it.

For a row at position p holding token t (the token *after* p) and a hidden state h:

    x = fc(concat(pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h)))    fc (H, 2H), no bias
    one full-attention Qwen3-Next decoder layer over x (mtp.layers.0): gated attention with its
        own paged K/V (RoPE at p), then the sparse MoE or a dense MLP, as the layer's tensors say
        (mlp.gate present: MoE)
    out = norm(the residual stream after the layer)
    logits = the target's lm_head(out)

Every norm multiplies by 1 + w, as the target's do. The embedding and lm_head are the target's
(the checkpoints have none of their own), and no row's embedding is zeroed (vLLM masks position
0 for DeepSeek's MTP only). h is the target's final-norm output at p for the first draft step,
and the head's own output `out` of the previous step for each further one (vLLM's chaining:
Qwen3-Next's MTP forward returns the normed state). A checkpoint with more than one MTP layer
drafts with the first at every step (engine/models/deepseek_mtp.py says why).

Tensor names as stored: mtp.fc.weight, mtp.pre_fc_norm_embedding.weight,
mtp.pre_fc_norm_hidden.weight, mtp.norm.weight, and mtp.layers.{j}.* a full-attention decoder
layer's own (self_attn.q_proj holding queries and output gates, k_proj, v_proj, o_proj, q_norm,
k_norm; mlp.*; input_layernorm, post_attention_layernorm).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from engine.models.llama import LlamaForCausalLM, check_weights
from engine.models.qwen3_next import hybrid_shapes
from engine.parallel import layers as tensor_parallel
from engine.runner.forward_batch import ForwardBatch
from pyx.layers import Workspace

logger = logging.getLogger("taper.models")

PREFIX = "mtp."
LAYER = "mtp.layers.0."


def mtp_shapes(c, sparse: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor the head reads, by its stored name: a full-attention decoder layer's (as the
    target's graph names them for a layer after its last, renamed) and the head's own."""
    N, H = c.num_hidden_layers, c.hidden_size
    la = dataclasses.replace(c.linear_attention,
                             layer_types=list(c.linear_attention.layer_types) + ["full_attention"])
    moe = (None if c.moe is None else
           dataclasses.replace(c.moe, sparse_layers=list(c.moe.sparse_layers) + [sparse]))
    p = f"model.layers.{N}."
    shapes = {LAYER + n[len(p):]: s for n, s in hybrid_shapes(dataclasses.replace(
        c, num_hidden_layers=N + 1, linear_attention=la, moe=moe)).items() if n.startswith(p)}
    shapes.update({f"{PREFIX}fc.weight": (H, 2 * H), f"{PREFIX}norm.weight": (H,),
                   f"{PREFIX}pre_fc_norm_embedding.weight": (H,),
                   f"{PREFIX}pre_fc_norm_hidden.weight": (H,)})
    return shapes


class Qwen3NextMtpHead:
    def __init__(self, target):
        """Takes the target's (a Qwen3NextForCausalLM's) mtp_weights, placed as the target places
        its own layers; its embedding and lm_head are shared."""
        c = target.config
        self.config = c
        self.backend, self.xp = target.backend, target.xp
        weights = target.mtp_weights
        layers = sorted({int(n.split(".")[2]) for n in weights if n.startswith("mtp.layers.")})
        if layers and layers[0] != 0:
            raise ValueError(f"the multi-token-prediction tensors start at mtp.layers."
                             f"{layers[0]}, expected mtp.layers.0")
        if len(layers) > 1:
            logger.info("MTP: drafting with layer mtp.layers.0 at every step; layers %s are not "
                        "used", layers[1:])
        own = {n: weights.pop(n) for n in list(weights)
               if not n.startswith("mtp.layers.") or n.startswith(LAYER)}
        sparse = f"{LAYER}mlp.gate.weight" in own
        if sparse and c.moe is None:
            raise ValueError(f"{c.architecture} checkpoint: its MTP layer has mixture-of-experts "
                             f"tensors ({LAYER}mlp.gate.weight), the target's config no experts")
        check_weights(c, own, mtp_shapes(c, sparse))
        if target.lm_head is None:
            raise ValueError("MTP: the checkpoint has no lm_head")
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        N = c.num_hidden_layers
        self.norm_embedding = target._norm(own, f"{PREFIX}pre_fc_norm_embedding.weight")
        self.norm_hidden = target._norm(own, f"{PREFIX}pre_fc_norm_hidden.weight")
        self.fc = target._take(own, f"{PREFIX}fc.weight")
        self.norm = target._norm(own, f"{PREFIX}norm.weight")
        # under tensor parallel the rank's heads and MLP share, each all-reduced (as the
        # target's layers are)
        self.attention = tensor_parallel.all_reduced_attention(
            target._gated_attention(own, LAYER, N), c)
        self.mlp = tensor_parallel.all_reduced(
            target._moe(own, LAYER) if sparse else LlamaForCausalLM._mlp(target, own, LAYER, N),
            c)
        self.input_norm = target._norm(own, f"{LAYER}input_layernorm.weight")
        self.post_norm = target._norm(own, f"{LAYER}post_attention_layernorm.weight")
        self.sparse = sparse
        self.kv_cache_shape = target.kv_cache_shape
        self.workspace = Workspace(self.xp, self.backend.act_dtype)
        unused = [n for n in own if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            logger.warning("MTP: ignoring %d unused tensors, e.g. %s", len(unused), unused[0])
        weights.clear()

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def describe(self) -> str:
        return f"mtp.layers.0, {'MoE' if self.sparse else 'dense MLP'}"

    def bytes_per_block(self, block_size: int, kv_dtype, act_dtype) -> int:
        """The head's K/V and the feature pool's bytes for one of the target's blocks."""
        c = self.config
        return block_size * (2 * c.num_key_value_heads * c.head_dim * np.dtype(kv_dtype).itemsize
                             + c.hidden_size * np.dtype(act_dtype).itemsize)

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype) -> list:
        """The layer's (K, V) paged caches, zeroed."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        return [(self.xp.zeros(shape, dtype), self.xp.zeros(shape, dtype))]

    def fuse(self, states):
        """The first draft step's hidden input: the target's final-norm states as they are."""
        return states

    def forward(self, batch: ForwardBatch, kv_caches: list, hidden, kv_only: bool = False,
                first_rows=None):
        """Rows of `batch` with their hidden inputs `hidden` (T, H) (`first_rows`: unused, no
        row is masked). Writes the rows' K/V; returns (out, out): the normed output, which is
        both the lm_head's input and the next step's hidden input; with `kv_only` None once the
        cache is written."""
        c, b, xp, ws = self.config, self.backend, self.xp, self.workspace
        T, H, eps = batch.num_tokens, c.hidden_size, c.rms_norm_eps
        embeds = ws.get("mtp_embeds", T, H)
        tensor_parallel.embed(b, c, batch.token_ids, self.embed_tokens, embeds)
        normed = ws.get("mtp_normed", T, H)
        x = ws.get("mtp_x", T, 2 * H)
        b.rms_norm(embeds, self.norm_embedding, eps, normed)
        xp.copyto(x[:, :H], normed)
        b.rms_norm(hidden, self.norm_hidden, eps, normed)
        xp.copyto(x[:, H:], normed)
        residual = ws.get("mtp_residual", T, H)
        if T:
            b.linear(x, self.fc, None, residual)
        b.rms_norm(residual, self.input_norm, eps, normed)
        out = ws.get("mtp_attn_out", T, H)
        k_cache, v_cache = kv_caches[0]
        self.attention.forward(batch, normed, out, k_cache, v_cache, ws)
        if kv_only:
            return None
        b.fused_add_rms_norm(out, residual, self.post_norm, eps)
        final = xp.empty((T, H), dtype=normed.dtype)     # returned: not a workspace buffer
        self.mlp.forward(out, final, ws)
        b.fused_add_rms_norm(final, residual, self.norm, eps)
        return final, final

    def logits(self, rows_hidden):
        """Logits (len(rows_hidden), vocab) float32 of the head's output rows (under tensor
        parallel the target's head's shares gathered)."""
        c = self.config
        if not len(rows_hidden):
            V = c.vocab_size if c.tensor_parallel is None else c.tensor_parallel.vocab_size
            return self.xp.empty((0, V), dtype=np.float32)
        return tensor_parallel.logits(self.backend, c, rows_hidden, self.lm_head)

"""The multi-token-prediction (MTP) head a DeepSeek-V3-style checkpoint ships (DeepSeek-V3 and R1,
GLM-4.7-Flash), as speculative decoding's drafter (engine/spec/mtp.py): the checkpoint's layer
model.layers.{N}, N the decoder's layer count, computed as vLLM's deepseek_mtp.py and SGLang's
deepseek_nextn.py compute it.

For a row at position p holding token t (the token *after* p) and a hidden state h:

    e = embed(t), zeroed at position 0          (vLLM's masking; embed: the layer's embed_tokens,
                                                 else the target's, which DeepSeek's releases copy)
    x = eh_proj(concat(enorm(e), hnorm(h)))      eh_proj (H, 2H), no bias
    one DeepSeek decoder layer over x: MLA (its own latent cache, RoPE at p), then DeepSeekMoE or
        a dense MLP, as the layer's tensors say (mlp.gate present: MoE)
    prenorm = the residual stream after the layer
    logits = shared_head.head(shared_head.norm(prenorm))   (the target's lm_head when the layer
                                                            has no shared_head.head)

h is the target's final-norm output at p (the lm_head's input: vLLM's and SGLang's DeepSeek
forwards return the normed hidden state, and that is what their drafters are handed) for the first
draft step, and the head's own prenorm output of the previous step for each further one (vLLM's
chaining when num_speculative_tokens exceeds num_nextn_predict_layers). A checkpoint with more
than one MTP layer drafts with the first at every step: the later layers would need K/V for every
earlier position, which only the first layer is given (engine/spec/mtp.py).

Tensor names as stored (under model.layers.{N}.): enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head (optional), embed_tokens (optional), and the decoder layer's own (self_attn.*,
mlp.*, input_layernorm, post_attention_layernorm).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from engine.models.deepseek import deepseek_shapes
from engine.models.llama import LlamaForCausalLM, check_weights
from engine.parallel import layers as tensor_parallel
from engine.runner.forward_batch import ForwardBatch
from pyx.layers import Workspace

logger = logging.getLogger("taper.models")


def mtp_layer_shapes(c, sparse: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor MTP layer N (N = c.num_hidden_layers) needs, by its stored name; its decoder
    layer's are those of a decoder layer of the same kind (MoE or dense)."""
    N, H = c.num_hidden_layers, c.hidden_size
    moe = dataclasses.replace(c.moe, sparse_layers=list(c.moe.sparse_layers) + [sparse])
    p = f"model.layers.{N}."
    shapes = {n: s for n, s in deepseek_shapes(dataclasses.replace(
        c, num_hidden_layers=N + 1, moe=moe)).items() if n.startswith(p)}
    shapes.update({f"{p}enorm.weight": (H,), f"{p}hnorm.weight": (H,),
                   f"{p}eh_proj.weight": (H, 2 * H), f"{p}shared_head.norm.weight": (H,)})
    return shapes


class DeepseekMtpHead:
    def __init__(self, target):
        """Takes the target's (a DeepseekForCausalLM's) mtp_weights, placed as the target places
        its own layers; its embedding and lm_head stand in for the layer's when it has none."""
        c = target.config
        self.config = c
        self.backend, self.xp = target.backend, target.xp
        weights = target.mtp_weights
        N = c.num_hidden_layers
        p = f"model.layers.{N}."
        layers = sorted({int(n.split(".")[2]) for n in weights})
        if layers[0] != N:
            raise ValueError(f"the multi-token-prediction tensors start at model.layers."
                             f"{layers[0]}, expected model.layers.{N} (after the {N} decoder "
                             f"layers)")
        if len(layers) > 1:
            logger.info("MTP: drafting with layer %d at every step; layers %s are not used",
                        N, layers[1:])
        own = {n: weights.pop(n) for n in list(weights) if n.startswith(p)}
        sparse = f"{p}mlp.gate.weight" in own
        check_weights(c, own, mtp_layer_shapes(c, sparse))
        # the whole vocabulary: under tensor parallel the head's own embedding and head are
        # replicated whole, the target's are the rank's vocab-parallel shares
        V = c.vocab_size if c.tensor_parallel is None else c.tensor_parallel.vocab_size
        H = c.hidden_size
        self.own_embed = p + "embed_tokens.weight" in own
        self.own_head = p + "shared_head.head.weight" in own
        for name in ("embed_tokens.weight", "shared_head.head.weight"):
            w = own.get(p + name)
            if w is not None and tuple(w.shape) != (V, H):
                raise ValueError(f"{c.architecture} checkpoint: tensor {p}{name} has shape "
                                 f"{list(w.shape)}, expected {[V, H]}")
        self.embed_tokens = (target._take(own, p + "embed_tokens.weight")
                             if p + "embed_tokens.weight" in own else target.embed_tokens)
        self.lm_head = (target._take(own, p + "shared_head.head.weight")
                        if p + "shared_head.head.weight" in own else target.lm_head)
        if self.lm_head is None:
            raise ValueError("MTP: the checkpoint has no lm_head and its MTP layer no "
                             "shared_head.head")
        self.enorm = target._norm(own, p + "enorm.weight")
        self.hnorm = target._norm(own, p + "hnorm.weight")
        self.eh_proj = target._take(own, p + "eh_proj.weight")
        self.norm = target._norm(own, p + "shared_head.norm.weight")
        self.attention = target._attention(own, p, N)
        self.mlp = tensor_parallel.all_reduced(  # (the attention is all-reduced already)
            target._moe(own, p) if sparse else LlamaForCausalLM._mlp(target, own, p, N), c)
        self.input_norm = target._norm(own, p + "input_layernorm.weight")
        self.post_norm = target._norm(own, p + "post_attention_layernorm.weight")
        self.sparse = sparse
        self.workspace = Workspace(self.xp, self.backend.act_dtype)
        unused = [n for n in own if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            logger.warning("MTP: ignoring %d unused tensors of layer %d, e.g. %s", len(unused),
                           N, unused[0])
        weights.clear()

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def describe(self) -> str:
        return (f"layer {self.config.num_hidden_layers}, "
                f"{'MoE' if self.sparse else 'dense MLP'}")

    def bytes_per_block(self, block_size: int, kv_dtype, act_dtype) -> int:
        """The latent cache's and the feature pool's bytes for one of the target's blocks: one
        layer's latent and a hidden row per token."""
        return block_size * (self.config.mla.latent_dim * np.dtype(kv_dtype).itemsize
                             + self.config.hidden_size * np.dtype(act_dtype).itemsize)

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype) -> list:
        """The layer's latent cache (the target's MLA layout: (NB, BS, 1, L + R)), zeroed, given
        as both K and V."""
        if np.dtype(dtype).itemsize == 1:
            raise ValueError("MTP: an FP8 KV cache is not supported for multi-head latent "
                             "attention yet; use --kv-cache-dtype auto")
        m = self.config.mla
        cache = self.xp.zeros((num_blocks, block_size, 1, m.latent_dim), dtype)
        return [(cache, cache)]

    def fuse(self, states):
        """The first draft step's hidden input: the target's final-norm states as they are."""
        return states

    def forward(self, batch: ForwardBatch, kv_caches: list, hidden, kv_only: bool = False,
                first_rows=None):
        """Rows of `batch` with their hidden inputs `hidden` (T, H); `first_rows` (host ints):
        the rows at position 0, whose embedding is zeroed. Writes the rows' latents; returns
        (final-norm hidden, prenorm hidden), new (T, H) arrays, or with `kv_only` None once the
        cache is written."""
        c, b, xp, ws = self.config, self.backend, self.xp, self.workspace
        T, H, eps = batch.num_tokens, c.hidden_size, c.rms_norm_eps
        embeds = ws.get("mtp_embeds", T, H)
        if self.own_embed:
            b.embedding(batch.token_ids, self.embed_tokens, embeds)
        else:
            tensor_parallel.embed(b, c, batch.token_ids, self.embed_tokens, embeds)
        if first_rows is not None and len(first_rows):
            # zeroed by allocation, not by a scalar fill (bf16 device arrays)
            embeds[b.asarray(np.asarray(first_rows, np.int64))] = xp.zeros(
                (len(first_rows), H), embeds.dtype)
        normed = ws.get("mtp_normed", T, H)
        x = ws.get("mtp_x", T, 2 * H)
        b.rms_norm(embeds, self.enorm, eps, normed)
        xp.copyto(x[:, :H], normed)
        b.rms_norm(hidden, self.hnorm, eps, normed)
        xp.copyto(x[:, H:], normed)
        residual = xp.empty((T, H), dtype=normed.dtype)      # returned: not a workspace buffer
        if T:
            b.linear(x, self.eh_proj, None, residual)
        b.rms_norm(residual, self.input_norm, eps, normed)
        out = ws.get("mtp_attn_out", T, H)
        cache, _ = kv_caches[0]       # (the latent, given as K and V)
        self.attention.forward(batch, normed, out, cache, cache, ws)
        if kv_only:
            return None
        b.fused_add_rms_norm(out, residual, self.post_norm, eps)
        final = xp.empty((T, H), dtype=normed.dtype)
        self.mlp.forward(out, final, ws)
        b.fused_add_rms_norm(final, residual, self.norm, eps)
        return final, residual

    def logits(self, rows_hidden):
        """Logits (len(rows_hidden), vocab) float32 of final-norm rows (under tensor parallel
        the target's head's shares gathered)."""
        c = self.config
        if self.own_head or not len(rows_hidden):
            V = c.vocab_size if c.tensor_parallel is None else c.tensor_parallel.vocab_size
            out = self.xp.empty((len(rows_hidden), V), dtype=np.float32)
            if len(rows_hidden):
                self.backend.linear(rows_hidden, self.lm_head, None, out)
            return out
        return tensor_parallel.logits(self.backend, c, rows_hidden, self.lm_head)

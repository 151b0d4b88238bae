"""The graph's tensor-parallel pieces, for a model whose config carries a TensorParallel
(engine/parallel/sharding.py): the layers of pyx/layers.pyx run unchanged on the rank's heads and
intermediate slice, and these add the collectives.

- Attention's o_proj and the MLP's (or MoE block's) down_proj are row-parallel: each rank's output
  is a partial sum, made whole by one all-reduce each (the bias is rank 0's alone: sharding.py).
- The embedding is vocab-parallel: a rank looks up the tokens in its share of the vocabulary and
  zero for the others, and the all-reduce adds the one non-zero row to zeros, which is exact.
  The zero comes from a zero row appended to the rank's table (a lookup, not a multiply by a
  mask, so no elementwise op is needed in the activation dtype).
- The LM head is vocab-parallel: each rank's logits for its share, all-gathered and trimmed to
  the vocabulary (the last share's padding rows dropped).
"""
from __future__ import annotations

import numpy as np

from pyx.layers import Attention


class RowParallelAttention(Attention):
    """Attention over the rank's heads, its output all-reduced across the ranks."""

    def __init__(self, comm, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm = comm

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        super().forward(batch, x, out, k_cache, v_cache, ws)
        self.comm.all_reduce(out)


class AllReduced:
    """A feed-forward block (MLP, MoE) over the rank's intermediate slice, its output
    all-reduced across the ranks."""

    def __init__(self, block, comm):
        self.block, self.comm = block, comm

    def forward(self, x, out, ws):
        self.block.forward(x, out, ws)
        self.comm.all_reduce(out)

    def __getattr__(self, name):
        return getattr(self.block, name)


class AllReducedAttention:
    """An attention layer of the family's own (ComposedAttention) over the rank's heads, its
    output all-reduced across the ranks."""

    def __init__(self, attention, comm):
        self.attention, self.comm = attention, comm

    def forward(self, batch, x, out, k_cache, v_cache, ws):
        self.attention.forward(batch, x, out, k_cache, v_cache, ws)
        self.comm.all_reduce(out)

    def __getattr__(self, name):
        return getattr(self.attention, name)


def all_reduced_attention(attention, config):
    tp = config.tensor_parallel
    return attention if tp is None else AllReducedAttention(attention, tp.comm)


def attention_class(config):
    """Attention, or RowParallelAttention bound to the rank's communicator."""
    tp = config.tensor_parallel
    if tp is None:
        return Attention
    return lambda *args, **kwargs: RowParallelAttention(tp.comm, *args, **kwargs)


def all_reduced(block, config):
    """block's output all-reduced; a block that reduces its own branches (Gemma 4's dense MLP and
    experts, each post-normed) says so with `all_reduced_inside`."""
    tp = config.tensor_parallel
    if tp is None or getattr(block, "all_reduced_inside", False):
        return block
    return AllReduced(block, tp.comm)


def with_zero_row(w):
    """The rank's embedding rows (share, H) and one zero row: a float array or ggml blocks (zero
    bytes are zero scales: a row of zeros). Copied straight from the (memory-mapped) share into
    the new table, so the share is not held twice."""
    def extended(rows):
        out = np.empty((rows.shape[0] + 1, *rows.shape[1:]), rows.dtype)
        out[:-1] = rows
        out[-1] = 0
        return out

    if isinstance(w, np.ndarray):
        return extended(w)
    from pyx.weights.ggml import QuantizedWeight
    ((qtype, blocks),) = w.quant_parts
    return QuantizedWeight.of(qtype, extended(blocks), w.k)


def embed(backend, config, token_ids, table, out) -> None:
    """out (T, H) = the embedding rows of token_ids (the whole vocabulary's, on every rank)."""
    tp = config.tensor_parallel
    if tp is None:
        backend.embedding(token_ids, table, out)
        return
    embed_share(backend, tp.comm, token_ids, table, tp.vocab_start, config.vocab_size, out)


def embed_share(backend, comm, token_ids, table, start: int, share: int, out) -> None:
    """out (T, width) = the rows of token_ids of a vocab-parallel table: this rank's rows
    [start, start + share) and a zero row after them (with_zero_row), all-reduced."""
    xp = backend.xp
    local = token_ids - np.int32(start)
    inside = (local >= 0) & (local < share)
    backend.embedding(xp.where(inside, local, share).astype(np.int32), table, out)
    comm.all_reduce(out)


def logits(backend, config, rows_hidden, lm_head, bias=None):
    """(len(rows_hidden), vocab) float32 logits, a new array: the rank's share through its head
    rows (a tied head's zero row gives a column that is dropped) and its share of the head's
    bias (Phi-2's), then all of them gathered."""
    tp = config.tensor_parallel
    xp = backend.xp
    n = len(rows_hidden)
    local = xp.empty((n, lm_head.shape[0]), dtype=np.float32)
    backend.linear(rows_hidden, lm_head, bias, local)
    if tp is None:
        return local
    share = config.vocab_size
    gathered = tp.comm.all_gather(xp.ascontiguousarray(local[:, :share]))  # (ranks, n, share)
    whole = gathered.transpose(1, 0, 2).reshape(n, tp.size * share)
    return xp.ascontiguousarray(whole[:, :tp.vocab_size])


def whole_vocab_rows(config, table):
    """The whole vocabulary's rows (V, H) of a vocab-parallel float table (every rank's share, the
    zero row dropped), gathered onto every rank (a collective), or None for a quantized table:
    for a part that runs whole on rank 0 and reads the target's embedding (an EAGLE-3 head)."""
    tp = config.tensor_parallel
    if tp is None:
        return table
    if getattr(table, "ndim", None) != 2 or hasattr(table, "quant_parts"):
        return None         # (the same on every rank: none of them gathers)
    share = config.vocab_size
    gathered = tp.comm.all_gather(table[:share])          # (ranks, share, H)
    whole = gathered.reshape(tp.size * share, gathered.shape[-1])[:tp.vocab_size]
    return whole.copy()

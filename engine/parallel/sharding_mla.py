"""The tensor-parallel cut of multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash), as vLLM
and SGLang split it: the heads across the ranks, the low-rank parts replicated.

    q_b_proj (q_proj without q_lora_rank)   column-parallel by head: the rank's heads' N + R rows
    kv_b_proj                               column-parallel by head: the rank's heads' N + V rows
    o_proj                                  row-parallel: the rank's heads' V input columns (one
                                            all-reduce after it, engine/parallel/layers.py)
    q_a_proj, kv_a_proj_with_mqa and their  replicated: every rank computes the whole latent and
      norms                                 writes it to its own latent cache (one "KV head"),
                                            which its heads' keys and values come from

The MLP, DeepSeekMoE's experts and shared experts split as any other family's (sharding.py).
"""
from __future__ import annotations

import re

from engine.parallel.cuts import Cut

_Q_UP = re.compile(r"\.self_attn\.(q_b_proj|q_proj)\.weight$")
_KV_UP = re.compile(r"\.self_attn\.kv_b_proj\.weight$")
_O = re.compile(r"\.self_attn\.o_proj\.weight$")


def mla_cut(name: str, mla, heads: int, rank: int):
    """The Cut of an MLA attention tensor for the rank holding `heads` heads from rank * heads on,
    or None when `name` is not one that splits by head (the caller's rules then apply)."""

    def by_head(per_head: int, axis: int):
        return Cut(axis, ((rank * heads * per_head, (rank + 1) * heads * per_head),))

    if _Q_UP.search(name):
        return by_head(mla.qk_head_dim, 0)
    if _KV_UP.search(name):
        return by_head(mla.qk_nope_head_dim + mla.v_head_dim, 0)
    if _O.search(name):
        return by_head(mla.v_head_dim, 1)
    return None

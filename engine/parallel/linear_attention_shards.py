"""The tensor-parallel cut of the hybrid linear-attention families (Qwen3-Next, Qwen3.5 and
Qwen3.5-MoE: engine/models/qwen3_next.py), as vLLM splits them: each rank holds a contiguous
share of the gated DeltaNet's key heads and of the value heads they serve, with their state.

    Qwen3-Next in_proj_qkvz / in_proj_ba  rows grouped per key head ([q k v z] / [b a] of the
                                          head and its value heads): the rank's key heads' groups
    Qwen3.5 in_proj_qkv, conv1d           channels [q k v], each in head order: the rank's key
                                          heads' q and k channels and its value heads' v
    Qwen3.5 in_proj_z                     the rank's value heads' rows
    in_proj_b / in_proj_a, A_log, dt_bias one per value head: the rank's
    out_proj                              row-parallel: the rank's value heads' input columns
    norm.weight                           replicated (one head wide, shared by the heads)
    gated attention's q_proj              each head's query then its gate: the rank's heads'
                                          (2 head_dim rows each)
    stacked experts (Qwen3.5-MoE as       every expert's intermediate slice (gate_up_proj's
      transformers 5 holds them)          rows of both halves, down_proj's columns), or under
                                          expert parallel the rank's experts whole

Everything else (the full-attention K/V heads, o_proj, MLPs and experts, the vocabulary) is cut as
for every family (engine/parallel/sharding.py). The rank's model then runs its heads alone: the
DeltaNet's conv and recurrent state rows hold its heads' channels only (a slot's bytes divided by
the ranks), and out_proj's partial sums are all-reduced (engine/parallel/layers.py).
"""
from __future__ import annotations

import dataclasses
import re

from engine.parallel.cuts import Cut, even

_LINEAR = re.compile(r"\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|"
                     r"in_proj_a|conv1d|out_proj)\.weight$|\.linear_attn\.(A_log|dt_bias)$")
_GATED_Q = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
# Qwen3.5-MoE's experts stacked as transformers 5 holds them: gate_up_proj (E, 2I, H), down_proj
# (E, H, I); under expert parallel the general plan gives the rank its experts' rows instead
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def check(config, size: int) -> None:
    """A clear error where the DeltaNet's heads do not split evenly across `size` ranks."""
    la = config.linear_attention
    if la.num_k_heads % size:
        raise ValueError(f"tensor parallel {size}: {config.architecture} has {la.num_k_heads} "
                         f"linear-attention key heads, not divisible by {size}")


def local(linear_attention, size: int):
    """The rank's share of the LinearAttentionConfig: its key heads and their value heads."""
    la = linear_attention
    return dataclasses.replace(la, num_k_heads=la.num_k_heads // size,
                               num_v_heads=la.num_v_heads // size)


def cut(plan, name: str, shape: tuple[int, ...]):
    """The Cut of a hybrid family's own tensor (see the module docstring), or None for a tensor
    the general plan cuts."""
    c, r, n = plan.config, plan.rank, plan.size
    if _GATED_Q.search(name) and shape[0] == 2 * c.q_size:
        a, b = plan.q_rows()
        return Cut(0, ((2 * a, 2 * b),))
    if (stacked := _STACKED.search(name)) and plan.experts is None:
        if stacked.group(1) == "gate_up_proj":          # every expert's gate rows, then up rows
            half = shape[1] // 2
            a, b = even(half, r, n, f"{name}'s halves")
            return Cut(1, ((a, b), (half + a, half + b)))
        return Cut(2, (even(shape[2], r, n, name),))
    m = _LINEAR.search(name)
    if m is None:
        return None
    la = c.linear_attention
    nk, nv, dk, dv = la.num_k_heads // n, la.num_v_heads // n, la.head_k_dim, la.head_v_dim
    k0, v0 = r * nk, r * nv                   # the rank's first key head and value head

    def rows(first, count, width, offset=0):
        return offset + first * width, offset + (first + count) * width

    channels = (rows(k0, nk, dk), rows(k0, nk, dk, la.key_dim),
                rows(v0, nv, dv, 2 * la.key_dim))          # q, k, v
    kind = m.group(1) or m.group(2)
    if kind == "in_proj_qkvz":
        return Cut(0, (rows(k0, nk, 2 * dk + 2 * (la.num_v_heads // la.num_k_heads) * dv),))
    if kind == "in_proj_ba":
        return Cut(0, (rows(k0, nk, 2 * (la.num_v_heads // la.num_k_heads)),))
    if kind in ("in_proj_qkv", "conv1d"):
        return Cut(0, channels)
    if kind == "in_proj_z":
        return Cut(0, (rows(v0, nv, dv),))
    if kind in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return Cut(0, (rows(v0, nv, 1),))
    return Cut(1, (rows(v0, nv, dv),))                     # out_proj

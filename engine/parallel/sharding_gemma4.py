"""Gemma 4's tensor-parallel cuts (engine/models/gemma4.py has the layout), beside the common plan
of engine/parallel/sharding.py:

  q/k/v/o_proj of layer i   as any family's, in layer i's own head size and KV heads (the full
                            layers' global_head_dim and num_global_key_value_heads, a KV head
                            replicated on the ranks whose query heads read it)
  q/k/v_norm                one head wide: whole on every rank
  experts.gate_up_proj      (E, 2I, H), gate rows first: each expert's rows of the rank's slice of
                            I, gate and up; experts.down_proj (E, H, I) the same slice of I;
                            under expert parallel both the rank's E / ranks experts, whole
                            (the dense MLP beside them still split within the ranks)
  router.*                  whole (every rank routes the same whole stream)
  embed_tokens_per_layer    (E2B/E4B) vocab-parallel as the embedding: ceil(V / ranks) rows,
                            the last share padded with zero rows
  per_layer_model_projection  (L * P, H) column-parallel, by layer: the rank's P / ranks rows of
                            each layer's P (its output gathered), so that a pipeline stage's
                            layers' rows are a contiguous part of the rank's
  per-layer gates, projections and norms  whole (engine/models/gemma4_per_layer.py)
  KV-shared layers          q/o_proj as any layer's; they read their source layer's cache, which
                            on each rank holds the KV heads of that rank's query heads
"""
from __future__ import annotations

import dataclasses
import re

from engine.parallel.cuts import Cut, even

ARCHITECTURE = "Gemma4ForCausalLM"

_ATTENTION = re.compile(r"\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight$")
_HEAD_NORM = re.compile(r"\.self_attn\.[qkv]_norm\.weight$")
_PER_LAYER_TABLE = "embed_tokens_per_layer.weight"
_PER_LAYER_PROJECTION = "per_layer_model_projection.weight"
# a layer's per-layer input gate and projection (not the common plan's gate_proj / o_proj)
_PER_LAYER_WHOLE = re.compile(r"\.(per_layer_input_gate|per_layer_projection)\.weight$")
_EXPERTS = re.compile(r"\.layers\.\d+\.experts\.(gate_up_proj|down_proj)$")


def check(plan) -> None:
    """Stops what this split does not cover, before anything is read."""
    s, n = plan.config.family, plan.size
    if s.per_layer_input_size:
        even(s.per_layer_input_size, 0, n, f"{ARCHITECTURE}'s hidden_size_per_layer_input")
    if s.full_kv_heads % n and n % s.full_kv_heads:
        raise ValueError(f"tensor parallel {n}: {ARCHITECTURE}'s full layers have "
                         f"{s.full_kv_heads} KV heads; a split needs their number to divide or be "
                         f"divisible by {n}")


def local_family(plan, family):
    """The rank's full-layer KV heads (the sliding layers' are the config's own) and share of
    the per-layer embedding's rows."""
    hkv, n = family.full_kv_heads, plan.size
    return dataclasses.replace(family, full_kv_heads=hkv // n if hkv % n == 0 else 1,
                               per_layer_vocab_size=-(-family.per_layer_vocab_size // n))


def _kv_rows(plan, hkv: int, d: int) -> tuple[int, int]:
    n, r = plan.size, plan.rank
    first = r * hkv // n if hkv % n == 0 else r // (n // hkv)
    count = hkv // n if hkv % n == 0 else 1
    return first * d, (first + count) * d


def cut(plan, name: str, shape: tuple[int, ...]):
    """A Cut, None (whole), or NotImplemented (the common plan's cut applies)."""
    c, s, r = plan.config, plan.config.family, plan.rank
    if _HEAD_NORM.search(name) or _PER_LAYER_WHOLE.search(name):
        return None
    if name.endswith(_PER_LAYER_TABLE):
        share = -(-shape[0] // plan.size)
        start = min(r * share, shape[0])
        return Cut(0, ((start, min(start + share, shape[0])),), pad_to=share)
    if name.endswith(_PER_LAYER_PROJECTION):
        P = s.per_layer_input_size
        a, b = even(P, r, plan.size, name)
        return Cut(0, tuple((i * P + a, i * P + b) for i in range(shape[0] // P)))
    if m := _ATTENTION.search(name):
        full = s.full_layers[int(m.group(1))]
        hkv, d = (s.full_kv_heads, s.full_head_dim) if full else (c.num_key_value_heads,
                                                                  c.head_dim)
        q = (r * plan.heads * d, (r + 1) * plan.heads * d)
        which = m.group(2)
        if which == "q":
            return Cut(0, (q,))
        if which == "o":
            return Cut(1, (q,))
        return Cut(0, (_kv_rows(plan, hkv, d),))
    if m := _EXPERTS.search(name):
        if plan.experts is not None:
            return Cut(0, (plan.experts,))
        if m.group(1) == "gate_up_proj":
            half = shape[1] // 2
            a, b = r * half // plan.size, (r + 1) * half // plan.size
            return Cut(1, ((a, b), (half + a, half + b)))
        return Cut(2, ((r * shape[2] // plan.size, (r + 1) * shape[2] // plan.size),))
    return NotImplemented

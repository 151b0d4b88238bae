"""A tensor-parallel rank's share of a GPTQ or AWQ 4-bit layer (engine/loader/quant_int4.py has
the layouts), cut from the memory-mapped checkpoint tensors before the loader converts them.

The layer is cut as its float (N, K) weight would be (engine/parallel/sharding.py's Cut):

  column-parallel (rows of N)   qweight, scales, qzeros along their N axis; where N is packed 8 to
                                a word (GPTQ's qzeros, AWQ's qweight and qzeros) the rank's rows
                                must be whole words; g_idx whole
  row-parallel (columns of K)   qweight along its K axis (GPTQ's packed 8 to a word), scales and
                                qzeros in whole quantization groups, g_idx renumbered from the
                                share's first group; with one group per row (group_size -1)
                                scales and qzeros are whole on every rank (a share's one group)

A share that is not whole groups or words, or an act-order g_idx under a row cut, stops the load
naming the tensor. The GPU's Marlin repack starts from these cut tensors (the Int4Weight's
sources), so it needs nothing of its own.
"""
from __future__ import annotations

import numpy as np

from engine.parallel.cuts import Cut, cut_array

SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
METHODS = ("gptq", "awq")


def layer_shape(method: str, qweight_shape) -> tuple[int, int]:
    """The layer's float (N, K) from its qweight's shape."""
    a, b = qweight_shape
    return (b, a * 8) if method == "gptq" else (b * 8, a)


def shard(plan, name: str, tensor, shapes: dict):
    """The rank's part of one GPTQ/AWQ tensor `name` (its layer's `.weight` cut by `plan`), or
    NotImplemented for a tensor of no such layer (sharding.py cuts it as any other)."""
    if not name.endswith(SUFFIXES):
        return NotImplemented
    q = plan.config.quantization_config
    method, group_size = q["quant_method"], q.get("group_size", q.get("q_group_size"))
    layer, suffix = name.rsplit(".", 1)
    qweight = f"{layer}.qweight"
    if qweight not in shapes:
        raise ValueError(f"{method} checkpoint: {name} belongs to no .qweight")
    n, k = layer_shape(method, shapes[qweight])
    cut = plan.cut(f"{layer}.weight", (n, k))
    if cut is None:
        return tensor
    check_cut(method, name, cut)
    if cut.axis == 0:
        return _rows(plan, name, tensor, suffix, method, cut)
    return _columns(plan, name, tensor, suffix, method, cut, k if group_size == -1 else group_size,
                    group_size == -1)


def check_cut(fmt: str, name: str, cut) -> None:
    """A quantized layer's tensors split only along a plain row or column cut: the embedding's
    and LM head's vocabulary cut (padded, or of another kind) has no quantized form."""
    if not isinstance(cut, Cut) or cut.pad_to:
        raise ValueError(f"tensor parallel: {fmt} {name}: a quantized embedding or LM head "
                         "cannot be split across ranks")


def whole_units(plan, name, cut: Cut, unit: int, what: str, axis: int) -> Cut:
    """cut's ranges in units of `unit` elements, along `axis` of the stored tensor."""
    ranges = []
    for a, b in cut.ranges:
        if a % unit or b % unit:
            side = "output rows" if cut.axis == 0 else "input columns"
            raise ValueError(f"tensor parallel {plan.size}: {name}: the rank's {side} [{a}, {b}) "
                             f"are not whole {unit}-element {what}, so it cannot be split")
        ranges.append((a // unit, b // unit))
    return Cut(axis, tuple(ranges))


def _rows(plan, name, tensor, suffix, method, cut: Cut):
    """Column-parallel: the rank's output rows (N)."""
    if suffix == "g_idx":
        return tensor
    if suffix == "qzeros" or (method == "awq" and suffix == "qweight"):
        return cut_array(tensor, whole_units(plan, name, cut, 8, "words (8 codes each)", 1))
    return cut_array(tensor, Cut(1, cut.ranges))


def _columns(plan, name, tensor, suffix, method, cut: Cut, g: int, per_channel: bool):
    """Row-parallel (one range of K): the rank's input columns, in whole quantization groups."""
    ((a, b),) = cut.ranges
    if not per_channel:
        groups = whole_units(plan, name, cut, g, "quantization groups", 0)
    if suffix == "qweight":
        if method == "gptq":
            return cut_array(tensor, whole_units(plan, name, cut, 8, "words (8 codes each)", 0))
        return cut_array(tensor, Cut(0, cut.ranges))
    if suffix in ("scales", "qzeros"):
        return tensor if per_channel else cut_array(tensor, groups)
    return in_order_g_idx(plan, name, tensor, a, b, g)


def in_order_g_idx(plan, name: str, g_idx, a: int, b: int, g: int) -> np.ndarray:
    """A g_idx's input columns [a, b), renumbered from the share's first group: only in order
    (k // G) does each column's group stay with its column's share."""
    got = np.asarray(g_idx[a:b])
    if not np.array_equal(got, np.arange(a, b) // g):
        raise ValueError(f"tensor parallel {plan.size}: {name} is an act-order g_idx (groups not "
                         f"in order k // group_size), so its input rows cannot be cut across "
                         f"ranks")
    return (got - a // g).astype(np.int32)

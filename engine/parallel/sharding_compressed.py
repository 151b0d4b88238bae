"""A tensor-parallel rank's share of a compressed-tensors pack-quantized int4 layer
(engine/loader/quant_compressed.py has the layout), cut from the memory-mapped checkpoint tensors
before the loader converts them, as GPTQ's are (engine/parallel/sharding_int4.py).

The layer is cut as its float (N, K) weight would be (engine/parallel/sharding.py's Cut):

  column-parallel (rows of N)   weight_packed (N, K/8) and weight_scale (N, K/G) by rows;
                                weight_zero_point (N/8, K/G), packed 8 to a word along N, in
                                whole words; weight_g_idx whole
  row-parallel (columns of K)   weight_packed in whole 8-code words, weight_scale and
                                weight_zero_point in whole quantization groups (strategy
                                "channel": one group per row, whole on every rank, the share's
                                length 32-element multiples as the int4 weights need), weight_g_idx
                                renumbered from the share's first group
  weight_shape                  the share's [N, K]

A share that is not whole groups or words, or an act-order g_idx under a row cut, stops the load
naming the tensor.

A float-quantized (FP8) layer's e4m3 weight is cut as a float one (sharding.py); its
weight_scale (and all-zero weight_zero_point) with it: per tensor whole, per channel (N, 1) by
the rows of a column-parallel layer (whole for a row-parallel one), per block in whole blocks.
"""
from __future__ import annotations

import numpy as np

from engine.loader.quant_compressed import scheme_for
from engine.loader.quant_fp8 import block_shape
from engine.parallel.cuts import cut_array
from engine.parallel.sharding_int4 import check_cut, in_order_g_idx, whole_units

SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape",
            ".weight_g_idx")


def check(qc: dict) -> None:
    """Refuses, by config group, what this cut does not split."""
    for group, scheme in (qc.get("config_groups") or {}).items():
        fmt = scheme.get("format") or qc.get("format")
        if fmt not in ("pack-quantized", "float-quantized"):
            raise ValueError(f"tensor parallel: compressed-tensors config group {group} is "
                             f"{fmt}; only pack-quantized (int4 W4A16) and float-quantized "
                             f"(FP8) layers can be split across ranks")


def shard(plan, name: str, tensor, shapes: dict):
    """The rank's part of one tensor of a compressed-tensors layer, or NotImplemented for a
    tensor of no such layer (sharding.py cuts it as any other)."""
    if not name.endswith(SUFFIXES):
        return NotImplemented
    layer, suffix = name.rsplit(".", 1)
    packed = shapes.get(f"{layer}.weight_packed")
    if packed is None:
        return _fp8_scales(plan, name, layer, suffix, tensor, shapes)
    n, k = packed[0], packed[1] * 8
    cut = plan.cut(f"{layer}.weight", (n, k))
    if cut is None:
        return tensor
    check_cut("compressed-tensors", name, cut)
    held = sum(b - a for a, b in cut.ranges)
    if suffix == "weight_shape":
        return np.array([held, k] if cut.axis == 0 else [n, held], tensor.dtype)
    if cut.axis == 0:
        if suffix == "weight_g_idx":
            return tensor
        if suffix == "weight_zero_point":
            return cut_array(tensor, whole_units(plan, name, cut, 8, "words (8 zeros each)", 0))
        return cut_array(tensor, cut)
    args = scheme_for(layer, plan.config.quantization_config["config_groups"])["weights"]
    per_channel = args["strategy"] == "channel"
    ((a, b),) = cut.ranges
    if per_channel:
        whole_units(plan, name, cut, 32, "32-element blocks of an int4 row", 1)
        g = k
    else:
        g = args["group_size"]
        groups = whole_units(plan, name, cut, g, "quantization groups", 1)
    if suffix == "weight_packed":
        return cut_array(tensor, whole_units(plan, name, cut, 8, "words (8 codes each)", 1))
    if suffix in ("weight_scale", "weight_zero_point"):
        return tensor if per_channel else cut_array(tensor, groups)
    return in_order_g_idx(plan, name, tensor, a, b, g)


def _fp8_scales(plan, name: str, layer: str, suffix: str, tensor, shapes: dict):
    """A float-quantized layer's weight_scale or weight_zero_point, cut as its codes are (module
    docstring); NotImplemented for any other tensor."""
    weight = shapes.get(f"{layer}.weight")
    if suffix not in ("weight_scale", "weight_zero_point") or weight is None:
        return NotImplemented
    cut = plan.cut(f"{layer}.weight", tuple(weight))
    if cut is None or int(np.prod(tensor.shape)) == 1:
        return tensor
    check_cut("compressed-tensors", name, cut)
    if tuple(tensor.shape) == (weight[0], 1):
        return cut_array(tensor, cut) if cut.axis == 0 else tensor
    args = scheme_for(layer, plan.config.quantization_config["config_groups"])["weights"]
    return plan.block_scales(name, tensor, cut, block_shape(args.get("block_structure"),
                                                            "block_structure"))

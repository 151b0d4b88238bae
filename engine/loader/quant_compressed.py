"""compressed-tensors checkpoints (llm-compressor's format, quant_method "compressed-tensors"), in
place: `pack-quantized` int4 W4A16 layers become Int4Weights here (pyx/weights/int4.py);
`float-quantized` (FP8) config groups go to engine/loader/quant_fp8.py, once per group.

pack-quantized, per layer of an (N, K) weight with groups of G along K (strategy "group"), or
one group per row (strategy "channel", G = K):
  weight_packed      (N, K/8) int32: code (n, k) is nibble k % 8 of word (n, k / 8), holding
                     the signed int4 value plus 8 (compressed-tensors' pack_to_int32)
  weight_scale       (N, K/G) in the model's dtype
  weight_zero_point  (ceil(N/8), K/G) int32, asymmetric layers only: packed along N the same way
                     (zero (n, g) is nibble n % 8 of word (n / 8, g)), also plus 8
  weight_shape       (2,) int: [N, K]
  weight_g_idx       (K,) int32, only with activation ordering ("actorder": "group")
W[n, k] = scale * (q - zp) on signed values, which is (code - zero) on the stored nibbles: a
symmetric layer's zero is 8.
"""
from __future__ import annotations

import re

import numpy as np

from engine.loader.quant_fp8 import convert_compressed_fp8
from engine.loader.quant_int4 import check_g_idx, nibbles
from pyx.weights.int4 import Int4Part, Int4Source, Int4Weight

_INT4_SUFFIXES = (".weight_packed", ".weight_zero_point", ".weight_shape", ".weight_g_idx")


def convert_compressed_tensors(weights: dict, qc: dict) -> None:
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise ValueError(f"compressed-tensors checkpoint with a {key} is not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors checkpoint has no config_groups")
    int4_groups, fp8_groups = {}, {}
    for name, scheme in groups.items():
        fmt = scheme.get("format") or qc.get("format")
        if fmt == "pack-quantized":
            check_int4_scheme(name, scheme)
            int4_groups[name] = scheme
        elif fmt == "float-quantized":
            fp8_groups[name] = scheme
        else:
            raise ValueError(f"compressed-tensors format {fmt!r} (config group {name}) is not "
                             "supported; supported: pack-quantized (int4 W4A16), "
                             "float-quantized (FP8)")
    layers = sorted(n[:-len(".weight_packed")] for n in weights if n.endswith(".weight_packed"))
    if layers and not int4_groups:
        raise ValueError(f"compressed-tensors checkpoint: {layers[0]}.weight_packed but no "
                         "pack-quantized config group")
    for name in layers:
        args = scheme_for(name, int4_groups)["weights"]
        weights[f"{name}.weight"] = _pack_quantized_layer(weights, name, args)
    if fp8_groups:
        for scheme in fp8_groups.values():
            convert_compressed_fp8(weights, qc, scheme)
    stray = [n for n in weights if n.endswith(_INT4_SUFFIXES)]
    if stray:
        raise ValueError(f"compressed-tensors checkpoint: {stray[0]} belongs to no "
                         "weight_packed")


def check_int4_scheme(group: str, scheme: dict) -> None:
    """The W4A16 variants the int4 kernels run; anything else is an error naming it."""
    where = f"compressed-tensors pack-quantized config group {group}"
    w = scheme.get("weights") or {}
    if scheme.get("input_activations"):
        raise ValueError(f"{where}: activation quantization (input_activations) is not "
                         "supported; W4A16 only")
    if w.get("num_bits") != 4:
        raise ValueError(f"{where}: num_bits {w.get('num_bits')} is not supported (4 only)")
    if w.get("type", "int") != "int":
        raise ValueError(f"{where}: weight type {w.get('type')!r} is not supported (int only)")
    if w.get("strategy") not in ("group", "channel"):
        raise ValueError(f"{where}: strategy {w.get('strategy')!r} is not supported; "
                         "supported: group, channel")
    if w.get("strategy") == "group" and not (isinstance(w.get("group_size"), int)
                                             and w["group_size"] > 0):
        raise ValueError(f"{where}: group strategy needs a positive group_size, got "
                         f"{w.get('group_size')!r}")
    if w.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight quantization is not supported")


def scheme_for(layer: str, groups: dict) -> dict:
    """The config group whose targets name the layer: its exact name, then a "re:" regex, then
    the class name Linear (every layer with a weight_packed is one)."""
    if len(groups) == 1:
        return next(iter(groups.values()))
    best, best_rank = None, 0
    for scheme in groups.values():
        for target in scheme.get("targets") or []:
            if target == layer:
                rank = 3
            elif target.startswith("re:") and re.match(target[3:], layer):
                rank = 2
            else:
                rank = 1 if target == "Linear" else 0
            if rank > best_rank:
                best, best_rank = scheme, rank
    if best is None:
        raise ValueError(f"compressed-tensors checkpoint: no config group targets {layer}")
    return best


def _pack_quantized_layer(weights: dict, name: str, args: dict) -> Int4Weight:
    tensors = {s: weights.pop(f"{name}.{s}") for s in ("weight_packed", "weight_scale",
                                                       "weight_zero_point", "weight_shape",
                                                       "weight_g_idx")
               if f"{name}.{s}" in weights}
    if "weight_scale" not in tensors:
        raise ValueError(f"quantized layer {name} has no weight_scale tensor")
    packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    n = packed.shape[0]
    k = int(tensors["weight_shape"][1]) if "weight_shape" in tensors else packed.shape[1] * 8
    if "weight_shape" in tensors and int(tensors["weight_shape"][0]) != n:
        raise ValueError(f"quantized layer {name}: weight_shape {tensors['weight_shape'].tolist()}"
                         f" does not match weight_packed {list(packed.shape)}")
    g = k if args["strategy"] == "channel" else args["group_size"]
    if k % 32 or g % 32 or k % g:
        raise ValueError(f"quantized layer {name}: row length {k} and group size {g} must be "
                         "multiples of 32, the group size dividing the row length")
    if packed.dtype != np.int32 or packed.shape != (n, k // 8):
        raise ValueError(f"quantized layer {name}: weight_packed is {list(packed.shape)} "
                         f"{packed.dtype}, expected {[n, k // 8]} int32")
    if scale.shape != (n, k // g):
        raise ValueError(f"quantized layer {name}: weight_scale is {list(scale.shape)}, "
                         f"expected {[n, k // g]}")
    check_g_idx(name, tensors.get("weight_g_idx"), k, g)
    symmetric = bool(args.get("symmetric", True))
    zeros = _zeros(name, tensors.get("weight_zero_point"), n, k // g, symmetric)
    source = Int4Source(name, "pack-quantized", tensors, g, symmetric, (n, k))
    part = Int4Part.from_words(packed, np.asarray(scale, np.float32), zeros, g)
    return Int4Weight([part], k, [source])


def _zeros(name: str, zp, n: int, ng: int, symmetric: bool) -> np.ndarray:
    """(N, K/G) float32 zeros on the unsigned codes."""
    if zp is None:
        if not symmetric:
            raise ValueError(f"quantized layer {name} is asymmetric but has no weight_zero_point")
        return np.full((n, ng), 8, np.float32)
    if zp.dtype == np.int32 and zp.shape == ((n + 7) // 8, ng):
        return nibbles(zp.T)[:, :n].T.astype(np.float32)
    raise ValueError(f"quantized layer {name}: weight_zero_point is {list(zp.shape)} {zp.dtype}, "
                     f"expected {[(n + 7) // 8, ng]} int32 (packed along the output dimension)")

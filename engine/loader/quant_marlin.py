"""Marlin-format checkpoints (quant_method "marlin", written by engine/tools/convert_marlin.py)
to Int4Weights, in place.

Per layer of an (N, K) weight with groups of G along K, in the layout of pyx/weights/marlin.py:
  <layer>.marlin_qweight  (K/16, Np*2) uint32, Np = ceil(N / 64) * 64
  <layer>.scales          (K/G, Np) float32, columns permuted per 64-column tile (the `.scales`
                          suffix keeps them float32 whatever the load dtype)
  <layer>.marlin_zeros    (K/G, Np) uint8, permuted alike; absent when every zero is 8
  <layer>.marlin_shape    (3,) int64: [N, K, G]
config.json: {"quant_method": "marlin", "bits": 4, "layout": "taper-marlin-v1", ...}.

Each layer becomes an Int4Weight (canonical codes, for the CPU backend) whose source keeps the
Marlin tensors as stored (format "marlin"), so the GPU uploads them without a repack.
"""
from __future__ import annotations

import numpy as np

from pyx.weights.int4 import Int4Source
from pyx.weights.marlin import MarlinWeight, to_int4

LAYOUT = "taper-marlin-v1"
_SUFFIXES = (".marlin_qweight", ".marlin_zeros", ".marlin_shape")


def convert_marlin(weights: dict, qc: dict) -> None:
    if qc.get("bits", 4) != 4:
        raise ValueError(f"marlin checkpoint with bits={qc.get('bits')} is not supported")
    if qc.get("layout", LAYOUT) != LAYOUT:
        raise ValueError(f"marlin checkpoint layout {qc.get('layout')!r} is not supported; "
                         f"supported: {LAYOUT} (engine/tools/convert_marlin.py)")
    layers = sorted(n[:-len(".marlin_qweight")] for n in weights if n.endswith(".marlin_qweight"))
    if not layers:
        raise ValueError("marlin checkpoint has no .marlin_qweight tensors")
    for name in layers:
        weights[f"{name}.weight"] = _layer(weights, name)
    stray = [n for n in weights if n.endswith(_SUFFIXES)]
    if stray:
        raise ValueError(f"marlin checkpoint: {stray[0]} belongs to no .marlin_qweight")


def marlin_weight(name: str, tensors: dict) -> MarlinWeight:
    """The MarlinWeight of one layer's stored tensors, shapes checked."""
    for s in ("marlin_qweight", "scales", "marlin_shape"):
        if s not in tensors:
            raise ValueError(f"marlin layer {name} has no {s} tensor")
    shape = np.asarray(tensors["marlin_shape"])
    if shape.shape != (3,):
        raise ValueError(f"marlin layer {name}: marlin_shape is {list(shape.shape)}, expected [3]")
    n, k, g = (int(v) for v in shape)
    np_ = -(-n // 64) * 64
    if n <= 0 or k <= 0 or g <= 0 or k % 32 or g % 32 or k % g:
        raise ValueError(f"marlin layer {name}: shape [N, K, G] = {[n, k, g]} needs K and G "
                         "multiples of 32, G dividing K")
    want = {"marlin_qweight": ((k // 16, np_ * 2), np.uint32),
            "scales": ((k // g, np_), np.float32), "marlin_zeros": ((k // g, np_), np.uint8)}
    for s, (sh, dt) in want.items():
        t = tensors.get(s)
        if t is not None and (tuple(t.shape) != sh or t.dtype != dt):
            raise ValueError(f"marlin layer {name}: {s} is {list(t.shape)} {t.dtype}, expected "
                             f"{list(sh)} {np.dtype(dt)}")
    return MarlinWeight(np.ascontiguousarray(tensors["marlin_qweight"]),
                        np.ascontiguousarray(tensors["scales"]),
                        None if tensors.get("marlin_zeros") is None
                        else np.ascontiguousarray(tensors["marlin_zeros"]), k, n, g)


def _layer(weights: dict, name: str):
    tensors = {s: weights.pop(f"{name}.{s}") for s in ("marlin_qweight", "scales",
                                                       "marlin_zeros", "marlin_shape")
               if f"{name}.{s}" in weights}
    m = marlin_weight(name, tensors)
    source = Int4Source(name, "marlin", tensors, m.group_size, m.zeros is None, m.shape)
    return to_int4(m, [source])

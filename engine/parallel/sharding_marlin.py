"""A tensor-parallel rank's share of a layer of a Marlin-format checkpoint (quant_method "marlin",
engine/loader/quant_marlin.py; the tile layout is pyx/weights/marlin.py's), cut from the
memory-mapped tensors as they are stored, along the layout's own tiles, so the share is itself a
Marlin layer (the GPU uploads it as it is, the CPU unpacks it):

  column-parallel (rows of N)   whole 64-column tiles: marlin_qweight's 128 words per tile
                                (tile nt is words [128 nt, 128 nt + 128) of every row),
                                scales' and marlin_zeros' 64 columns per tile (their permutation
                                stays within a tile)
  row-parallel (columns of K)   whole 16-row k tiles of marlin_qweight (one row each), scales and
                                marlin_zeros in whole quantization groups; with one group per row
                                (G = K) they are whole on every rank and the share's G is its K
  marlin_shape                  the share's [N, K, G]

N is padded to whole tiles in the file; a layer whose N is not (its last tile part padding) is
cut along N only where no cut is needed. A share that is not whole tiles or groups, or whose K or
G is not a multiple of 32 (the int4 weights' requirement), stops the load naming the tensor and
the numbers.
"""
from __future__ import annotations

import numpy as np

from engine.parallel.cuts import Cut, cut_array
from engine.parallel.sharding_int4 import check_cut, whole_units
from pyx.weights.marlin import TILE_K, TILE_N

SUFFIXES = (".marlin_qweight", ".scales", ".marlin_zeros", ".marlin_shape")


def shard(plan, name: str, tensor, shapes: dict):
    """The rank's part of one tensor of a Marlin layer, or NotImplemented for a tensor of no such
    layer (sharding.py cuts it as any other)."""
    if not name.endswith(SUFFIXES):
        return NotImplemented
    layer, suffix = name.rsplit(".", 1)
    qweight = shapes.get(f"{layer}.marlin_qweight")
    if qweight is None or f"{layer}.scales" not in shapes:
        return NotImplemented
    k, n_padded = qweight[0] * TILE_K, qweight[1] // 2
    groups = shapes[f"{layer}.scales"][0]
    if suffix == "marlin_shape":
        return _shape(plan, name, tensor, k, n_padded, groups)
    # (the padded N stands for N here: marlin_shape's cut, which reads N, refuses a layer cut
    # along N whose N is not whole tiles)
    cut = plan.cut(f"{layer}.weight", (n_padded, k))
    if cut is None:
        return tensor
    check_cut("marlin", name, cut)
    if cut.axis == 0:
        whole_units(plan, name, cut, TILE_N, "Marlin n tiles", 1)     # (a check)
        if suffix == "marlin_qweight":      # 2 words per column: 128 per tile
            return cut_array(tensor, Cut(1, tuple((2 * a, 2 * b) for a, b in cut.ranges)))
        return cut_array(tensor, Cut(1, cut.ranges))
    if suffix == "marlin_qweight":
        return cut_array(tensor, whole_units(plan, name, cut, TILE_K, "Marlin k tiles", 0))
    g = k // groups
    if groups == 1 and not _whole_groups(cut, g):
        return tensor                       # one group per row: every share's one group
    return cut_array(tensor, whole_units(plan, name, cut, g, "quantization groups", 0))


def _shape(plan, name: str, shape, k: int, n_padded: int, groups: int) -> np.ndarray:
    """marlin_shape: the share's [N, K, G], after the checks only N makes possible."""
    n, k_stored, g = (int(v) for v in np.asarray(shape))
    if k_stored != k or g * groups != k:
        raise ValueError(f"marlin checkpoint: {name} is {[n, k_stored, g]}, but the layer's "
                         f"marlin_qweight holds K = {k} in {groups} groups")
    cut = plan.cut(name.removesuffix(".marlin_shape") + ".weight", (n, k))
    if cut is None:
        return shape
    check_cut("marlin", name, cut)
    held = sum(b - a for a, b in cut.ranges)
    if cut.axis == 0:
        if n != n_padded:
            raise ValueError(f"tensor parallel {plan.size}: {name}: N = {n} is not whole "
                             f"{TILE_N}-column Marlin tiles (stored padded to {n_padded}), so "
                             f"its output rows {list(cut.ranges)} cannot be cut from the tiles")
        return np.array([held, k, g], shape.dtype)
    g_share = g if _whole_groups(cut, g) else held
    if held % 32 or g_share % 32:
        raise ValueError(f"tensor parallel {plan.size}: {name}: the rank's input columns "
                         f"{list(cut.ranges)} make K = {held} with groups of {g_share}; an int4 "
                         f"layer needs both multiples of 32, so it cannot be split")
    return np.array([n, held, g_share], shape.dtype)


def _whole_groups(cut: Cut, g: int) -> bool:
    return all(a % g == 0 and b % g == 0 for a, b in cut.ranges)

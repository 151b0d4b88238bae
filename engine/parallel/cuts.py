"""A rank's share of a tensor: the Cut (which ranges of which axis it holds) and its
application, shared by engine/parallel/sharding.py and the family-specific cuts beside it
(sharding_mla.py, sharding_int4.py, sharding_gemma4.py, linear_attention_shards.py), which
import these from here rather than from sharding.py, which imports them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cut:
    """The pieces [start, stop) of `axis` a rank holds, concatenated in order; `pad_to`: zero
    entries appended along the axis up to that length (the vocabulary's last share)."""
    axis: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int = 0


def even(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"tensor parallel {size}: {what} ({n}) is not divisible by {size}")
    return rank * n // size, (rank + 1) * n // size


def cut_array(x: np.ndarray, cut: Cut) -> np.ndarray:
    def piece(a, b):
        index = [slice(None)] * x.ndim
        index[cut.axis] = slice(a, b)
        return x[tuple(index)]

    pieces = [piece(a, b) for a, b in cut.ranges]
    held = sum(b - a for a, b in cut.ranges)
    if cut.pad_to > held:
        shape = list(x.shape)
        shape[cut.axis] = cut.pad_to - held
        pieces.append(np.zeros(shape, x.dtype))
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=cut.axis)

"""Prompt lookup (n-gram) proposals: no extra model. The sequence's last n tokens are looked up
earlier in its own tokens (prompt and output); the tokens that followed the match are the draft.
Repetitive tasks (editing code, summaries quoting their input, retrieval answers) repeat long runs
of their context, which the target then accepts whole.

The longest suffix wins (from prompt_lookup_max down to prompt_lookup_min), and among matches of
that length the latest (recent context predicts best). The candidates are found once for the
shortest suffix by one vectorised comparison, then filtered as the suffix grows, so a lookup costs
O(context * min) plus the candidates, not O(context * max) per length.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class TokenBuffer:
    """A sequence's token ids as a growing NumPy array, extended with the tokens appended since
    the last call (a proposal each step must not convert the whole list again)."""
    __slots__ = ("array", "size")

    def __init__(self):
        self.array = np.empty(64, np.int64)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.size:            # truncated (a stop string ended a run): start again
            self.size = 0
        if n > self.array.size:
            grown = np.empty(max(n, 2 * self.array.size), np.int64)
            grown[:self.size] = self.array[:self.size]
            self.array = grown
        if n > self.size:
            self.array[self.size:n] = token_ids[self.size:n]
            self.size = n
        return self.array[:n]


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n]; [] when no suffix of min_n tokens recurs."""
    L = tokens.size
    if k < 1 or L < min_n + 1:
        return []
    # ends: positions e <= L - 2 (a token follows) where tokens[e - min_n + 1 .. e] equals the
    # last min_n tokens
    windows = sliding_window_view(tokens[:L - 1], min_n)
    ends = np.flatnonzero((windows == tokens[L - min_n:]).all(axis=1)) + (min_n - 1)
    if not ends.size:
        return []
    n = min_n
    while n < max_n and n < L - 1:
        starts = ends - n                    # the token before each match, to extend it by one
        keep = ends[(starts >= 0) & (tokens[np.maximum(starts, 0)] == tokens[L - 1 - n])]
        if not keep.size:
            break
        ends, n = keep, n + 1
    e = int(ends[-1])
    return tokens[e + 1:e + 1 + k].tolist()

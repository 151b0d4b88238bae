"""The CPU backend's sampling ops in NumPy: `apply_penalties` and `filter_logits` (pyx/backend.pyx).

CpuBackend validates the arguments and calls these; engine/sampling/sampler.py's public NumPy helpers call
them too. They work in place on a (B, V) float32 array.

`filter_logits` is vectorised over rows and sparse in the vocabulary: top-k partitions only values
above a bound from a strided sample; top-p sorts only candidates (the top-k survivors, or tokens
above a provable mass bound); all filters fold into one threshold per row and one masking pass.
"""
from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)


# ---- penalties

def apply_penalties(logits: np.ndarray, rows, cols, bias, rep, pres_freq):
    """In place, for each of N distinct (rows[n], cols[n]) entries of logits (B, V):
    x = logits[row, col] + bias[n]; x = x > 0 ? x / rep[n] : x * rep[n]; x -= pres_freq[n].
    All in float32. A bias of -0.0 and a pres_freq of 0 leave x bit-identical."""
    if len(rows) == 0:
        return
    x = logits[rows, cols] + bias
    pen = np.flatnonzero(rep != 1.0)
    if pen.size:
        xp, r = x[pen], rep[pen]
        x[pen] = np.where(xp > 0, xp / r, xp * r)
    x -= pres_freq
    logits[rows, cols] = x


# ---- temperature and filters

def filter_logits(x: np.ndarray, temperature, top_k, top_p, min_p):
    """In place: the op table's filter_logits (temperature, top-k, top-p over the top-k
    survivors, min-p; dropped tokens -> -inf). Per-row parameters (B,); top_p and min_p are used
    in float64 (their float32 values widened exactly)."""
    _filter_inplace(x, temperature, top_k, np.asarray(top_p, dtype=np.float64),
                    np.asarray(min_p, dtype=np.float64))


def _filter_inplace(x: np.ndarray, temperature, top_k, top_p, min_p):
    """Every filter keeps the logits >= a per-row threshold, so they combine into one threshold
    and one masking pass over (B, V)."""
    B, V = x.shape
    if np.any(temperature != 1.0):
        np.divide(x, np.maximum(temperature, np.float32(1e-5))[:, None], out=x)
    thr = np.full(B, NEG_INF, dtype=np.float32)
    # top-k: the k-th largest value (ties with it kept too, as vLLM). One partition per distinct k.
    k_rows = np.flatnonzero((top_k > 0) & (top_k < V))
    for k in np.unique(top_k[k_rows]):
        rows = k_rows[top_k[k_rows] == k]
        thr[rows] = _kth_largest(x, rows, int(k))
    p_rows = np.flatnonzero(top_p < 1.0)
    m_rows = np.flatnonzero(min_p > 0.0)
    if p_rows.size or m_rows.size:
        rowmax = x.max(axis=1)
        rowmax = np.where(np.isfinite(rowmax), rowmax, np.float32(0))  # all -inf rows stay so
        if p_rows.size:
            thr[p_rows] = np.maximum(thr[p_rows], _top_p_threshold(
                x[p_rows], rowmax[p_rows], thr[p_rows], top_p[p_rows]))
        # min-p: prob < min_p * max prob  <=>  logit < max logit + log(min_p).
        if m_rows.size:
            thr[m_rows] = np.maximum(thr[m_rows],
                                     rowmax[m_rows] + np.log(min_p[m_rows]).astype(np.float32))
    rows = np.flatnonzero(thr > NEG_INF)
    if rows.size == B:
        _mask_below(x, thr)
    elif rows.size:
        sub = x[rows]
        _mask_below(sub, thr[rows])
        x[rows] = sub


def _kth_largest(x: np.ndarray, rows: np.ndarray, k: int, stride: int = 16) -> np.ndarray:
    """k-th largest value of each given row. For a small k, a partition of every stride-th column
    gives a lower bound, and only the values above it are partitioned (about 3x faster than
    partitioning the whole row at V = 152k)."""
    V = x.shape[1]
    if k * stride * 16 > V:
        return np.partition(x[rows], V - k, axis=1)[:, V - k]
    sub = x[rows, ::stride]
    m = sub.shape[1]
    bound = np.partition(sub, m - k, axis=1)[:, m - k]     # <= the row's k-th largest
    out = np.empty(len(rows), dtype=np.float32)
    for n, i in enumerate(rows):
        c = x[i][x[i] >= bound[n]]
        out[n] = np.partition(c, len(c) - k)[len(c) - k]
    return out


def _mask_below(x: np.ndarray, thr: np.ndarray):
    """In place: x[b, v] = -inf where x[b, v] < thr[b]. Adds log(keep) (0 or -inf): one dense
    pass, several times faster than a boolean-mask assignment and exact for kept values."""
    keep = x >= thr[:, None]
    with np.errstate(divide="ignore"):
        x += np.log(keep, dtype=np.float32)


def _top_p_threshold(x: np.ndarray, rowmax: np.ndarray, thr_k: np.ndarray, top_p: np.ndarray):
    """Per row, the logit of the last token of the smallest most-likely set whose mass reaches
    top_p of the tokens >= thr_k (the top-k survivors): at least one token is always kept.

    Only candidates are sorted. With top-k they are the k survivors. Without, a token with
    e < tau = (1 - top_p) * Z / V cannot be that last token (all tokens below it together hold
    less than (1 - top_p) * Z, so the tokens above it would already reach top_p); for a peaked
    distribution that leaves a few hundred tokens."""
    R, V = x.shape
    out = np.empty(R, dtype=np.float32)
    for i in np.flatnonzero(thr_k > NEG_INF):
        cand = np.sort(x[i, x[i] >= thr_k[i]])[::-1]            # descending logits
        cum = np.cumsum(np.exp(cand - rowmax[i]), dtype=np.float64)
        out[i] = cand[min(int(np.searchsorted(cum, top_p[i] * cum[-1])), len(cand) - 1)]
    rows = np.flatnonzero(thr_k == NEG_INF)
    if rows.size:
        xs = x[rows]
        e = np.exp(xs - rowmax[rows, None])              # unnormalised probs, max 1; -inf -> 0
        total = e.sum(axis=1, dtype=np.float64)
        target = top_p[rows] * total
        tau = (0.5 * (1.0 - top_p[rows]) * total / V).astype(np.float32)  # 0.5: rounding margin
        for n, i in enumerate(rows):
            cand = np.sort(xs[n, e[n] >= tau[n]])[::-1]
            cum = np.cumsum(np.exp(cand - rowmax[i]), dtype=np.float64)
            out[i] = cand[min(int(np.searchsorted(cum, target[n])), len(cand) - 1)]
    return out

"""Next-token sampling: logits (B, V) -> token ids (B,), per-row SamplingParams.

Order (vLLM's): logit_bias, min_tokens mask, repetition penalty (prompt + output), presence and
frequency penalties (output only) -> greedy rows: argmax. Other rows: / temperature, top-k, top-p
(on the top-k-renormalised distribution), min-p, dropped tokens -> -inf, then Gumbel-max with the
counter-based RNG keyed by (seed, output position), so a row draws the same token alone or in any
batch (DESIGN.md section 5, Randomness).

Everything is vectorised over rows and sparse in the vocabulary: penalties touch only the token ids
a sequence has seen; top-k partitions only values above a bound from a strided sample; top-p sorts
only candidates (the top-k survivors, or tokens above a provable mass bound); all filters fold into
one threshold per row and one masking pass. The caller's logits are never modified: rows are
processed in copies.

`apply_penalties` and `apply_filters` are public so tests (and later logprobs) can see the
processed logits.
"""
from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)


class Sampler:
    def __init__(self, backend):
        self.backend = backend

    def sample(self, logits: np.ndarray, seqs: list, eos_token_ids: set[int]) -> np.ndarray:
        """logits (B, V) float32, one row per sequence (the row that samples its next token)."""
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        B = logits.shape[0]
        if B != len(seqs):
            raise ValueError(f"sample: {B} logits rows for {len(seqs)} sequences")
        # Logprobs (a later issue) are of the raw distribution: take them from `logits` here,
        # before any processing.
        work = apply_penalties(logits, seqs, eos_token_ids)
        out = np.empty(B, dtype=np.int64)
        params = [s.sampling_params for s in seqs]
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=B)

        g_rows = np.flatnonzero(greedy)
        if g_rows.size == B:
            self.backend.argmax(work, out)
        elif g_rows.size:
            sub_out = np.empty(g_rows.size, dtype=np.int64)
            self.backend.argmax(work[g_rows], sub_out)
            out[g_rows] = sub_out

        r_rows = np.flatnonzero(~greedy)
        if r_rows.size:
            rp = [params[i] for i in r_rows]
            temperature = np.array([p.temperature for p in rp], dtype=np.float32)
            top_k = np.array([p.top_k for p in rp], dtype=np.int64)
            top_p = np.array([p.top_p for p in rp], dtype=np.float64)
            min_p = np.array([p.min_p for p in rp], dtype=np.float64)
            filtered = bool(np.any(temperature != 1.0) or np.any(top_k > 0)
                            or np.any(top_p < 1.0) or np.any(min_p > 0.0))
            # Fancy indexing copies; a full batch reuses `work` unless it is the caller's array
            # and the filters would write to it.
            if r_rows.size < B:
                sub = work[r_rows]
            elif work is logits and filtered:
                sub = logits.copy()
            else:
                sub = work
            if filtered:
                _filter_inplace(sub, temperature, top_k, top_p, min_p)
            seeds = np.array([seqs[i].seed for i in r_rows], dtype=np.uint64)
            positions = np.array([seqs[i].num_output_tokens for i in r_rows], dtype=np.int64)
            sub_out = np.empty(r_rows.size, dtype=np.int64)
            self.backend.gumbel_sample(sub, seeds, positions, sub_out)
            out[r_rows] = sub_out
        return out


# ---- penalties (before temperature)

def apply_penalties(logits: np.ndarray, seqs: list, eos_token_ids: set[int]) -> np.ndarray:
    """logit_bias, min_tokens, repetition/presence/frequency penalties. Returns `logits` itself
    when no row needs any of them, else a processed copy (the input is never modified)."""
    B, V = logits.shape
    bias_r, bias_c, bias_v = [], [], []       # logit_bias entries
    mask_r, mask_c = [], []                   # min_tokens: ids forced to -inf
    rep_rows, rep_ids = [], []                # repetition penalty: prompt + output ids
    pf_rows, pf_ids = [], []                  # presence/frequency: output ids
    for b, seq in enumerate(seqs):
        p = seq.sampling_params
        if p.logit_bias:
            for tid, val in p.logit_bias.items():
                tid = int(tid)
                if 0 <= tid < V:   # ids past the model's vocabulary cannot be sampled anyway
                    bias_r.append(b)
                    bias_c.append(tid)
                    bias_v.append(float(val))
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops |= eos_token_ids
            stops = [t for t in stops if 0 <= t < V]
            mask_r += [b] * len(stops)
            mask_c += stops
        if p.repetition_penalty != 1.0 and seq.num_tokens:
            rep_rows.append(b)
            rep_ids.append(np.asarray(seq.token_ids, dtype=np.int64))
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and seq.num_output_tokens:
            pf_rows.append(b)
            pf_ids.append(np.asarray(seq.output_token_ids, dtype=np.int64))
    if not (bias_r or mask_r or rep_rows or pf_rows):
        return logits

    out = logits.copy()
    if bias_r:
        np.add.at(out, (np.array(bias_r), np.array(bias_c)), np.array(bias_v, dtype=np.float32))
    if mask_r:
        out[np.array(mask_r), np.array(mask_c)] = NEG_INF
    if rep_rows:
        rows, cols, _ = _unique_pairs(rep_rows, rep_ids, V)
        pen = np.array([seqs[b].sampling_params.repetition_penalty for b in range(B)],
                       dtype=np.float32)[rows]
        vals = out[rows, cols]
        out[rows, cols] = np.where(vals > 0, vals / pen, vals * pen)
    if pf_rows:
        rows, cols, counts = _unique_pairs(pf_rows, pf_ids, V)
        pres = np.array([s.sampling_params.presence_penalty for s in seqs], dtype=np.float32)[rows]
        freq = np.array([s.sampling_params.frequency_penalty for s in seqs], dtype=np.float32)[rows]
        out[rows, cols] -= pres + freq * counts.astype(np.float32)
    return out


def _unique_pairs(rows: list[int], ids: list[np.ndarray], V: int):
    """Distinct (row, token id) pairs over all rows, with occurrence counts."""
    lens = [len(a) for a in ids]
    r = np.repeat(np.array(rows, dtype=np.int64), lens)
    c = np.concatenate(ids)
    keep = (c >= 0) & (c < V)
    keys, counts = np.unique(r[keep] * V + c[keep], return_counts=True)
    return keys // V, keys % V, counts


# ---- temperature and filters

def apply_filters(logits: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Temperature-scaled logits with the tokens dropped by top-k, top-p and min-p set to -inf.
    Per-row parameters (scalars broadcast); returns a new array."""
    out = np.array(logits, dtype=np.float32, copy=True, ndmin=2)
    B = out.shape[0]
    _filter_inplace(out,
                    np.broadcast_to(np.asarray(temperature, dtype=np.float32), (B,)),
                    np.broadcast_to(np.asarray(top_k, dtype=np.int64), (B,)),
                    np.broadcast_to(np.asarray(top_p, dtype=np.float64), (B,)),
                    np.broadcast_to(np.asarray(min_p, dtype=np.float64), (B,)))
    return out


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

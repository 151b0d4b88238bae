"""Log-probabilities of chosen tokens and of each row's top-k, computed where the logits live.

log_softmax in float32 on the backend's arrays (NumPy on the CPU, CuPy on CUDA: `xp`): each
row's logsumexp, the chosen token's logit and the k largest logits are gathered on the device, and
only these small arrays, (R,) and (R, k), come back to the host. The (R, V) logits never do.
"""
from __future__ import annotations

import numpy as np

from engine.core.outputs import TokenLogprobs

MAX_LOGPROBS = 20      # top logprobs per token, as OpenAI's chat API allows


def gather_logprobs(backend, logits, token_ids, k: int):
    """logits (R, V) float32 on the backend; token_ids (R,) host ints; k >= 0.
    Returns host arrays: the chosen tokens' logprobs (R,) and ranks (R,) (1 + the number of
    tokens with a larger logit), the top-k ids (R, k) int64 and their logprobs (R, k), largest
    first (ties: the lower id first)."""
    xp = backend.xp
    R, V = logits.shape
    x = xp.ascontiguousarray(logits, dtype=xp.float32)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + xp.log(xp.exp(x - m).sum(axis=1))
    rows = xp.arange(R)
    picked = x[rows, backend.asarray(np.asarray(token_ids, dtype=np.int64))]
    chosen = np.asarray(backend.to_host(picked - lse), np.float32)
    rank = np.asarray(backend.to_host((x > picked[:, None]).sum(axis=1) + 1), np.int64)
    k = min(k, V)
    if k == 0:
        return chosen, rank, np.zeros((R, 0), np.int64), np.zeros((R, 0), np.float32)
    top = _top_k(xp, x, k)
    top_lp = xp.take_along_axis(x, top, axis=1) - lse[:, None]
    return (chosen, rank, np.asarray(backend.to_host(top), np.int64),
            np.asarray(backend.to_host(top_lp), np.float32))


def _top_k(xp, x, k: int):
    """Ids of the k largest entries per row, largest first, ties by the lower id.

    Without a full sort or partition of the row: the row's first C * L entries, cut into C =
    4k chunks, give C chunk maxima; the k-th largest of them, t, has at least k entries of the
    row >= t (k distinct chunk maxima), and few others in practice. Only those candidates are
    sorted, by (row, value descending, id)."""
    B, V = x.shape
    C = min(V, 4 * k)
    L = V // C
    maxima = x[:, :C * L].reshape(B, C, L).max(axis=2)
    t = xp.sort(maxima, axis=1)[:, C - k]
    rows, cols = xp.nonzero(x >= t[:, None])
    vals = x[rows, cols].astype(xp.float64)
    # lexsort: the last key is the primary one; float64 holds the ids and rows exactly
    order = xp.lexsort(xp.stack([cols.astype(xp.float64), -vals, rows.astype(xp.float64)]))
    rows, cols = rows[order], cols[order]
    pos = xp.arange(rows.size) - xp.searchsorted(rows, xp.arange(B))[rows]
    keep = pos < k
    out = xp.empty((B, k), dtype=xp.int64)
    out[rows[keep], pos[keep]] = cols[keep]
    return out


def to_entries(token_ids, chosen, rank, top_ids, top_lps, ks) -> list[TokenLogprobs]:
    """One TokenLogprobs per row, row i keeping its own ks[i] <= k top entries."""
    return [TokenLogprobs(int(t), float(c), top_ids[i, :n].tolist(), top_lps[i, :n].tolist(),
                          rank=int(r))
            for i, (t, c, r, n) in enumerate(zip(token_ids, chosen, rank, ks))]


def log_softmax(backend, logits):
    """(R, V) float32 log-softmax, on the backend (beam search scores whole rows)."""
    xp = backend.xp
    x = xp.ascontiguousarray(logits, dtype=xp.float32)
    m = x.max(axis=1, keepdims=True)
    return x - (m + xp.log(xp.exp(x - m).sum(axis=1, keepdims=True)))


def top_k_flat(backend, x, k: int):
    """The k largest entries of a (1, N) array (ties: the lower index first), as host arrays:
    their indexes (k,) int64 and values (k,) float32."""
    ids = _top_k(backend.xp, x, k)
    vals = backend.xp.take_along_axis(x, ids, axis=1)
    return (np.asarray(backend.to_host(ids[0]), np.int64),
            np.asarray(backend.to_host(vals[0]), np.float32))


def record_prompt_logprobs(backend, sched, logits):
    """Prompt logprobs of this step's rows (runner.execute put them after the sampled rows),
    appended to each request's list; positions from the schedule-time num_computed (the
    main thread may move num_computed_tokens on meanwhile)."""
    spans = [(seq, seq.request.prompt_logprob_positions(a, n))
             for seq, a, n in zip(sched.seqs, sched.num_computed, sched.num_new_tokens)
             if seq.wants_prompt_logprobs]
    spans = [(seq, r) for seq, r in spans if r]
    if not spans:
        return
    targets = [t for seq, r in spans for t in seq.token_ids[r.start + 1:r.stop + 1]]
    ks = [seq.sampling_params.prompt_logprobs for seq, r in spans for _ in r]
    entries = iter(to_entries(targets, *gather_logprobs(backend, logits, targets,
                                                        max(ks)), ks))
    for seq, r in spans:
        seq.request.prompt_logprobs.extend(next(entries) for _ in r)

"""Log-probabilities of chosen tokens and of each row's top-k, computed where the logits live.

log_softmax in float32 on the backend's arrays (NumPy on the CPU, CuPy on CUDA: `xp`): each
row's logsumexp, the chosen token's logit and the k largest logits are gathered on the device, and
only these small arrays, (R,) and (R, k), come back to the host. The (R, V) logits never do.
"""
from __future__ import annotations

import numpy as np

from engine.outputs import TokenLogprobs

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
    """Ids of the k largest entries per row, largest first, ties by the lower id: a partition
    (O(V)) then a sort of the k survivors only."""
    part = xp.argpartition(-x, k - 1, axis=1)[:, :k]
    # Sort the survivors by id, then stably by value: equal values stay in id order.
    part = xp.sort(part, axis=1)
    vals = xp.take_along_axis(x, part, axis=1)
    by_val = xp.argsort(-vals, axis=1, kind="stable")
    return xp.take_along_axis(part, by_val, axis=1)


def to_entries(token_ids, chosen, rank, top_ids, top_lps, ks) -> list[TokenLogprobs]:
    """One TokenLogprobs per row, row i keeping its own ks[i] <= k top entries."""
    return [TokenLogprobs(int(t), float(c), top_ids[i, :n].tolist(), top_lps[i, :n].tolist(),
                          rank=int(r))
            for i, (t, c, r, n) in enumerate(zip(token_ids, chosen, rank, ks))]

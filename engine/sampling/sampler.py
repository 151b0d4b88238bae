"""Next-token sampling: logits (B, V) -> token ids (B,), per-row SamplingParams, on any backend.

Order (vLLM's): the token mask (tokens outside the grammar -> -inf; a reasoning budget's forced
</think>: every other token -> -inf), logit_bias,
min_tokens mask, repetition penalty (prompt + output), presence and frequency penalties (output
only) -> greedy rows: argmax. Other rows: / temperature, top-k, top-p
(on the top-k-renormalised distribution), min-p, dropped tokens -> -inf, then Gumbel-max with the
counter-based RNG keyed by (seed, output position), so a row draws the same token alone or in any
batch (DESIGN.md section 5, Randomness).

The host (NumPy) only builds small arrays: per-row parameters, and the penalties as N distinct
(row, token) entries, each with a merged bias (logit_bias, -inf for a min_tokens mask), a
repetition factor and a presence + frequency * count term, which the backend's `apply_penalties`
applies in the order above in one pass. The logits themselves stay where the backend keeps them
(NumPy or CuPy, `backend.xp`): `apply_penalties`, `filter_logits`, `argmax` and `gumbel_sample`
are backend ops, and only the B token ids come back (`backend.to_host`). The caller's logits are
never modified: the sampler works on a copy when some row needs penalties or filters.

With a backend whose `fused_sampling` is on (CUDA's kernels sampling=fused), the penalties,
argmax, filters and the Gumbel draw are one `sample_fused` launch for the whole batch instead,
for the same tokens; processed logprobs keep the op-by-op path, which writes the filtered logits.

`apply_penalties` and `apply_filters` are public NumPy helpers so tests can see the processed
logits; they run the CPU backend's code (pyx/cpu_sampling.py).

Logprobs (engine/sampling/logprobs.py) are gathered on the backend too, for the rows that ask for them:
of the raw logits by default, of the processed ones with logprobs_mode "processed".
"""
from __future__ import annotations

import numpy as np

from engine.sampling.logprobs import gather_logprobs, to_entries
from engine.sampling.reasoning_budget import with_forced_tokens
from pyx import cpu_sampling

NEG_INF = np.float32(-np.inf)


class Sampler:
    def __init__(self, backend):
        self.backend = backend

    def sample(self, logits, seqs: list, eos_token_ids: set[int],
               token_bitmask: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """logits (B, V) float32 (a NumPy or CuPy array, the backend's), one row per sequence
        (the row that samples its next token). token_bitmask: structured outputs' (bitmask
        (B, ceil(V/32)) int32, rows (R,) int32) from the host, applied first, so greedy and
        sampled rows both obey it. Returns the B token ids, NumPy int64."""
        return self.sample_with_logprobs(logits, seqs, eos_token_ids,
                                         token_bitmask=token_bitmask)[0]

    def sample_with_logprobs(self, logits, seqs: list, eos_token_ids: set[int],
                             logprobs_mode: str = "raw",
                             token_bitmask: tuple[np.ndarray, np.ndarray] | None = None):
        """The B token ids (as `sample`), and per row a TokenLogprobs (None for rows whose
        request asked for none): of the raw logits, or with logprobs_mode "processed" of the
        logits the token was drawn from (after the token mask, penalties, logit_bias,
        temperature and the top-k/p, min-p filters)."""
        params = [s.sampling_params for s in seqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        processed = bool(lp_rows) and logprobs_mode == "processed"
        tokens, work = self.sample_rows(logits, seqs, eos_token_ids, token_bitmask,
                                        keep_processed=processed)
        return self.with_logprobs(tokens, work if processed else logits, params, lp_rows)

    def sample_rows(self, logits, seqs: list, eos_token_ids: set[int],
                    token_bitmask: tuple[np.ndarray, np.ndarray] | None = None,
                    keep_processed: bool = False):
        """The B token ids (NumPy int64), and with keep_processed the processed logits they
        were drawn from (the token mask, penalties and logit_bias applied; sampled rows also
        divided by their temperature with the filtered-out tokens at -inf: the softmax of a
        sampled row is the distribution its token was drawn from), else None. `seqs` may be any
        objects with a sequence's sampling attributes (speculative decoding's draft rows)."""
        be = self.backend
        xp = be.xp
        B, V = logits.shape
        if B != len(seqs):
            raise ValueError(f"sample: {B} logits rows for {len(seqs)} sequences")
        params = [s.sampling_params for s in seqs]
        processed = keep_processed
        token_bitmask = with_forced_tokens(seqs, V, token_bitmask)
        entries = penalty_entries(seqs, eos_token_ids, V)
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=B)
        g_rows, r_rows = np.flatnonzero(greedy), np.flatnonzero(~greedy)

        filters = None
        if r_rows.size:
            rp = [params[i] for i in r_rows]
            temperature = np.array([p.temperature for p in rp], dtype=np.float32)
            top_k = np.array([p.top_k for p in rp], dtype=np.int32)
            top_p = np.array([p.top_p for p in rp], dtype=np.float32)
            min_p = np.array([p.min_p for p in rp], dtype=np.float32)
            if (np.any(temperature != 1.0) or np.any(top_k > 0) or np.any(top_p < 1.0)
                    or np.any(min_p > 0.0)):
                filters = temperature, top_k, top_p, min_p

        if be.fused_sampling and not processed:
            out = self._sample_fused(logits, seqs, params, greedy, entries, token_bitmask)
            return np.asarray(be.to_host(out), dtype=np.int64), None

        # A sub-batch (fancy indexing) is a copy already; the whole batch is copied only when
        # an op would write to it (processed logprobs write the filtered rows back).
        if (entries is not None or token_bitmask is not None
                or (filters is not None and (r_rows.size == B or processed))):
            work = xp.array(logits, dtype=xp.float32, order="C", copy=True)
        else:
            work = xp.ascontiguousarray(logits, dtype=xp.float32)
        if token_bitmask is not None:
            be.apply_token_bitmask(work, *(be.asarray(a) for a in token_bitmask))
        if entries is not None:
            be.apply_penalties(work, *(be.asarray(a) for a in entries))

        out = xp.empty(B, dtype=xp.int64)
        if g_rows.size == B:
            be.argmax(work, out)
        elif g_rows.size:
            idx = be.asarray(g_rows)
            sub_out = xp.empty(g_rows.size, dtype=xp.int64)
            be.argmax(work[idx], sub_out)
            out[idx] = sub_out

        if r_rows.size:
            idx = be.asarray(r_rows)
            sub = work if r_rows.size == B else work[idx]
            if filters is not None:
                be.filter_logits(sub, *(be.asarray(a) for a in filters))
                if processed and r_rows.size < B:
                    work[idx] = sub
            seeds = np.array([seqs[i].seed for i in r_rows], dtype=np.uint64)
            positions = np.array([seqs[i].num_output_tokens for i in r_rows], dtype=np.int64)
            sub_out = out if r_rows.size == B else xp.empty(r_rows.size, dtype=xp.int64)
            be.gumbel_sample(sub, be.asarray(seeds), be.asarray(positions), sub_out)
            if r_rows.size < B:
                out[idx] = sub_out
        tokens = np.asarray(be.to_host(out), dtype=np.int64)
        return tokens, (work if processed else None)

    def _sample_fused(self, logits, seqs: list, params: list, greedy: np.ndarray, entries,
                      token_bitmask):
        """The tokens (B,) on the device from the backend's one-launch sampler (CUDA's
        kernels sampling=fused): the token mask, then penalties, argmax or filters and the
        Gumbel draw in one kernel; the same tokens as the op-by-op path."""
        be = self.backend
        xp = be.xp
        # The kernel writes the penalties into the logits: only then (or for the mask) a copy.
        if entries is not None or token_bitmask is not None:
            work = xp.array(logits, dtype=xp.float32, order="C", copy=True)
        else:
            work = xp.ascontiguousarray(logits, dtype=xp.float32)
        if token_bitmask is not None:
            be.apply_token_bitmask(work, *(be.asarray(a) for a in token_bitmask))
        B = len(seqs)
        per_row = (greedy.astype(np.uint8),
                   np.array([p.temperature for p in params], dtype=np.float32),
                   np.array([p.top_k for p in params], dtype=np.int32),
                   np.array([p.top_p for p in params], dtype=np.float32),
                   np.array([p.min_p for p in params], dtype=np.float32),
                   np.array([s.seed for s in seqs], dtype=np.uint64),
                   np.array([s.num_output_tokens for s in seqs], dtype=np.int64))
        out = xp.empty(B, dtype=xp.int64)
        be.sample_fused(work, *(be.asarray(a) for a in per_row), out,
                        penalties=None if entries is None else tuple(be.asarray(a)
                                                                     for a in entries))
        return out

    def with_logprobs(self, tokens: np.ndarray, source, params: list, lp_rows: list):
        """(tokens, per-row TokenLogprobs or None) with the logprobs of `source`'s rows: row i's
        entry for tokens[i], for the rows lp_rows (those whose params ask for logprobs)."""
        be = self.backend
        logprobs = [None] * len(tokens)
        if lp_rows:
            rows = source if len(lp_rows) == len(tokens) else source[be.asarray(np.array(lp_rows))]
            ks = [params[i].logprobs for i in lp_rows]
            chosen = tokens[lp_rows]
            for i, entry in zip(lp_rows, to_entries(chosen, *gather_logprobs(be, rows, chosen,
                                                                                max(ks)), ks)):
                logprobs[i] = entry
        return tokens, logprobs


# ---- penalties (before temperature)

def penalty_entries(seqs: list, eos_token_ids: set[int], V: int):
    """The penalties of a batch as distinct (row, token) entries for the backend's
    apply_penalties: (rows int32, cols int32, bias f32, rep f32, pres_freq f32), sorted by
    (row, token); None when no row needs any.

    Over the union of the tokens each term touches: bias = the row's logit_bias (-0.0 where it has
    none, which adds exactly nothing), -inf for the ids min_tokens forbids; rep = the repetition
    penalty for ids in the prompt or the output, else 1; pres_freq = presence + frequency * count
    for ids in the output (computed in float32 as the penalty always was), else 0. Applied as
    x + bias, then / or * rep, then - pres_freq, this is exactly the sequence logit_bias,
    min_tokens mask, repetition, presence/frequency."""
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
            rep_ids.append(token_counts(seq, prompt=True).below(V)[0])
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and seq.num_output_tokens:
            pf_rows.append(b)
            pf_ids.append(token_counts(seq, prompt=False).below(V))
    if not (bias_r or mask_r or rep_rows or pf_rows):
        return None

    parts = []
    if bias_r:
        bias_keys = np.array(bias_r, dtype=np.int64) * V + np.array(bias_c, dtype=np.int64)
        parts.append(bias_keys)
    if mask_r:
        mask_keys = np.array(mask_r, dtype=np.int64) * V + np.array(mask_c, dtype=np.int64)
        parts.append(mask_keys)
    if rep_rows:
        rep_keys = _row_keys(rep_rows, rep_ids, V)
        parts.append(rep_keys)
    if pf_rows:
        pf_keys = _row_keys(pf_rows, [ids for ids, _ in pf_ids], V)
        pf_counts = np.concatenate([counts for _, counts in pf_ids])
        parts.append(pf_keys)
    if len(parts) == 1 and (rep_rows or pf_rows):
        keys = parts[0]                 # already sorted and distinct
    else:
        keys = _sorted_unique(np.concatenate(parts))
    N = keys.size
    if N == 0:
        return None
    bias = np.full(N, -0.0, dtype=np.float32)
    rep = np.ones(N, dtype=np.float32)
    pres_freq = np.zeros(N, dtype=np.float32)
    if bias_r:   # an id given twice (say "5" and 5) gets the sum of its biases
        np.add.at(bias, np.searchsorted(keys, bias_keys), np.array(bias_v, dtype=np.float32))
    if mask_r:
        bias[np.searchsorted(keys, mask_keys)] = NEG_INF
    if rep_rows:
        pen = np.array([s.sampling_params.repetition_penalty for s in seqs], dtype=np.float32)
        rep[np.searchsorted(keys, rep_keys)] = pen[rep_keys // V]
    if pf_rows:
        rows = pf_keys // V
        pres = np.array([s.sampling_params.presence_penalty for s in seqs], dtype=np.float32)[rows]
        freq = np.array([s.sampling_params.frequency_penalty for s in seqs], dtype=np.float32)[rows]
        pres_freq[np.searchsorted(keys, pf_keys)] = pres + freq * pf_counts.astype(np.float32)
    return ((keys // V).astype(np.int32), (keys % V).astype(np.int32), bias, rep, pres_freq)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique by a sort (NumPy 2's hash-based unique is several times slower here)."""
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if a.size else a


def _row_keys(rows: list[int], ids: list[np.ndarray], V: int) -> np.ndarray:
    """Keys row * V + id over the rows (ascending) of each row's sorted distinct ids: sorted."""
    lens = [len(a) for a in ids]
    return np.repeat(np.array(rows, dtype=np.int64), lens) * V + np.concatenate(ids)


class TokenCounts:
    """A sequence's distinct token ids (sorted) and their counts, over its prompt and output or
    its output alone, brought up to date with the tokens appended since the last step: the
    penalties cost the new tokens per step, not the whole history."""
    __slots__ = ("seen", "ids", "counts")

    def __init__(self, start: int):
        self.seen = start                 # token_ids[:seen] are counted (from start)
        self.ids = np.empty(0, np.int64)
        self.counts = np.empty(0, np.int64)

    def copy(self) -> "TokenCounts":
        out = TokenCounts(0)
        out.seen, out.ids, out.counts = self.seen, self.ids.copy(), self.counts.copy()
        return out

    def update(self, token_ids: list[int]) -> "TokenCounts":
        new = token_ids[self.seen:]
        self.seen = len(token_ids)
        if len(new) == 1:                 # a decode step: one insertion into the sorted ids
            t = new[0]
            i = int(np.searchsorted(self.ids, t))
            if i < self.ids.size and self.ids[i] == t:
                self.counts[i] += 1
            else:
                self.ids = np.insert(self.ids, i, t)
                self.counts = np.insert(self.counts, i, 1)
        elif new:
            ids, counts = np.unique(np.asarray(new, np.int64), return_counts=True)
            ids = np.concatenate([self.ids, ids])
            counts = np.concatenate([self.counts, counts])
            order = np.argsort(ids, kind="stable")     # two sorted runs: a linear merge
            ids, counts = ids[order], counts[order]
            first = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
            self.ids, self.counts = ids[first], np.add.reduceat(counts, first)
        return self

    def below(self, V: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of the ids < V (ids past the model's vocabulary cannot be sampled)."""
        n = int(np.searchsorted(self.ids, V))
        return self.ids[:n], self.counts[:n]


def token_counts(seq, prompt: bool) -> TokenCounts:
    """The sequence's TokenCounts over prompt + output (prompt=True) or its output, updated."""
    counts = seq.token_counts
    if counts is None:
        counts = seq.token_counts = (TokenCounts(0), TokenCounts(seq.num_prompt_tokens))
    return counts[0 if prompt else 1].update(seq.token_ids)


def apply_penalties(logits: np.ndarray, seqs: list, eos_token_ids: set[int]) -> np.ndarray:
    """logit_bias, min_tokens, repetition/presence/frequency penalties on NumPy logits (B, V).
    Returns `logits` itself when no row needs any of them, else a processed copy (the input is
    never modified)."""
    entries = penalty_entries(seqs, eos_token_ids, logits.shape[1])
    if entries is None:
        return logits
    out = np.array(logits, dtype=np.float32, order="C", copy=True)
    cpu_sampling.apply_penalties(out, *entries)
    return out


# ---- temperature and filters

def apply_filters(logits: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Temperature-scaled logits with the tokens dropped by top-k, top-p and min-p set to -inf.
    Per-row parameters (scalars broadcast); returns a new array."""
    out = np.array(logits, dtype=np.float32, copy=True, ndmin=2)
    B = out.shape[0]
    cpu_sampling.filter_logits(
        out,
        np.broadcast_to(np.asarray(temperature, dtype=np.float32), (B,)),
        np.broadcast_to(np.asarray(top_k, dtype=np.int64), (B,)),
        np.broadcast_to(np.asarray(top_p, dtype=np.float64), (B,)),
        np.broadcast_to(np.asarray(min_p, dtype=np.float64), (B,)))
    return out

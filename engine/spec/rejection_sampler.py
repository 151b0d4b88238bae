"""Verification: from the target's logits at a sequence's k + 1 verify rows (its last known token
and k drafts) to the tokens it emits, distributed exactly as sampling one token at a time.

Row i of a sequence is where it samples after its first i drafts. Every row is processed as the
non-speculative sampler would process that position: `DraftRow` shows the sampler the sequence
with those drafts appended, so penalties count them, min_tokens and the seed's counter (the
output position) move on by i, and the structured-output mask is the grammar's state after
them (StructuredOutputs.draft_bitmask). The rows are then sampled in one call.

Point-mass drafts (n-gram lookups, and a draft model's argmax drafts): the draft distribution q
is a point mass on draft d, so rejection sampling accepts d with probability p(d) and otherwise
draws from the residual max(p - q, 0), which is p without d. Comparing d with the token the row
draws itself (Gumbel-max with the position's own noise) does exactly that: they agree with
probability p(d), and a disagreeing draw is distributed as p conditioned on not d. So the
sequence accepts drafts while they equal the target's own draws and emits the first draw that
differs (or, all accepted, the last row's draw, the bonus token): the very tokens the
non-speculative engine draws for the same seed, greedy rows included (argmax).

Probabilistic drafts (a draft model with draft_sampling "probabilistic"): d was drawn from the
draft's distribution q. It is accepted when u * q(d) < p(d), u uniform from a Philox stream of
its own keyed by (seed, output position); the first rejected row draws from the residual
normalised max(p - q, 0) with a Gumbel stream of its own; after k acceptances the last row's
own draw is the bonus. (Leviathan et al. 2023, Chen et al. 2023: every emitted token follows p
exactly.) These streams differ from the non-speculative one, so a seeded request gets other
(equally distributed) tokens than without speculation.

Logprobs of the emitted tokens come from their rows: the same rows the non-speculative engine
reads (raw logits, or with logprobs_mode "processed" the processed ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampling.sampler import Sampler

# Keys xor-ed into a request's seed for the streams that must be independent of its own Gumbel
# stream (which draws the target's tokens): the draft's draws, the acceptance uniforms and the
# residual draws.
DRAFT_STREAM = 0x5BD1E9955BD1E995
ACCEPT_STREAM = 0x9E3779B97F4A7C15
RESIDUAL_STREAM = 0xC2B2AE3D27D4EB4F


class DraftRow:
    """A sequence as the sampler sees it at verify row i: its tokens followed by its first i
    drafts. `seed` and `sampling_params` may be replaced (the draft's own stream, greedy
    drafting)."""
    __slots__ = ("seq", "drafts", "seed", "sampling_params", "_counts")

    def __init__(self, seq, drafts: list[int], seed: int | None = None, params=None):
        self.seq = seq
        self.drafts = drafts
        self.seed = seq.seed if seed is None else seed
        self.sampling_params = seq.sampling_params if params is None else params
        self._counts = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    # The sampler's penalty counts (sampler.token_counts): copies of the sequence's, which then
    # count the drafts too; the sequence's own are left as they were.
    @property
    def token_counts(self):
        if self._counts is None and self.seq.token_counts is not None:
            self._counts = tuple(c.copy() for c in self.seq.token_counts)
        return self._counts

    @token_counts.setter
    def token_counts(self, value):
        self._counts = value


def verify_rows(seqs: list, drafts: list[list[int]]) -> list:
    """The sampler's rows of the verify step: per sequence, itself then a DraftRow per draft."""
    rows = []
    for seq, draft in zip(seqs, drafts):
        rows.append(seq)
        rows.extend(DraftRow(seq, draft[:i]) for i in range(1, len(draft) + 1))
    return rows


def philox_uniforms(seeds, positions) -> np.ndarray:
    """One uniform in (0, 1) per (seed, position), from a Philox stream keyed by the seed: the
    same numbers for a request alone or in any batch."""
    out = np.empty(len(seeds), np.float64)
    for i, (seed, position) in enumerate(zip(seeds, positions)):
        raw = np.random.Philox(key=int(seed), counter=int(position)).random_raw()
        out[i] = ((int(raw) >> 11) + 0.5) * 2.0 ** -53
    return out


@dataclass(slots=True)
class Verified:
    """Per sequence: the tokens it emits (accepted drafts, then one drawn token), their logprobs
    (None entries when the request asked for none), how many drafts it verified and how many of
    them were accepted."""
    tokens: list[list[int]]
    logprobs: list[list]
    num_drafts: list[int]
    num_accepted: list[int]


class RejectionSampler:
    def __init__(self, sampler: Sampler, eos_token_ids: set[int], logprobs_mode: str = "raw"):
        self.sampler = sampler
        self.backend = sampler.backend
        self.eos_token_ids = eos_token_ids
        self.logprobs_mode = logprobs_mode

    def verify(self, logits, seqs: list, drafts: list[list[int]], structured=None,
               draft_probs: list | None = None) -> Verified:
        """logits (R, V) on the backend: sequence j's 1 + len(drafts[j]) rows, in order.
        structured: the engine's StructuredOutputs (None when no request has a grammar).
        draft_probs: per sequence, None (point-mass drafts) or the (len(drafts[j]), V) draft
        probabilities its drafts were drawn from (on the backend)."""
        be, xp = self.backend, self.backend.xp
        rows = verify_rows(seqs, drafts)
        if logits.shape[0] != len(rows):
            raise ValueError(f"verify: {logits.shape[0]} logits rows for {len(rows)} rows")
        mask = structured.draft_bitmask(seqs, drafts) if structured is not None else None
        probabilistic = [draft_probs is not None and draft_probs[j] is not None
                         and not seq.sampling_params.greedy for j, seq in enumerate(seqs)]
        wants_lp = any(seq.sampling_params.logprobs is not None for seq in seqs)
        keep = any(probabilistic) or (wants_lp and self.logprobs_mode == "processed")
        draws, processed = self.sampler.sample_rows(logits, rows, self.eos_token_ids, mask,
                                                    keep_processed=keep)
        starts = np.cumsum([0] + [1 + len(d) for d in drafts])
        accept = self._accept_probabilistic(seqs, drafts, starts, probabilistic, processed,
                                            draft_probs) if any(probabilistic) else None

        tokens, num_accepted = [], []
        residual = []                 # (sequence, row, draft index) drawing from max(p - q, 0)
        for j, (seq, draft) in enumerate(zip(seqs, drafts)):
            start, out, n = int(starts[j]), [], 0
            for i, d in enumerate(draft):
                ok = bool(accept[j][i]) if probabilistic[j] else int(draws[start + i]) == d
                if not ok:
                    break
                out.append(d)
                n += 1
            row = start + n
            if n < len(draft) and probabilistic[j]:
                residual.append((j, row, n))
                out.append(-1)        # drawn below
            else:
                out.append(int(draws[row]))
            tokens.append(out)
            num_accepted.append(n)
        if residual:
            self._draw_residual(residual, seqs, tokens, processed, draft_probs)

        logprobs = self._logprobs(logits, processed, seqs, tokens, starts)
        return Verified(tokens, logprobs, [len(d) for d in drafts], num_accepted)

    def _accept_probabilistic(self, seqs, drafts, starts, probabilistic, processed, draft_probs):
        """Per probabilistic sequence, whether each draft passes u * q(d) < p(d)."""
        be, xp = self.backend, self.backend.xp
        rows, ids, q_d, seeds, positions = [], [], [], [], []
        for j, seq in enumerate(seqs):
            if not probabilistic[j]:
                continue
            k = len(drafts[j])
            rows.extend(range(int(starts[j]), int(starts[j]) + k))
            ids.extend(drafts[j])
            q = draft_probs[j][xp.arange(k), be.asarray(np.array(drafts[j], np.int64))]
            q_d.append(np.asarray(be.to_host(q), np.float64))
            seeds.extend([seq.seed ^ ACCEPT_STREAM] * k)
            positions.extend(range(seq.num_output_tokens, seq.num_output_tokens + k))
        p = _softmax(xp, processed[be.asarray(np.array(rows, np.int64))])
        p_d = np.asarray(be.to_host(p[xp.arange(len(rows)), be.asarray(np.array(ids, np.int64))]),
                         np.float64)
        u = philox_uniforms(seeds, positions)
        passed = u * np.concatenate(q_d) < p_d
        out, at = [None] * len(seqs), 0
        for j in range(len(seqs)):
            if probabilistic[j]:
                k = len(drafts[j])
                out[j], at = passed[at:at + k], at + k
        return out

    def _draw_residual(self, residual, seqs, tokens, processed, draft_probs):
        """The first rejected row of each such sequence draws from normalised max(p - q, 0)
        (p itself where that is all zero: p == q up to rounding, a rejection then happens with
        probability ~0)."""
        be, xp = self.backend, self.backend.xp
        p = _softmax(xp, processed[be.asarray(np.array([r for _, r, _ in residual], np.int64))])
        q = xp.stack([draft_probs[j][i] for j, _, i in residual])
        diff = xp.maximum(p - q.astype(p.dtype), 0)
        empty = diff.sum(axis=1) <= 0
        diff = xp.where(empty[:, None], p, diff)
        with np.errstate(divide="ignore"):
            logits = xp.log(diff).astype(xp.float32)
        seeds = np.array([seqs[j].seed ^ RESIDUAL_STREAM for j, _, _ in residual], np.uint64)
        positions = np.array([seqs[j].num_output_tokens + i for j, _, i in residual], np.int64)
        out = xp.empty(len(residual), dtype=xp.int64)
        be.gumbel_sample(xp.ascontiguousarray(logits), be.asarray(seeds), be.asarray(positions),
                         out)
        for (j, _, _), token in zip(residual, np.asarray(be.to_host(out), np.int64)):
            tokens[j][-1] = int(token)

    def _logprobs(self, logits, processed, seqs, tokens, starts) -> list[list]:
        lp_seqs = [j for j, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        if not lp_seqs:
            return [[None] * len(t) for t in tokens]
        be = self.backend
        source = processed if self.logprobs_mode == "processed" else logits
        rows = [int(starts[j]) + i for j in lp_seqs for i in range(len(tokens[j]))]
        chosen = np.array([t for j in lp_seqs for t in tokens[j]], np.int64)
        params = [seqs[j].sampling_params for j in lp_seqs for _ in tokens[j]]
        _, entries = self.sampler.with_logprobs(chosen, source[be.asarray(np.array(rows))],
                                                params, list(range(len(rows))))
        out, it = [], iter(entries)
        lp = set(lp_seqs)
        for j, t in enumerate(tokens):
            out.append([next(it) for _ in t] if j in lp else [None] * len(t))
        return out


def _softmax(xp, x):
    x = x.astype(xp.float64)
    m = x.max(axis=1, keepdims=True)
    e = xp.exp(x - m)
    return e / e.sum(axis=1, keepdims=True)

"""Verification: from the target's logits at a sequence's k + 1 verify rows (its last known token
and k drafts) to the tokens it emits, distributed exactly as sampling one token at a time.

Row i of a sequence is where it samples after its first i drafts. Every row is processed as the
non-speculative sampler would process that position: `DraftRow` shows the sampler the sequence
with those drafts appended, so penalties count them, min_tokens and the seed's counter (the
output position) move on by i, and the structured-output mask is the grammar's state after
them (StructuredOutputs.draft_bitmask). The rows are then sampled in one call.

Point-mass drafts (n-gram lookups): the draft distribution q
is a point mass on draft d, so rejection sampling accepts d with probability p(d) and otherwise
draws from the residual max(p - q, 0), which is p without d. Comparing d with the token the row
draws itself (Gumbel-max with the position's own noise) does exactly that: they agree with
probability p(d), and a disagreeing draw is distributed as p conditioned on not d. So the
sequence accepts drafts while they equal the target's own draws and emits the first draw that
differs (or, all accepted, the last row's draw, the bonus token): the very tokens the
non-speculative engine draws for the same seed, greedy rows included (argmax).

Logprobs of the emitted tokens come from their rows: the same rows the non-speculative engine
reads (raw logits, or with logprobs_mode "processed" the processed ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampling.sampler import Sampler


class DraftRow:
    """A sequence as the sampler sees it at verify row i: its tokens followed by its first i
    drafts."""
    __slots__ = ("seq", "drafts", "seed", "sampling_params", "_counts")

    def __init__(self, seq, drafts: list[int]):
        self.seq = seq
        self.drafts = drafts
        self.seed = seq.seed
        self.sampling_params = seq.sampling_params
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

    def verify(self, logits, seqs: list, drafts: list[list[int]], structured=None) -> Verified:
        """logits (R, V) on the backend: sequence j's 1 + len(drafts[j]) rows, in order.
        structured: the engine's StructuredOutputs (None when no request has a grammar)."""
        rows = verify_rows(seqs, drafts)
        if logits.shape[0] != len(rows):
            raise ValueError(f"verify: {logits.shape[0]} logits rows for {len(rows)} rows")
        mask = structured.draft_bitmask(seqs, drafts) if structured is not None else None
        wants_lp = any(seq.sampling_params.logprobs is not None for seq in seqs)
        keep = wants_lp and self.logprobs_mode == "processed"
        draws, processed = self.sampler.sample_rows(logits, rows, self.eos_token_ids, mask,
                                                    keep_processed=keep)
        starts = np.cumsum([0] + [1 + len(d) for d in drafts])
        tokens, num_accepted = [], []
        for j, draft in enumerate(drafts):
            start, out, n = int(starts[j]), [], 0
            for i, d in enumerate(draft):
                if int(draws[start + i]) != d:
                    break
                out.append(d)
                n += 1
            out.append(int(draws[start + n]))   # the first draw that differs, or the bonus
            tokens.append(out)
            num_accepted.append(n)
        logprobs = self._logprobs(logits, processed, seqs, tokens, starts)
        return Verified(tokens, logprobs, [len(d) for d in drafts], num_accepted)

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

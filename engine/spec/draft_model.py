"""A draft model of the target's tokenizer: it proposes k tokens one forward at a time, reading
and writing its own KV caches.

Its KV pool is its own memory, laid out as the target's: the same number of blocks of the same
size, indexed by the target's block tables (the block table of record, Sequence.block_table). So
a block the target holds, shares through the prefix cache, frees or hands to another sequence
carries the draft's K/V for the same tokens, and preemption, prefix caching and rollback need no
bookkeeping of their own. That holds because the draft computes every token the target computes:
`mirror` runs the draft over each step's batch (prefill chunks, decodes and verify rows alike,
the same slots), and rows past a sequence's accepted tokens are rewritten before they are read,
as the target's are.

Proposing for a sequence whose last known token x sits at position L - 1 (the step's first
verify row): forward x at L - 1 -> draft d1, d1 at L -> d2, ..., each a one-token forward over
the speculating sequences, into the slots the step allocated for its verify rows. The drafts are
the argmax of the draft's processed logits (the request's penalties, logit_bias, min_tokens and
structured-output mask applied, temperature aside), or with draft_sampling "probabilistic" a
draw from its processed distribution (temperature and filters too) on a stream of its own,
returned with that distribution for the rejection sampler.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from engine.runner.forward_batch import ForwardBatch
from engine.sampling.sampler import Sampler
from engine.spec.rejection_sampler import DRAFT_STREAM, DraftRow


class DraftModel:
    def __init__(self, model, model_config, backend, num_blocks: int, block_size: int,
                 kv_cache_dtype: str, target_vocab_size: int):
        self.model = model
        self.model_config = model_config
        self.backend = backend
        self.target_vocab_size = target_vocab_size
        self.embed_vocab_size = model_config.vocab_size     # ids it can read
        self.kv_caches = model.new_kv_caches(num_blocks, block_size,
                                             backend.kv_cache_dtype(kv_cache_dtype))
        self.num_forward_calls = 0

    def mirror(self, batch: ForwardBatch, host_batch: ForwardBatch | None = None) -> None:
        """The draft's K/V for every token of the target's step (`batch` on the device, block
        tables included; `host_batch` the same on the host); no logits."""
        empty = self.backend.asarray(np.zeros(0, np.int32))
        self.model.forward(dataclasses.replace(batch, logits_indices=empty,
                                               token_ids=self._known(batch.token_ids)),
                           self.kv_caches)
        self.num_forward_calls += 1

    def _known(self, token_ids):
        """Ids past the draft's vocabulary (padding ids only the target has) read as id 0: the
        draft's guesses after one are worse, the verified tokens the same."""
        V = self.embed_vocab_size
        if V >= self.target_vocab_size:
            return token_ids
        xp = self.backend.xp
        return xp.where(token_ids < V, token_ids, 0).astype(xp.int32)

    def propose(self, batch: ForwardBatch, block_tables, plans: list, sampler: Sampler,
                eos_token_ids: set[int], structured, probabilistic: bool):
        """Drafts for the step's speculating sequences, written into `batch.token_ids` (host) at
        their verify rows. plans: (batch index b, sequence, number of drafts k) each; block_tables:
        the batch's (B, width) tables on the device. Returns the drafts per plan and, with
        probabilistic drafting, per plan the (k, V) draft probabilities of a sampling request
        (None for greedy ones and without it)."""
        be, xp = self.backend, self.backend.xp
        qsl = batch.query_start_loc
        first = [int(qsl[b + 1]) - 1 - k for b, _, k in plans]   # each one's verify row 0
        drafts = [[] for _ in plans]
        probs = [[] if probabilistic and not seq.sampling_params.greedy else None
                 for _, seq, _ in plans]
        views_params = [self._draft_params(seq, probabilistic) for _, seq, _ in plans]
        walks = [None] * len(plans)
        if structured is not None:
            from engine.sampling.structured_outputs import DraftGrammar
            walks = [DraftGrammar(seq.grammar) if seq.grammar is not None else None
                     for _, seq, _ in plans]
        try:
            for step in range(max(k for _, _, k in plans)):
                live = [i for i, (_, _, k) in enumerate(plans) if k > step]
                rows = np.array([first[i] + step for i in live], np.int64)
                tokens = np.array([batch.token_ids[first[i]] if step == 0 else drafts[i][-1]
                                   for i in live], np.int32)
                n = len(live)
                logits = self._step_logits(batch, block_tables, plans, live, rows, tokens, step)
                views = [DraftRow(plans[i][1], drafts[i], plans[i][1].seed ^ DRAFT_STREAM,
                                  views_params[i]) for i in live]
                mask = self._mask(structured, [walks[i] for i in live], n)
                keep = any(probs[i] is not None for i in live)
                out, processed = sampler.sample_rows(logits, views, eos_token_ids, mask,
                                                     keep_processed=keep)
                for r, i in enumerate(live):
                    token = int(out[r])
                    drafts[i].append(token)
                    batch.token_ids[first[i] + 1 + step] = token
                    if walks[i] is not None and not walks[i].advance(token):
                        walks[i].restore()
                        walks[i] = None     # refused (an empty mask): verification rejects it
                    if probs[i] is not None:
                        probs[i].append(_draft_distribution(xp, processed[r], token))
        finally:
            for walk in walks:
                if walk is not None:
                    walk.restore()
        return drafts, [None if p is None else xp.stack(p) for p in probs]

    def _step_logits(self, batch, block_tables, plans, live, rows, tokens, step: int):
        """One drafting forward: the live plans' tokens at their verify rows `rows` of the
        target's batch (their positions and slots); logits (len(live), target V)."""
        be = self.backend
        positions = batch.positions[rows].astype(np.int32)
        n = len(live)
        fb = ForwardBatch(
            self._known(be.asarray(tokens)), be.asarray(positions),
            be.asarray(batch.slot_mapping[rows].astype(np.int32)),
            be.asarray(np.arange(n + 1, dtype=np.int32)), be.asarray(positions + 1),
            block_tables[be.asarray(np.array([plans[i][0] for i in live], np.int64))],
            be.asarray(np.arange(n, dtype=np.int32)))
        logits = self._fit_vocab(self.model.forward(fb, self.kv_caches))
        self.num_forward_calls += 1
        return logits

    @staticmethod
    def _draft_params(seq, probabilistic: bool):
        """The params the draft samples its rows with: the request's when it draws
        probabilistically, else a greedy copy (cached on the sequence's SpecState)."""
        params = seq.sampling_params
        if (probabilistic and not params.greedy) or params.greedy:
            return params
        state = seq.spec
        if state.greedy_params is None:
            state.greedy_params = dataclasses.replace(params, temperature=0.0)
        return state.greedy_params

    def _mask(self, structured, walks: list, n: int):
        if structured is None or all(w is None for w in walks):
            return None
        mask = np.zeros((n, structured.num_words), dtype=np.int32)
        rows = [r for r, w in enumerate(walks)
                if w is not None and structured.fill_row(w, mask, r)]
        return (mask, np.array(rows, np.int32)) if rows else None

    def _fit_vocab(self, logits):
        """The draft's logits on the target's vocabulary: padded with -inf (ids only the target
        has are never proposed) or cut (ids the target lacks)."""
        V = self.target_vocab_size
        if logits.shape[1] == V:
            return logits
        if logits.shape[1] > V:
            return self.backend.xp.ascontiguousarray(logits[:, :V])
        out = self.backend.xp.full((logits.shape[0], V), -np.inf, dtype=np.float32)
        out[:, :logits.shape[1]] = logits
        return out


def _draft_distribution(xp, x, token: int):
    """The distribution a draft was drawn from: the softmax of its processed row, or a point
    mass on the proposed token where every id is masked (-inf: an EAGLE-3 head's draft
    vocabulary under a grammar that wants none of it). No sync: the choice is made on the
    device."""
    x = x.astype(xp.float64)
    top = x.max()
    e = xp.exp(x - xp.where(xp.isfinite(top), top, 0.0))
    total = e.sum()
    point = (xp.arange(x.shape[0]) == token).astype(xp.float64)
    return xp.where(total > 0, e / xp.where(total > 0, total, 1.0), point)

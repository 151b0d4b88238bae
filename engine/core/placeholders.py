"""Output placeholders: the rows of step N+1 whose token step N has not sampled yet.

With async scheduling the engine schedules and prepares step N+1 while step N still runs
(LLMEngine.step): a sequence that N samples is already in N+1, decoding a token nobody knows yet.
The scheduler counts that token (Sequence.num_output_placeholders) and ModelRunner.prepare writes
-1 in its row; its position, KV slot and block table do not depend on its value, so they are
prepared ahead. `PlaceholderRows` says which rows of N+1's token_ids take which of N's sampled
tokens; the forward thread fills them right before N+1's forward. N's tokens are there by then:
the one forward thread runs N (forward and sampling, which returns host arrays) before it starts
N+1.

Why that is exact:
- N+1's sampling waits until N is committed (InflightStep.committed), so it sees N's
  tokens in the output history as the synchronous engine does: penalties count them,
  and the Philox draw and min_tokens use the same output position. Only the forward
  (which needs N's tokens as input ids and nothing else of the host's) runs earlier.
- A sequence that N's token finishes (EOS, stop token, stop string, abort) was already
  in N+1: its row is computed and dropped when N+1 commits. One that N's token ends by
  length is not scheduled (the scheduler knows that in advance).
- Freed blocks are never written by their next owner's steps out of order: a block freed
  on this thread (a finish, an abort, a preemption while N was in flight) goes to a
  sequence only in a later schedule, whose step runs after every step already submitted
  (one forward thread, in order; on CUDA one stream). A stale write by such an earlier
  step lands before the new owner writes, and the new owner reads only positions it has
  written, or prefix-cache blocks: those are registered only once their step has run,
  and never hold a position an in-flight step writes.
- A sequence preempted while N was in flight keeps N's token (N's commit appends it to
  the waiting sequence), as the synchronous engine keeps output tokens across a recompute
  preemption; N+1 admits nobody (no admission in a step that preempts), so it cannot run
  again before that commit.

The fallback (schedule after the commit, today's order) is taken when a sequence N
samples has a grammar (its matcher must take N's token before N+1's mask is computed),
and a beam-search step runs synchronously (a beam's fork copies KV blocks, which must
not happen under a running forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PlaceholderRows:
    rows: np.ndarray          # (P,) rows of the batch's token_ids holding -1
    sources: np.ndarray       # (P,) index of each row's token among step N's sampled tokens
    num_sources: int          # how many tokens step N samples (a check on the pairing)

    @classmethod
    def find(cls, batch, sched, prev_sampled: list) -> "PlaceholderRows | None":
        """The placeholder rows of `batch` (prepared from `sched`), paired with the sequences
        step N samples (`prev_sampled`, in the order of its tokens); None when there are none."""
        rows = np.flatnonzero(batch.token_ids < 0)
        if not rows.size:
            return None
        index = {seq.seq_id: i for i, seq in enumerate(prev_sampled)}
        seq_of_row = np.searchsorted(batch.query_start_loc, rows, side="right") - 1
        sources = np.fromiter((index[sched.seqs[b].seq_id] for b in seq_of_row.tolist()),
                              np.intp, rows.size)
        return cls(rows, sources, len(prev_sampled))

    def fill(self, token_ids: np.ndarray, prev_result) -> None:
        """Write step N's tokens into the rows. prev_result: N's result (_run_step's); when N
        failed, token 0: its sequences are finished with the error before this step commits,
        which then drops their rows."""
        if isinstance(prev_result, Exception):
            token_ids[self.rows] = 0
            return
        tokens = prev_result[1]
        if len(tokens) != self.num_sources:
            raise RuntimeError(f"placeholders: step N sampled {len(tokens)} tokens, "
                               f"{self.num_sources} were expected")
        token_ids[self.rows] = np.asarray(tokens)[self.sources]

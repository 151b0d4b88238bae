"""EAGLE-3 proposals: a head (engine/models/llama_eagle3.py) drafts from the target's own hidden
states, one forward of its single layer per draft.

The head's row for position p reads the target's features f(p) (fc over the residual streams
entering the aux layers at p) and the token at p + 1, and predicts the token at p + 2. Both
pools below live in the target's blocks (the same number, indexed by the target's block tables,
as the draft model's: engine/spec/draft_model.py), so prefix caching, preemption and rollback
carry them along:

- the feature pool: f(p) at the slot of p, written after every target forward for all its rows
  (the target's AuxCapture). f(p) depends on tokens 0..p only, as the target's K/V does;
- the head's K/V pool: its row for p at the slot of p.

`mirror`, after each target forward: a batch row (token t at position q) is the head's row for
q - 1 (token t, f(q - 1), RoPE position q - 1), so the head computes every row whose next token
the batch holds; a sequence's last row waits for its sampled token. Rows of rejected drafts are
rewritten before they are read, as the target's are: the next draft step 0 recomputes the
first of them.

`propose` for a sequence whose last known token x sits at position L - 1 (the step's first
verify row): step 0 is the head's row for L - 2 (x, f(L - 2)) -> d1; step i its row for
L - 2 + i (d_i, the previous step's prenorm output) -> d_(i+1), into the slots of the verify
rows before it. Sampling, grammar masks and probabilities are the draft model's.

One inexactness, in the drafts only (verification keeps every output exact): the head's row for
the last position of a block depends on the first token of the next block. A sequence that
takes a cached block and goes on with another token rewrites that row in the shared block, and
a sequence still running on the old one then drafts from it.
"""
from __future__ import annotations

import numpy as np

from engine.models.llama import AuxCapture
from engine.models.llama_eagle3 import Eagle3Head
from engine.runner.forward_batch import ForwardBatch
from engine.spec.draft_model import DraftModel


class Eagle3Proposer(DraftModel):
    def __init__(self, head: Eagle3Head, backend, num_blocks: int, block_size: int,
                 kv_cache_dtype: str, target_vocab_size: int):
        self.model = head
        self.model_config = head.config.layer
        self.backend = backend
        self.block_size = block_size
        self.target_vocab_size = target_vocab_size
        self.embed_vocab_size = head.embed_vocab_size
        xp = backend.xp
        shape = head.kv_cache_shape(num_blocks, block_size)
        dtype = backend.kv_cache_dtype(kv_cache_dtype)
        self.kv_caches = [(xp.zeros(shape, dtype), xp.zeros(shape, dtype))
                          for _ in range(head.config.layer.num_hidden_layers)]
        self.features = xp.zeros((num_blocks * block_size, head.config.hidden_size),
                                 dtype=backend.act_dtype)
        self.capture = AuxCapture(head.aux_layers)    # the target's runner fills it
        self.num_forward_calls = 0
        self._hidden = None        # propose: the previous step's prenorm rows
        self._hidden_row = {}      # plan index -> its row there

    @staticmethod
    def bytes_per_block(head_config, block_size: int, kv_dtype, act_dtype) -> int:
        """Both pools' bytes for one of the target's blocks."""
        c = head_config.layer
        kv = 2 * c.num_key_value_heads * c.head_dim * np.dtype(kv_dtype).itemsize
        return block_size * (kv * c.num_hidden_layers
                             + c.hidden_size * np.dtype(act_dtype).itemsize)

    # ---- after the target's forward

    def mirror(self, batch: ForwardBatch, host_batch: ForwardBatch | None = None) -> None:
        """The step's features into the pool, and the head's rows whose next token `batch`
        holds (device batch; `host_batch` the same on the host)."""
        states, self.capture.states = self.capture.states, None
        if states is None:
            raise RuntimeError("EAGLE-3: the target's forward captured no hidden states")
        self.features[batch.slot_mapping] = self.model.fuse(states)
        rows = np.flatnonzero(host_batch.positions > 0)
        if not rows.size:
            return
        fb = self._rows_batch(host_batch, batch.block_tables, rows, host_batch.token_ids[rows])
        self._forward(fb, self.features[fb.slot_mapping], kv_only=True)
        self.num_forward_calls += 1

    # ---- drafting

    def propose(self, *args, **kwargs):
        try:
            return super().propose(*args, **kwargs)
        finally:
            self._hidden, self._hidden_row = None, {}

    def _step_logits(self, batch, block_tables, plans, live, rows, tokens, step: int):
        fb = self._rows_batch(batch, block_tables, rows, tokens)
        if step == 0:
            hidden = self.features[fb.slot_mapping]
        else:
            at = np.array([self._hidden_row[i] for i in live], np.int64)
            hidden = self._hidden[self.backend.asarray(at)]
        final, prenorm = self._forward(fb, hidden)
        self.num_forward_calls += 1
        self._hidden, self._hidden_row = prenorm, {i: r for r, i in enumerate(live)}
        return self.model.logits(final)

    def _forward(self, fb: ForwardBatch, hidden, kv_only: bool = False):
        """The head over the rows `fb` (made by _rows_batch) with their hidden inputs."""
        return self.model.forward(fb, self.kv_caches, hidden, kv_only=kv_only)

    def _rows_batch(self, batch, block_tables, rows, tokens) -> ForwardBatch:
        """The head's rows for rows `rows` (ascending, each at a position > 0) of the target's
        host batch: its tokens `tokens`, one position earlier, in the slots of those positions;
        the arrays on the backend, with `block_tables` the batch's tables there."""
        be = self.backend
        seq_of_row = np.searchsorted(batch.query_start_loc[1:], rows, side="right")
        seqs, counts = np.unique(seq_of_row, return_counts=True)
        query_start_loc = np.zeros(len(seqs) + 1, np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        positions = (batch.positions[rows] - 1).astype(np.int32)
        seq_lens = positions[query_start_loc[1:] - 1] + 1
        return ForwardBatch(
            self._known(be.asarray(np.asarray(tokens, np.int32))), be.asarray(positions),
            self._previous_slots(batch, block_tables, rows, seq_of_row),
            be.asarray(query_start_loc), be.asarray(seq_lens.astype(np.int32)),
            block_tables[be.asarray(seqs.astype(np.int64))],
            be.asarray(np.zeros(0, np.int32)))

    def _previous_slots(self, batch, block_tables, rows, seq_of_row):
        """The slots of the positions before rows `rows` (on the backend): the previous row's,
        or for a sequence's first row of the step one looked up in its block table."""
        be, bs = self.backend, self.block_size
        slots = be.asarray(batch.slot_mapping[np.maximum(rows - 1, 0)].astype(np.int32))
        first = np.flatnonzero(rows == batch.query_start_loc[seq_of_row])
        if first.size:
            p = batch.positions[rows[first]].astype(np.int64) - 1
            blocks = block_tables[be.asarray(seq_of_row[first].astype(np.int64)),
                                  be.asarray(p // bs)]
            slots[be.asarray(first)] = (blocks * bs + be.asarray(p % bs)).astype(np.int32)
        return slots

"""MTP proposals: the target checkpoint's own multi-token-prediction head (DeepSeek-V3's,
engine/models/deepseek_mtp.py; Qwen3-Next's and Qwen3.5's, engine/models/qwen3_next_mtp.py)
drafts from the target's final-norm hidden states, one forward of its decoder layer per draft.

The bookkeeping is EAGLE-3's (engine/spec/eagle3.py), with the target's final-norm output of p
(a FinalCapture, every row of every target forward) as the features f(p):

- the feature pool: f(p) at the slot of p; the head's latent cache: its row for p at the slot of
  p; both in the target's blocks, so prefix caching, preemption and rollback carry them;
- `mirror`: after each target forward, the head's row for q - 1 (token at q, f(q - 1), RoPE
  position q - 1) for every batch row at q > 0, K/V only;
- `propose`: step 0 is the head's row for L - 2 (the last known token, f(L - 2)), step i its row
  for L - 2 + i (d_i, the previous step's output: DeepSeek's prenorm, Qwen3-Next's normed).

DeepSeek's head reads a zero embedding at position 0 (vLLM's masking): the proposer tells the
head which rows those are from the host's positions. On a hybrid target (Qwen3-Next) the pools
are the same: the head's layer is full attention, and only the target's linear layers keep
per-sequence state (their rollback: engine/core/hybrid_state.py). EAGLE-3's one inexactness carries over (a row at
the end of a shared block depends on the next block's first token), in the drafts only.

Under tensor parallel the head is sharded as the target is and every rank runs its forwards in
lockstep: rank 0 sends each drafting forward's rows and tokens first (`peers`), the other ranks
mirror each step themselves (engine/parallel/draft_steps.py says why, and not rank 0 alone).
"""
from __future__ import annotations

import numpy as np

from engine.models.llama import FinalCapture
from engine.parallel.draft_steps import DraftStep
from engine.runner.forward_batch import ForwardBatch
from engine.spec.eagle3 import Eagle3Proposer


class MtpProposer(Eagle3Proposer):
    def __init__(self, head, backend, num_blocks: int, block_size: int,
                 kv_cache_dtype: str, target_vocab_size: int):
        """head: a DeepseekMtpHead or a Qwen3NextMtpHead."""
        self.model = head
        self.model_config = head.config
        self.backend = backend
        self.block_size = block_size
        self.target_vocab_size = target_vocab_size
        self.embed_vocab_size = target_vocab_size
        self.kv_caches = head.new_kv_caches(num_blocks, block_size,
                                            backend.kv_cache_dtype(kv_cache_dtype))
        self.features = backend.xp.zeros((num_blocks * block_size, head.hidden_size),
                                         dtype=backend.act_dtype)
        self.capture = FinalCapture()      # the target's runner fills it
        self.num_forward_calls = 0
        self._hidden = None
        self._hidden_row = {}
        self._first_rows = None    # the last _rows_batch's rows at position 0 (host)
        self.peers = None          # rank 0 under tensor parallel: a steps.StepSender

    @staticmethod
    def bytes_per_block(head, block_size: int, kv_dtype, act_dtype) -> int:
        """Both pools' bytes for one of the target's blocks: the head's K/V (or latent) and a
        hidden row per token."""
        return head.bytes_per_block(block_size, kv_dtype, act_dtype)

    def _step_logits(self, batch, block_tables, plans, live, rows, tokens, step: int):
        if self.peers is not None:      # the other ranks run this forward on their shards
            self.peers.send(DraftStep(step, list(live), rows, tokens,
                                      batch if step == 0 else None))
            if step == 0:   # the tables' changes reached them with it (and are applied here)
                batch.block_table_update = None
        return super()._step_logits(batch, block_tables, plans, live, rows, tokens, step)

    def _rows_batch(self, batch, block_tables, rows, tokens) -> ForwardBatch:
        self._first_rows = np.flatnonzero(batch.positions[rows] == 1)
        return super()._rows_batch(batch, block_tables, rows, tokens)

    def _forward(self, fb: ForwardBatch, hidden, kv_only: bool = False):
        return self.model.forward(fb, self.kv_caches, hidden, kv_only=kv_only,
                                  first_rows=self._first_rows)

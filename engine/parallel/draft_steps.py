"""An MTP head's drafting forwards under tensor parallel: every rank runs them in lockstep.

The head (engine/models/deepseek_mtp.py, qwen3_next_mtp.py) is built from the target's layers, so
under tensor parallel it is sharded as they are: each rank holds its share of the head's
attention heads and MLP (or experts), all-reduced, and reads the target's vocab-parallel
embedding and LM head (or the head's own shared_head.head, replicated). Its inputs are there on
every rank: the target's final hidden states are whole on each after the last all-reduce, so
each rank fills its own feature pool, and `mirror` (the head's K/V of each step) needs nothing
but the step's inputs, which every rank has. Only the drafted tokens are rank 0's: it samples
each draft from the gathered logits, and the next drafting forward reads it. So rank 0 sends a
DraftStep before each drafting forward (its rows and tokens; the first one also the step's
batch, with the block tables' changes the draft reads), and the other ranks run the same forward.

Why sharded in lockstep rather than the head whole on rank 0 (as a draft model runs): the head is
a full decoder layer of the target's (DeepSeek-V3's is an MoE layer of 256 experts, about 11 GB
in FP8), which rank 0 alone would have to hold and run whole, read apart from the sharded load,
beside a whole copy of the embedding and LM head; sharded, it loads with the target's shards and
costs each rank 1/N of it, for one small message per drafting forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class DraftStep:
    """One drafting forward of the head (engine/spec/draft_model.py's propose loop)."""
    step: int                   # 0 for the first draft of the step's sequences
    live: list[int]             # the plans drafting in this forward
    rows: np.ndarray            # their rows of the step's batch
    tokens: np.ndarray          # the tokens they read
    batch: object = None        # step 0: the step's host ForwardBatch (block-table changes too)


class PeerDrafts:
    """A rank past 0's side: runs each DraftStep on its own shard of the head."""

    def __init__(self, runner, proposer):
        self.runner, self.proposer = runner, proposer
        self.batch = self.tables = None

    def run(self, message: DraftStep) -> None:
        p = self.proposer
        if message.batch is not None:
            self.batch = message.batch
            self.tables = self.runner.to_device(message.batch).block_tables
        # the logits are gathered across the ranks (a collective), then dropped: rank 0 samples
        p._step_logits(self.batch, self.tables, None, message.live, message.rows,
                       message.tokens, message.step)

    def mirror(self, batch) -> None:
        """After each of the target's steps, as rank 0's Speculator.mirror."""
        self.proposer.mirror(self.runner.to_device(batch), batch)

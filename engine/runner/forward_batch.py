"""The flat arrays one forward call sees (DESIGN.md section 5: batch arrays)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(slots=True)
class ForwardBatch:
    token_ids: np.ndarray        # (T,) int32, the tokens computed this step, sequence after sequence
    positions: np.ndarray        # (T,) int32
    slot_mapping: np.ndarray     # (T,) int32, KV slot of each token, -1 = do not write
    query_start_loc: np.ndarray  # (B+1,) int32, row offsets of each sequence in token_ids
    seq_lens: np.ndarray         # (B,) int32, context length including this step's tokens
    # (B, max_blocks) int32, padded with 0; None in a batch prepared for a device that keeps the
    # block tables itself (engine/runner/device_block_tables.py): it gathers block_table_rows there.
    block_tables: np.ndarray | None
    logits_indices: np.ndarray   # (S,) int32, rows whose logits are sampled
    # Where the batch's tables come from (ModelRunner.prepare sets them; hand-made batches that
    # give block_tables need not): each sequence's row of the persistent table
    # (engine/runner/input_buffers.py), the batch's width (its longest block table), and the table's
    # changes the device must apply before this batch runs (None on the CPU).
    block_table_rows: np.ndarray | None = None    # (B,) int32
    block_table_width: int = 0
    block_table_update: object = None             # an input_buffers.BlockTableUpdate
    # Image rows of a vision-language model's step (engine/vision/runner.py), else None.
    vision: object = None
    # a hybrid model's state rows this step (engine/core/hybrid_state.StatePlan), else None
    state_plan: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def map(self, fn) -> "ForwardBatch":
        """The same batch with fn applied to every array (e.g. a copy to the device); the
        width, the update and absent arrays (None) are kept as they are."""
        return ForwardBatch(*(v if v is None or f.name in _NOT_ARRAYS else fn(v)
                              for f, v in ((f, getattr(self, f.name)) for f in fields(self))))


_NOT_ARRAYS = ("block_table_width", "block_table_update", "vision", "state_plan")

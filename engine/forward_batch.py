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
    block_tables: np.ndarray     # (B, max_blocks) int32, padded with 0
    logits_indices: np.ndarray   # (S,) int32, rows whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def map(self, fn) -> "ForwardBatch":
        """The same batch with fn applied to every array (e.g. a copy to the device)."""
        return ForwardBatch(*(fn(getattr(self, f.name)) for f in fields(self)))

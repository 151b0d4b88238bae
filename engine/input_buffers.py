"""Persistent block tables: each running sequence keeps one row of a single array, and a step
writes only the blocks a sequence gained since its last step, so preparing a batch costs the
new blocks, not every sequence's whole table (a 4k-token context is 256 ids per step otherwise).

A row is rewritten from scratch when its sequence lost its blocks (preemption frees them and
allocates new ones later); rows of finished sequences are reused once the free rows run out.
Rows are padded with 0 past a sequence's blocks, as ForwardBatch.block_tables is.
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, num_rows: int = 64, width: int = 64):
        self.table = np.zeros((num_rows, width), np.int32)
        # seq_id -> [sequence, row, blocks written, the sequence's num_preemptions then]
        self.entries: dict[int, list] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def rows_for(self, seqs: list) -> np.ndarray:
        """The row of each sequence, brought up to date with its block table."""
        rows = np.empty(len(seqs), np.intp)
        widest = max(len(seq.block_table) for seq in seqs)
        if widest > self.table.shape[1]:
            self._widen(widest)
        for i, seq in enumerate(seqs):
            entry = self.entries.get(seq.seq_id)
            blocks = seq.block_table
            if entry is None:
                entry = self.entries[seq.seq_id] = [seq, self._take_row(), 0, seq.num_preemptions]
            elif entry[3] != seq.num_preemptions or entry[2] > len(blocks):  # lost its blocks
                self.table[entry[1]] = 0
                entry[2], entry[3] = 0, seq.num_preemptions
            row, written = entry[1], entry[2]
            if len(blocks) > written:
                self.table[row, written:len(blocks)] = blocks[written:]
                entry[2] = len(blocks)
            rows[i] = row
        return rows

    def _take_row(self) -> int:
        if not self.free_rows:
            for seq_id, (seq, row, _, _) in list(self.entries.items()):
                if seq.is_finished:
                    del self.entries[seq_id]
                    self.table[row] = 0
                    self.free_rows.append(row)
        if not self.free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def _widen(self, width: int):
        wider = np.zeros((self.table.shape[0], max(width, 2 * self.table.shape[1])), np.int32)
        wider[:, :self.table.shape[1]] = self.table
        self.table = wider

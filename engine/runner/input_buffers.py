"""Persistent block tables: each running sequence keeps one row of a single array, and a step
writes only the blocks a sequence gained since its last step, so preparing a batch costs the
new blocks, not every sequence's whole table (a 4k-token context is 256 ids per step otherwise).

A row is rewritten from scratch when its sequence lost its blocks (preemption frees them and
allocates new ones later). A verify step that rejects drafts may free a sequence's last blocks
(BlockPool.trim, which leaves `Sequence.trimmed_to`): the row's entries from there on are zeroed
and written again with whatever blocks the sequence holds by then. When the free rows run out, the rows of finished sequences and of
sequences preempted since their row was written (it would be rewritten anyway) are taken back
first, so the rows in use stay within the running sequences (at most max_num_seqs) and a table
reserved for them never grows. Rows are padded with 0 past a sequence's blocks, as
ForwardBatch.block_tables is.

With `record_updates`, the table also records what changed, for a device copy of it
(engine/runner/device_block_tables.py) and for the other ranks of a tensor- or pipeline-parallel
engine (engine/parallel/steps.py): `take_update()` returns the changes since the previous call,
the table's shape after them (a copy that is smaller grows to it first, keeping its entries: a
resize moves no entry), the rows zeroed and the entries written; the whole table only as the
first update after recording starts (a copy made then starts from it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class BlockTableUpdate:
    """The changes to a block table since the previous update, applied in this order: `table`
    (when not None, a copy of the whole table: the first update after recording started;
    everything else is empty), else growing to `shape` (new entries zero, the others kept where
    they were) when the copy is smaller, then the rows zeroed, then the entries written. `packed` is one int32 array, so the device
    gets it in one copy: the C zeroed rows, the N flat indices (row * width + column), the N ids."""
    shape: tuple[int, int]     # the table's (rows, width) after this update
    table: np.ndarray | None   # (rows, width) int32, a copy, or None
    packed: np.ndarray         # (C + 2N,) int32
    num_cleared: int           # C

    @property
    def num_written(self) -> int:
        return (len(self.packed) - self.num_cleared) // 2


class BlockTables:
    def __init__(self, num_rows: int = 64, width: int = 64, record_updates: bool = False):
        self.table = np.zeros((num_rows, width), np.int32)
        # seq_id -> [sequence, row, blocks written, the sequence's num_preemptions then]
        self.entries: dict[int, list] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.record_updates = record_updates
        # Changes not yet taken: recording started (the next update is all of it), rows
        # zeroed, and row -> [(first column, ids)] written after any zeroing of that row.
        self._resized = True
        self._cleared: set[int] = set()
        self._written: dict[int, list[tuple[int, list]]] = {}

    def rows_for(self, seqs: list) -> np.ndarray:
        """The row of each sequence, brought up to date with its block table."""
        rows = np.empty(len(seqs), np.intp)
        widest = max(len(seq.block_table) for seq in seqs)
        if widest > self.table.shape[1]:
            self._resize(self.table.shape[0], max(widest, 2 * self.table.shape[1]))
        for i, seq in enumerate(seqs):
            entry = self.entries.get(seq.seq_id)
            blocks = seq.block_table
            if entry is None:
                entry = self.entries[seq.seq_id] = [seq, self._take_row(), 0, seq.num_preemptions]
            else:
                if (seq.trimmed_to is not None and seq.trimmed_to < entry[2]
                        and entry[3] == seq.num_preemptions):   # lost its last blocks
                    self._zero(entry[1], seq.trimmed_to, entry[2])
                    entry[2] = seq.trimmed_to
                if entry[3] != seq.num_preemptions or entry[2] > len(blocks):  # lost its blocks
                    self._clear(entry[1])
                    entry[2], entry[3] = 0, seq.num_preemptions
            seq.trimmed_to = None
            row, written = entry[1], entry[2]
            if len(blocks) > written:
                self.table[row, written:len(blocks)] = blocks[written:]
                if self.record_updates and not self._resized:
                    self._written.setdefault(row, []).append((written, blocks[written:]))
                entry[2] = len(blocks)
            rows[i] = row
        return rows

    def start_recording(self) -> None:
        """Record changes from now on; the next update is the whole table."""
        self.record_updates = True
        self._resized = True

    def reserve(self, num_rows: int, width: int) -> None:
        """At least num_rows rows of at least `width` blocks, now (a table whose address must not
        change later, as a CUDA graph's, is reserved at its final size before it is captured)."""
        rows, cols = self.table.shape
        if num_rows > rows or width > cols:
            self._resize(max(num_rows, rows), max(width, cols))

    def take_update(self) -> BlockTableUpdate:
        """The changes since the previous call (record_updates must be on)."""
        if not self.record_updates:
            raise RuntimeError("BlockTables.take_update needs record_updates=True")
        rows, width = self.table.shape
        if self._resized:
            update = BlockTableUpdate((rows, width), self.table.copy(), np.zeros(0, np.int32), 0)
        else:       # a step writes a few ids: Python lists, then one array
            cleared = list(self._cleared)
            index, ids = [], []
            for row, segments in self._written.items():
                for first, blocks in segments:
                    start = row * width + first
                    index.extend(range(start, start + len(blocks)))
                    ids.extend(blocks)
            packed = np.array(cleared + index + ids, np.int32)
            update = BlockTableUpdate((rows, width), None, packed, len(cleared))
        self._resized = False
        self._cleared.clear()
        self._written.clear()
        return update

    def _zero(self, row: int, first: int, end: int) -> None:
        self.table[row, first:end] = 0
        if self.record_updates and not self._resized:
            self._written.setdefault(row, []).append((first, [0] * (end - first)))

    def _clear(self, row: int) -> None:
        self.table[row] = 0
        if self.record_updates and not self._resized:
            self._written.pop(row, None)    # zeroed after them: those writes are gone
            self._cleared.add(row)

    def _take_row(self) -> int:
        if not self.free_rows:
            for seq_id, (seq, row, _, preemptions) in list(self.entries.items()):
                if seq.is_finished or seq.num_preemptions != preemptions:
                    del self.entries[seq_id]
                    self._clear(row)
                    self.free_rows.append(row)
        if not self.free_rows:
            self._resize(2 * self.table.shape[0], self.table.shape[1])
        return self.free_rows.pop()

    def _resize(self, num_rows: int, width: int) -> None:
        """Rows past the old ones are free and given out first-to-last, after those free now.
        Every entry keeps its row and column, so the changes not yet taken stay valid, and the
        update carries the new shape only (a copy grows the same way)."""
        old_rows, old_width = self.table.shape
        table = np.zeros((num_rows, width), np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        self.free_rows = list(range(num_rows - 1, old_rows - 1, -1)) + self.free_rows

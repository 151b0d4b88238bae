"""The persistent block tables (engine/runner/input_buffers.py) kept on the device, so a step sends the
device only what changed instead of the batch's whole (B, width) table.

Without it every CUDA step copies its block table to the device, and a decode graph's static
input is (bucket, max_blocks_per_seq) wide: with max_model_len 128k and block size 16 that is
8,192 ids a row, 8 MiB a step at 256 sequences, packed on the host and sent over PCIe, though a
decode step changes a few entries (a sequence gains a block every 16 tokens). Here the device
holds the same (rows, width) int32 table; each step applies the host's BlockTableUpdate with one
small host-to-device copy (rows zeroed, flat indices, ids) and two device ops (zero the rows,
scatter the ids), and the forward gathers its rows on the device (`gather`, or inside a decode
graph). The table is reallocated only when the host table changes shape (more rows, wider),
which a table reserved at its final size never does; the update then carries the new shape, not
the table: the device grows its own copy (so a rank of a tensor-parallel engine, which keeps
its own table from rank 0's updates, receives O(new blocks) a step, never O(table)).

One row past the host's rows is always zero: a decode graph's padding rows point at it, so they
read block 0 as they did when the padding was written into the copied table.

What a kernel reads: the attention kernels (cuda/attention_decode.cu, attention_prefill*.cu and
the CPU ones) read entries of row b only for keys j < seq_lens[b], i.e. the first
ceil(seq_len / block_size) entries; so stale ids past them could not change a result. They are
zeroed anyway (a reused or rewritten row is zeroed first, on the host and here alike), so the
device table equals the host table exactly and tests can compare them.

Ordering: updates travel with the batch they belong to (ForwardBatch.block_table_update) and are
applied by the forward thread just before that batch runs, on the backend's stream, so they never
race a forward still reading the rows an earlier batch saw: the engine thread that prepares the
next step touches only the host table. The pinned staging buffer is rewritten by the next apply,
which the engine runs only after the previous step's results came back (as CudaGraphRunner.run's
staging buffer).
"""
from __future__ import annotations

import numpy as np

from engine.runner.input_buffers import BlockTables, BlockTableUpdate


class DeviceBlockTables:
    """The device copy of a host BlockTables (which it sets to record its changes).

    The backend provides xp, asarray, pinned_empty(n, dtype) and copy_to_device_async(dst, src)
    (CudaBackend; tests use NumPy fakes)."""

    def __init__(self, backend, host: BlockTables):
        self.backend = backend
        self.host = host
        host.start_recording()          # the first update is the whole table
        self.table = None               # (rows + 1, width) int32 on the device; the last row 0
        self._pinned = None             # staging for an update's packed ints
        self._staged = None             # ... and their device copy
        self.num_reallocations = 0
        self.apply(host.take_update())

    @property
    def zero_row(self) -> int:
        """A row that is all zero (block 0 everywhere): the padding rows' row."""
        return self.table.shape[0] - 1

    def apply(self, update: BlockTableUpdate | None) -> None:
        """Brings the device table to the host table as of `update` (updates in host order)."""
        if update is None:
            return
        if update.table is not None:
            rows, width = update.shape
            if (rows + 1) * width >= 2**31:
                raise ValueError(f"a {rows} x {width} block table needs 64-bit flat indices")
            full = np.zeros((rows + 1, width), np.int32)
            full[:rows] = update.table
            self.table = self.backend.asarray(full)
            self.num_reallocations += 1
            return
        if (self.table.shape[0] - 1, self.table.shape[1]) != update.shape:
            self._grow(*update.shape)
        n = len(update.packed)
        if n == 0:
            return
        if self._pinned is None or len(self._pinned) < n:
            size = max(n, 2 * (0 if self._pinned is None else len(self._pinned)), 256)
            self._pinned = self.backend.pinned_empty(size, np.int32)
            self._staged = self.backend.xp.empty(size, np.int32)
        self._pinned[:n] = update.packed
        self.backend.copy_to_device_async(self._staged[:n], self._pinned[:n])
        c, w = update.num_cleared, update.num_written
        if c:
            self.table[self._staged[:c]] = 0
        if w:
            self.table.reshape(-1)[self._staged[c:c + w]] = self._staged[c + w:c + 2 * w]

    def _grow(self, rows: int, width: int) -> None:
        """The table at the host's new shape: its entries kept where they are, the new ones
        (and the zero row, now last) zero; a device-side copy."""
        old_rows, old_width = self.table.shape[0] - 1, self.table.shape[1]
        if rows < old_rows or width < old_width:
            raise ValueError(f"an update of a {(rows, width)} table for a device table of "
                             f"{self.table.shape}: updates were lost or reordered")
        if (rows + 1) * width >= 2**31:
            raise ValueError(f"a {rows} x {width} block table needs 64-bit flat indices")
        grown = self.backend.xp.zeros((rows + 1, width), np.int32)
        grown[:old_rows, :old_width] = self.table[:old_rows]
        self.table = grown
        self.num_reallocations += 1

    def gather(self, rows, width: int):
        """(B, width) block tables of a batch: rows (B,) int32 on the device; a device op."""
        return self.table[rows, :width]

    def reserve(self, num_rows: int, width: int) -> None:
        """Grows the host table to at least this size and reallocates here now, so later steps
        keep this table's address (a decode graph reads it)."""
        self.host.reserve(num_rows, width)
        self.apply(self.host.take_update())

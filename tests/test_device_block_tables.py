"""The device copy of the persistent block tables (engine/runner/device_block_tables.py) against the host
table it mirrors (engine/runner/input_buffers.py), on a NumPy "device" that counts what it is sent: the
exact updates a host table records, and, over seeded random runs with sequences arriving,
growing, being preempted (rows rewritten), finishing (rows reused) and the table growing and
widening, the device table equal to the host table after every step, element for element."""
import numpy as np
import pytest

from engine.runner.device_block_tables import DeviceBlockTables
from engine.runner.input_buffers import BlockTables

I32 = np.int32


class CountingDevice:
    """A backend whose "device" arrays are NumPy copies; counts the host-to-device copies."""
    xp = np

    def __init__(self):
        self.copies = []            # ints per copy

    @staticmethod
    def asarray(a):
        return np.array(a)

    @staticmethod
    def pinned_empty(n, dtype):
        return np.full(n, -7777, dtype)     # poisoned: a stale staging element shows

    def copy_to_device_async(self, dst, src):
        assert dst.dtype == src.dtype == I32 and dst.shape == src.shape
        self.copies.append(src.size)
        np.copyto(dst, src)


class FakeSeq:
    def __init__(self, seq_id, blocks=()):
        self.seq_id, self.block_table = seq_id, list(blocks)
        self.num_preemptions, self.is_finished = 0, False
        self.trimmed_to = None      # BlockPool.trim's mark (speculative decoding's rollback)


def test_updates_are_exactly_the_changes():
    tables = BlockTables(num_rows=2, width=4, record_updates=True)
    first = tables.take_update()
    assert first.table.tolist() == [[0] * 4] * 2 and first.shape == (2, 4)
    a, b, c = FakeSeq(0, [7]), FakeSeq(1, [3, 4]), FakeSeq(2, [1])
    assert tables.rows_for([a, b]).tolist() == [0, 1]
    u = tables.take_update()
    # no zeroed rows; flat indices row * 4 + column; the ids
    assert (u.table, u.num_cleared, u.num_written) == (None, 0, 3)
    assert u.packed.tolist() == [0, 4, 5, 7, 3, 4]
    assert tables.take_update().packed.tolist() == []      # nothing new
    a.block_table.append(9)
    tables.rows_for([a, b])
    assert tables.take_update().packed.tolist() == [1, 9]  # only the new block
    a.block_table[:] = [5, 6]                              # preempted, new blocks
    a.num_preemptions = 1
    tables.rows_for([a])
    u = tables.take_update()
    assert (u.num_cleared, u.packed.tolist()) == (1, [0, 0, 1, 5, 6])   # row 0 zeroed, rewritten
    b.is_finished = True                                   # its row is reused by c
    assert tables.rows_for([c]).tolist() == [1]
    u = tables.take_update()
    assert (u.num_cleared, u.packed.tolist()) == (1, [1, 4, 1])
    # written, then zeroed (preempted), then written again before one update: the zeroing
    # drops the writes before it
    c.block_table.append(2)
    tables.rows_for([c])
    c.block_table[:] = [8]
    c.num_preemptions = 1
    tables.rows_for([c])
    u = tables.take_update()
    assert (u.num_cleared, u.packed.tolist()) == (1, [1, 4, 8])
    # a verify step's rollback (BlockPool.trim) cut c to no block past [8], then it grew by
    # another one: the cut entries are zeroed and the new one written
    c.block_table[:] = [8, 6, 7]
    tables.rows_for([c])
    tables.take_update()
    c.block_table[:] = [8, 9]
    c.trimmed_to = 1
    tables.rows_for([c])
    assert c.trimmed_to is None and tables.table[1].tolist() == [8, 9, 0, 0]
    u = tables.take_update()
    assert (u.num_cleared, u.packed.tolist()) == (0, [5, 6, 5, 0, 0, 9])
    # widening the table: the update carries its new shape, never the whole table, then the
    # changes at the new width (a's row reused: zeroed, written)
    a.is_finished = True
    tables.rows_for([FakeSeq(3, [1, 2, 3, 4, 5])])
    u = tables.take_update()
    assert u.shape == (2, 8) and u.table is None
    assert (u.num_cleared, u.packed.tolist()) == (1, [0, 0, 1, 2, 3, 4, 1, 2, 3, 4, 5])
    assert tables.table.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [8, 9] + [0] * 6]
    with pytest.raises(RuntimeError, match="record_updates"):
        BlockTables().take_update()


def test_rows_of_preempted_sequences_are_taken_back_before_the_table_grows():
    tables = BlockTables(num_rows=2, width=2)
    a, b = FakeSeq(0, [1]), FakeSeq(1, [2])
    assert tables.rows_for([a, b]).tolist() == [0, 1]
    b.num_preemptions, b.block_table = 1, []              # preempted: waits, holds no blocks
    c = FakeSeq(2, [3])
    assert tables.rows_for([c]).tolist() == [1]            # b's row, zeroed and rewritten
    assert tables.table.tolist() == [[1, 0], [3, 0]]
    b.block_table = [4]                                    # resumed: 3 running need 3 rows
    assert tables.rows_for([a, b, c]).tolist() == [0, 2, 1]
    assert tables.table.shape == (4, 2)


def test_device_table_applies_updates_with_one_small_copy():
    host = BlockTables(num_rows=4, width=8)
    device = CountingDevice()
    tables = DeviceBlockTables(device, host)
    assert host.record_updates and tables.num_reallocations == 1 and device.copies == []
    assert tables.table.shape == (5, 8) and tables.zero_row == 4
    a, b = FakeSeq(0, [3, 4, 5]), FakeSeq(1, [6])
    rows = host.rows_for([a, b])
    tables.apply(host.take_update())
    assert device.copies == [8]                     # 4 ids: 4 indices + 4 ids, one copy
    assert tables.table[:4].tolist() == host.table.tolist() and not tables.table[4].any()
    assert tables.gather(rows, 3).tolist() == [[3, 4, 5], [6, 0, 0]]
    tables.apply(host.take_update())                # nothing changed: nothing sent
    assert device.copies == [8]
    tables.reserve(4, 8)                            # already that big: the same table
    assert tables.num_reallocations == 1
    tables.reserve(16, 32)
    assert tables.num_reallocations == 2 and tables.table.shape == (17, 32)
    assert tables.table[:16].tolist() == host.table.tolist()
    with pytest.raises(ValueError, match="updates were lost"):
        stale = BlockTables(num_rows=4, width=8, record_updates=True)
        stale.take_update()
        tables.apply(stale.take_update())


@pytest.mark.parametrize("seed", range(6))
def test_device_table_equals_host_table_over_random_runs(seed):
    """Sequences arrive, gain blocks (now and then many at once: the table widens), are
    preempted and come back with new blocks, finish (their rows are reused); a step's batch is
    a random subset of the running ones, and some updates cover two steps' changes."""
    rng = np.random.default_rng(seed)
    host = BlockTables(num_rows=2, width=2)
    device = CountingDevice()
    tables = DeviceBlockTables(device, host)
    running, preempted, next_id = [], [], 0
    checked_reuse = checked_preemption = checked_trim = 0
    for step in range(300):
        for _ in range(rng.integers(0, 3)):
            if len(running) < 12:
                running.append(FakeSeq(next_id, rng.integers(1, 10**6, rng.integers(1, 4))))
                next_id += 1
        for seq in running:
            if rng.random() < 0.3:
                many = 20 if rng.random() < 0.03 else 1
                seq.block_table += rng.integers(1, 10**6, many).tolist()
        if running and rng.random() < 0.1:                      # preempt one
            seq = running.pop(rng.integers(len(running)))
            seq.block_table, seq.num_preemptions = [], seq.num_preemptions + 1
            preempted.append(seq)
        for seq in running:                                     # a rollback, maybe regrown
            if len(seq.block_table) > 1 and rng.random() < 0.1:
                keep = int(rng.integers(1, len(seq.block_table)))
                seq.block_table = seq.block_table[:keep] + rng.integers(
                    1, 10**6, rng.integers(0, 3)).tolist()
                seq.trimmed_to = keep if seq.trimmed_to is None else min(seq.trimmed_to, keep)
                checked_trim += 1
        if preempted and rng.random() < 0.2:                    # resume one, new blocks
            seq = preempted.pop(0)
            seq.block_table = rng.integers(1, 10**6, rng.integers(1, 6)).tolist()
            running.append(seq)
            checked_preemption += 1
        if running and rng.random() < 0.15:                     # finish one
            running.pop(rng.integers(len(running))).is_finished = True
        if not running:
            continue
        batch = [s for s in running if rng.random() < 0.8] or running[:1]
        before = len(host.free_rows) == 0
        rows = host.rows_for(batch)
        checked_reuse += before
        if rng.random() < 0.3:          # this update waits for the next step's changes too
            continue
        update = host.take_update()
        sent = len(device.copies)
        tables.apply(update)
        if update.table is None:        # one copy of exactly the update's ints, if any
            assert device.copies[sent:] == ([len(update.packed)] if len(update.packed) else [])
        assert np.array_equal(tables.table[:-1], host.table), step
        assert not tables.table[-1].any()
        width = max(len(s.block_table) for s in batch)
        assert np.array_equal(tables.gather(rows, width), host.table[rows, :width])
        for seq, row in zip(batch, rows):                       # the host table itself
            k = len(seq.block_table)
            assert host.table[row, :k].tolist() == list(seq.block_table)
            assert not host.table[row, k:].any()
    assert checked_reuse > 10 and checked_preemption > 5 and checked_trim > 20
    assert tables.num_reallocations > 3 and host.table.shape[1] > 20   # grew and widened

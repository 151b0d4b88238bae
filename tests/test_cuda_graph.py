"""CUDA Graph decode (engine/runner/cuda_graph.py), host side, on the CPU: bucket sizes and choice, which
batches a graph can run, the padded static inputs, and the runner's bookkeeping. The runner is
driven through a fake backend whose xp is NumPy and whose "graph" replays the captured callable
(the forward on the static buffers, as a real graph replays its kernels on their addresses), so
replay must equal an eager forward of the tiny model, logits and KV cache writes alike."""
import contextlib
import types

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from engine.runner.cuda_graph import (CudaGraphRunner, bucket_for, capture_sizes,
                                      estimate_graph_memory_bytes, input_layout, is_pure_decode,
                                      pad_decode_inputs)
from engine.runner.device_block_tables import DeviceBlockTables
from engine.runner.forward_batch import ForwardBatch
from engine.runner.model_runner import ModelRunner
from engine.loader.model_loader import load_model
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence
from pyx.cpu_backend import CpuBackend

I32 = np.int32


# ---- helpers

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, model_config) of the tiny llama on the CPU backend."""
    directory = tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return load_model(directory, CpuBackend(), progress=False)


def make_seq(tokens, num_computed, block_table):
    seq = Sequence(list(tokens))
    seq.num_computed_tokens = num_computed
    seq.block_table = list(block_table)
    return seq


def schedule(seqs, num_new_tokens) -> SchedulerOutput:
    out = SchedulerOutput()
    for seq, n in zip(seqs, num_new_tokens):
        out._add(seq, n)      # the scheduler's own is_decode / sample rules
    return out


def hand_batch(num_seqs, width=1, logits_indices=None):
    """A pure decode batch written by hand (no model needed)."""
    B = num_seqs
    return ForwardBatch(
        token_ids=np.arange(B, dtype=I32) + 3, positions=np.full(B, 4, I32),
        slot_mapping=np.arange(B, dtype=I32) * 8 + 4, query_start_loc=np.arange(B + 1, dtype=I32),
        seq_lens=np.full(B, 5, I32), block_tables=np.ones((B, width), I32),
        logits_indices=np.arange(B, dtype=I32) if logits_indices is None
        else np.asarray(logits_indices, I32),
        block_table_rows=np.zeros(B, I32), block_table_width=width)


@pytest.fixture(scope="module")
def runner4(tiny):
    """A ModelRunner with block size 4, for prepare()."""
    model, config = tiny
    return ModelRunner(model, config, CpuBackend(), block_size=4, num_blocks=16)


def two_decodes():
    # a: 10 tokens, 9 computed: token 109 at position 9, block 7 (= table[9 // 4]) offset 1
    # b: 6 tokens, 5 computed: token 205 at position 5, block 4 (= table[5 // 4]) offset 1
    a = make_seq(range(100, 110), 9, [3, 5, 7])
    b = make_seq(range(200, 206), 5, [2, 4])
    return a, b


# ---- buckets

def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(2) == [1, 2]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 33]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_bucket_for():
    sizes = [1, 2, 4, 8, 12]
    assert [bucket_for(n, sizes) for n in range(1, 14)] == \
        [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, None]
    assert bucket_for(1, [1]) == 1 and bucket_for(2, [1]) is None
    with pytest.raises(ValueError, match="at least one sequence"):
        bucket_for(0, sizes)


# ---- which batches are pure decode

def test_is_pure_decode_on_prepared_batches(runner4):
    a, b = two_decodes()
    assert is_pure_decode(runner4.prepare(schedule([a, b], [1, 1])))
    assert is_pure_decode(runner4.prepare(schedule([b], [1])))
    # a prefill chunk beside a decode: 1 + 5 tokens for 2 sequences
    fresh = make_seq(range(300, 305), 0, [9, 10])
    assert not is_pure_decode(runner4.prepare(schedule([a, fresh], [1, 5])))
    # a prompt's last token computed alone is sampled: one token, one logits row, pure decode
    last = make_seq(range(400, 406), 5, [11, 12])
    assert schedule([last], [1]).is_decode == [False]
    assert is_pure_decode(runner4.prepare(schedule([a, last], [1, 1])))
    # a one-token prefill chunk that does not reach the prompt's end samples nothing
    middle = make_seq(range(500, 506), 3, [13, 14])
    batch = runner4.prepare(schedule([a, middle], [1, 1]))
    assert batch.num_tokens == batch.num_seqs == 2 and batch.logits_indices.tolist() == [0]
    assert not is_pure_decode(batch)


def test_is_pure_decode_by_hand():
    assert is_pure_decode(hand_batch(3))
    assert not is_pure_decode(hand_batch(2, logits_indices=[1, 0]))
    assert not is_pure_decode(hand_batch(2, logits_indices=[0]))
    gap = hand_batch(2)
    gap.query_start_loc = np.array([0, 0, 2], I32)   # T == B, but one sequence has 2 tokens
    assert not is_pure_decode(gap)
    empty = hand_batch(0)
    assert not is_pure_decode(empty)


# ---- padded static inputs

def test_input_layout():
    layout, n = input_layout(2)
    assert layout == {"token_ids": (0, (2,)), "positions": (16, (2,)),
                      "slot_mapping": (32, (2,)), "query_start_loc": (48, (3,)),
                      "seq_lens": (64, (2,)), "block_table_rows": (80, (2,)),
                      "logits_indices": (96, (2,))}
    assert n == 98
    assert input_layout(12)[1] == 108


def test_pad_decode_inputs(runner4):
    batch = runner4.prepare(schedule(two_decodes(), [1, 1]))
    assert batch.block_tables.tolist() == [[3, 5, 7], [2, 4, 0]]
    a, b = batch.block_table_rows.tolist()     # the rows of the persistent table
    assert runner4.block_tables.table[[a, b], :3].tolist() == [[3, 5, 7], [2, 4, 0]]
    assert batch.block_table_width == 3
    got = pad_decode_inputs(batch, 4, 5, zero_row=99)
    want = {
        "token_ids": [109, 205, 0, 0],
        "positions": [9, 5, 0, 0],
        "slot_mapping": [29, 17, -1, -1],
        "query_start_loc": [0, 1, 2, 3, 4],
        "seq_lens": [10, 6, 1, 1],
        "block_table_rows": [a, b, 99, 99],
        "logits_indices": [0, 1, 2, 3],
    }
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == I32, name
        assert got[name].tolist() == value, name
    # an exact fit: no padding rows, the table exactly max_blocks wide
    exact = pad_decode_inputs(batch, 2, 3, zero_row=99)
    assert exact["slot_mapping"].tolist() == [29, 17]
    assert exact["block_table_rows"].tolist() == [a, b]
    assert exact["query_start_loc"].tolist() == [0, 1, 2]


def test_pad_decode_inputs_errors(runner4):
    a, b = two_decodes()
    batch = runner4.prepare(schedule([a, b], [1, 1]))
    with pytest.raises(ValueError, match="3 blocks wide, more than the graphs' max_blocks=2"):
        pad_decode_inputs(batch, 4, 2, 0)
    with pytest.raises(ValueError, match="2 sequences do not fit a graph of 1 rows"):
        pad_decode_inputs(batch, 1, 5, 0)
    fresh = make_seq(range(300, 305), 0, [9, 10])
    with pytest.raises(ValueError, match="not a pure decode batch"):
        pad_decode_inputs(runner4.prepare(schedule([a, fresh], [1, 5])), 4, 5, 0)
    with pytest.raises(ValueError, match="not a pure decode batch"):
        pad_decode_inputs(hand_batch(2, logits_indices=[1, 0]), 4, 5, 0)
    rowless = hand_batch(2)
    rowless.block_table_rows = None          # a hand-made batch with only block_tables
    with pytest.raises(ValueError, match="no block_table_rows"):
        pad_decode_inputs(rowless, 4, 5, 0)


def test_estimate_graph_memory_bytes():
    # 5 graphs (1, 2, 4, 8, 12), 108 int32 static inputs, the device table (13 rows of 5) and
    # the largest gather of it (12 rows of 5)
    fixed = 5 * 16 * 2**20 + 4 * (108 + 13 * 5 + 12 * 5)
    assert estimate_graph_memory_bytes(12, 5) == fixed
    cfg = types.SimpleNamespace(vocab_size=512, hidden_size=96, intermediate_size=192)
    per_row = 2 * 512 + 18 * 96 + 3 * 192
    assert estimate_graph_memory_bytes(12, 5, cfg) == fixed + 4 * per_row * 12
    # an EAGLE-3 head's 3 aux layers a row, twice (the forward's states and the static copy)
    assert (estimate_graph_memory_bytes(12, 5, cfg, capture_width=3 * 96)
            == fixed + 4 * (per_row + 2 * 3 * 96) * 12)


# ---- the runner, against a fake backend

class FakePool:
    def total_bytes(self):
        return 4096


class FakeGraph:
    def __init__(self, backend, fn):
        self.backend, self.fn = backend, fn

    def launch(self):
        self.backend.events.append(("launch", self))
        self.fn()       # replay: the captured forward, on the static buffers it closed over


class FakeGraphBackend:
    """The graph half of a backend on NumPy. Records calls; refuses what a real capture forbids
    (synchronizing, host-to-device copies); poisons fresh buffers so an unwritten element shows."""

    def __init__(self):
        self.events = []
        self.capturing = False
        self.pool = None
        self.free = 1 << 30
        self.xp = types.SimpleNamespace(empty=self._empty, zeros=np.zeros, copyto=np.copyto)

    @staticmethod
    def asarray(a):
        return np.array(a)      # a "device" copy

    @staticmethod
    def _empty(shape, dtype):
        dtype = np.dtype(dtype)
        return np.full(shape, -7777 if dtype.kind == "i" else np.nan, dtype)

    def new_graph_pool(self):
        self.free -= FakePool().total_bytes()    # the device memory the graphs take
        return FakePool()

    def memory_info(self):
        return self.free, 1 << 30

    @contextlib.contextmanager
    def use_graph_pool(self, pool):
        self.events.append(("pool", "on"))
        self.pool = pool
        try:
            yield
        finally:
            self.pool = None
            self.events.append(("pool", "off"))

    def capture_graph(self, fn):
        assert self.pool is not None and not self.capturing
        self.events.append(("begin_capture",))
        self.capturing = True
        try:
            fn()        # the Python runs during a real capture too (its kernels are recorded)
        finally:
            self.capturing = False
        self.events.append(("end_capture",))
        return FakeGraph(self, fn)

    def pinned_empty(self, n, dtype):
        return self._empty(n, dtype)

    def copy_to_device_async(self, dst, src):
        assert not self.capturing, "copy during capture"
        assert dst.dtype == src.dtype == I32 and dst.shape == src.shape
        self.events.append(("copy", src.size))
        np.copyto(dst, src)

    def synchronize(self):
        assert not self.capturing, "synchronize during capture"
        self.events.append(("sync",))


BLOCK_SIZE, MAX_BLOCKS, MAX_SEQS = 8, 6, 8


@pytest.fixture()
def setup(tiny):
    """Eight sequences prefilled into two identical KV caches: the eager model's and the graph
    runner's. Blocks no table holds (block 0 among them) are NaN in both, so a real row that
    reads a stray block, or a padding row whose output leaks, poisons the logits."""
    model, config = tiny
    eager = ModelRunner(model, config, CpuBackend(), BLOCK_SIZE, num_blocks=32)
    graphed = ModelRunner(model, config, CpuBackend(), BLOCK_SIZE, num_blocks=32)
    rng = np.random.default_rng(5)
    free = list(rng.permutation(np.arange(1, 32)))
    seqs = []
    for n in [5, 13, 8, 21, 3, 17, 9, 11]:
        num_blocks = -(-(n + 12) // BLOCK_SIZE)
        table = [int(free.pop()) for _ in range(num_blocks)]
        seqs.append(make_seq(rng.integers(3, 500, n).tolist(), 0, table))
    live = {b for s in seqs for b in s.block_table}
    dead = np.array(sorted(set(range(32)) - live))
    assert 0 in dead
    for k, v in eager.kv_caches:
        k[dead] = np.nan
        v[dead] = np.nan
    prefill = schedule(seqs, [len(s.token_ids) for s in seqs])
    logits = model.forward(eager.prepare(prefill), eager.kv_caches)
    for seq, row in zip(seqs, logits):
        seq.num_computed_tokens = len(seq.token_ids)
        seq.append_token(int(np.argmax(row)))
    for (ka, va), (kb, vb) in zip(eager.kv_caches, graphed.kv_caches):
        kb[...] = ka
        vb[...] = va
    backend = FakeGraphBackend()
    # The graphs' device tables mirror the eager runner's host tables, which prepare the batches.
    tables = DeviceBlockTables(backend, eager.block_tables)
    runner = CudaGraphRunner(model, backend, graphed.kv_caches, MAX_SEQS, MAX_BLOCKS, tables)
    return types.SimpleNamespace(model=model, eager=eager, graphed=graphed, seqs=seqs,
                                 backend=backend, runner=runner, tables=tables)


def test_capture_bookkeeping(setup):
    model, runner, backend = setup.model, setup.runner, setup.backend
    eager_ws = model.workspace
    assert not runner.captured and not runner.can_run(hand_batch(1))
    runner.capture()
    assert runner.captured and sorted(runner.buckets) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    # largest first; each bucket: its inputs copied, warm-up, capture, then a sync before the
    # pinned buffer is rewritten for the next bucket; all inside the private pool
    n = {s: input_layout(s)[1] for s in (1, 2, 4, 8)}
    assert backend.events == [("pool", "on")] + [
        e for s in (8, 4, 2, 1) for e in (("copy", n[s]), ("begin_capture",), ("end_capture",),
                                          ("sync",))] + [("pool", "off"), ("sync",)]
    assert runner.graph_memory_bytes == 4096 and runner.device_memory_bytes == 4096
    # the graphs have their own activation workspace; the eager one is back in place
    assert model.workspace is eager_ws and runner._workspace is not eager_ws
    # every bucket's output is a view of the one static logits buffer
    for (size, _), bucket in runner.buckets.items():
        assert bucket.logits.shape == (size, 512) and np.shares_memory(bucket.logits,
                                                                       runner._logits)
    with pytest.raises(RuntimeError, match="runs once"):
        runner.capture()


def test_replay_equals_eager(setup):
    model, runner, backend, seqs = setup.model, setup.runner, setup.backend, setup.seqs
    runner.capture()
    eager_ws = model.workspace
    steps = [[0], [1, 2], [0, 3, 5], [1, 2, 4, 6], [0, 1, 2, 3, 4], list(range(8)), [7],
             [2, 5, 6]]
    for step in steps:
        group = [seqs[i] for i in step]
        sched = schedule(group, [1] * len(group))
        assert sched.is_decode == [True] * len(group)
        batch = setup.eager.prepare(sched)
        setup.tables.apply(setup.eager.block_tables.take_update())  # as ModelRunner.execute
        assert np.array_equal(setup.tables.table[:-1], setup.eager.block_tables.table)
        assert runner.can_run(batch)
        want = model.forward(batch, setup.eager.kv_caches)
        del backend.events[:]
        got = runner.run(batch)
        size = bucket_for(len(step), [1, 2, 4, 8])
        bucket = runner.buckets[size, 1]
        # one copy of exactly this bucket's inputs, one launch of this bucket's graph
        assert backend.events == [("copy", input_layout(size)[1]),
                                  ("launch", bucket.graph)], step
        assert got.shape == want.shape == (len(step), 512)
        assert np.shares_memory(got, bucket.logits)
        # the static inputs (pinned staging and device buffer alike) hold exactly the padded
        # batch, stale rows and columns of earlier, larger or wider, batches included
        padded = pad_decode_inputs(batch, size, MAX_BLOCKS, setup.tables.zero_row)
        for name, value in padded.items():
            assert np.array_equal(bucket.host[name], value), (step, name)
            assert np.array_equal(getattr(bucket.batch, name), value), (step, name)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(step))
        # the real rows wrote their slots, the padding rows wrote nothing
        for (ka, va), (kb, vb) in zip(setup.eager.kv_caches, setup.graphed.kv_caches):
            np.testing.assert_allclose(kb, ka, rtol=1e-5, atol=1e-6, equal_nan=True)
            np.testing.assert_allclose(vb, va, rtol=1e-5, atol=1e-6, equal_nan=True)
        for seq, row in zip(group, want):
            seq.num_computed_tokens += 1
            seq.append_token(int(np.argmax(row)))
        assert model.workspace is eager_ws
    assert runner.num_replays == len(steps)


def test_can_run_and_run_refusals(setup):
    runner, seqs = setup.runner, setup.seqs
    runner.capture()
    assert runner.can_run(hand_batch(8, width=MAX_BLOCKS))
    assert not runner.can_run(hand_batch(9))                      # past the largest bucket
    assert not runner.can_run(hand_batch(2, width=MAX_BLOCKS + 1))  # table too wide
    assert not runner.can_run(hand_batch(2, logits_indices=[0]))  # not every row sampled
    # a decode beside a 3-token prompt (a fresh sequence: every prefilled one has a single
    # uncomputed token left)
    prompt = make_seq([5, 6, 7], 0, seqs[1].block_table)
    prefill = setup.eager.prepare(schedule([seqs[0], prompt], [1, 3]))
    assert not runner.can_run(prefill)
    with pytest.raises(ValueError, match="9 sequences"):
        runner.run(hand_batch(9))
    with pytest.raises(ValueError, match="7 blocks wide"):
        runner.run(hand_batch(2, width=MAX_BLOCKS + 1))
    with pytest.raises(ValueError, match="not a pure decode batch"):
        runner.run(prefill)


def test_run_before_capture(setup):
    with pytest.raises(RuntimeError, match="before capture"):
        setup.runner.run(hand_batch(1))


def decode_batch(setup, step):
    sched = schedule([setup.seqs[i] for i in step], [1] * len(step))
    return setup.eager.prepare(sched)


def test_a_steps_copy_does_not_grow_with_max_blocks(setup):
    """The block tables stay on the device: a replay copies a few ints per row, the same for
    graphs 6 blocks wide as for graphs 4096 blocks wide (64k tokens at block size 8)."""
    model, host = setup.model, setup.eager.block_tables
    wide_backend = FakeGraphBackend()
    wide_tables = DeviceBlockTables(wide_backend, host)
    wide = CudaGraphRunner(model, wide_backend, setup.graphed.kv_caches, MAX_SEQS, 4096,
                           wide_tables)
    wide.capture()                       # reserves: the host table is 4096 wide from here on
    assert host.table.shape[1] == 4096 and wide_tables.table.shape == (65, 4096)
    narrow_tables = DeviceBlockTables(setup.backend, host)
    narrow = CudaGraphRunner(model, setup.backend, setup.graphed.kv_caches, MAX_SEQS, MAX_BLOCKS,
                             narrow_tables)
    narrow.capture()
    for step in ([0], [1, 2, 3], list(range(8))):
        batch = decode_batch(setup, step)
        update = host.take_update()
        copied = {}
        for runner, tables, backend in ((narrow, narrow_tables, setup.backend),
                                        (wide, wide_tables, wide_backend)):
            del backend.events[:]
            tables.apply(update)
            logits = runner.run(batch).copy()
            copied[runner.max_blocks_per_seq] = sum(e[1] for e in backend.events
                                                    if e[0] == "copy")
            assert np.isfinite(logits).all()
        size = bucket_for(len(step), narrow.sizes)
        assert copied == {MAX_BLOCKS: input_layout(size)[1], 4096: input_layout(size)[1]}, step
        assert input_layout(size)[1] <= 7 * size + 7 * 16     # 7 arrays of <= size + 1 ints
        for seq in (setup.seqs[i] for i in step):
            seq.num_computed_tokens += 1
            seq.append_token(7)


def test_a_moved_device_table_turns_the_graphs_off(setup, caplog):
    runner, host = setup.runner, setup.eager.block_tables
    runner.capture()
    batch = decode_batch(setup, [0, 1])
    setup.tables.apply(host.take_update())
    assert runner.can_run(batch)
    host.reserve(host.table.shape[0] * 2, MAX_BLOCKS)   # more rows than reserved: reallocated
    setup.tables.apply(host.take_update())
    with caplog.at_level("WARNING", logger="taper.engine"):
        assert not runner.can_run(batch)
        assert not runner.can_run(batch)
    assert sum("reallocated" in r.message for r in caplog.records) == 1   # said once
    with pytest.raises(RuntimeError, match="moved after capture"):
        runner.run(batch)

"""CUDA graphs over speculative verify steps (k + 1 tokens per sequence) and over LoRA adapter rows
(engine/runner/cuda_graph.py: buckets keyed (size, query_len), a static adapter slot per row),
host side, on the CPU: which batches a graph may run, the padded static inputs, and replay against
the eager forward through tests/test_cuda_graph.py's fake graph backend, whose "graph" replays the
captured callable on the static buffers. The LoRA rows go through Backend.lora_linear_slots, whose
CPU form is the C kernel's lora_linear (pyx/lora_kernels.c); the CUDA kernels are
tests/gpu/test_cuda_graphs_verify_lora.py's."""
import types

import numpy as np
import pytest

from engine.loader.model_loader import load_model
from engine.lora.adapter import LoraPart
from engine.lora.manager import LoraBatch
from engine.lora.slots import LoraStep, attach
from engine.models.llama import AuxCapture, FinalCapture
from engine.runner.cuda_graph import (CudaGraphRunner, bucket_for, input_layout,
                                      pad_decode_inputs, spread_rows, uniform_query_len,
                                      verify_row_counts)
from engine.runner.device_block_tables import DeviceBlockTables
from engine.runner.model_runner import ModelRunner
from pyx.cpu_backend import CpuBackend
from checkpoints import tiny_checkpoint
from test_cuda_graph import FakeGraphBackend, hand_batch, make_seq, schedule, two_decodes

I32 = np.int32
BLOCK_SIZE, MAX_BLOCKS, MAX_SEQS, K = 8, 6, 8, 2    # K drafts: verify graphs of 3 rows a sequence


def verify_schedule(seqs, drafts):
    """Each sequence's last known token, then its drafts (SchedulerOutput._add's verify rows)."""
    out = schedule([], [])
    for seq, d in zip(seqs, drafts):
        out._add(seq, 1 + len(d), len(d), list(d))
    return out


def lora_batch(slot_of_seq, rows_per_seq):
    """The LoraBatch LoraManager.plan makes for these sequences' slots (-1: the base model)."""
    slot_of_row = np.repeat(np.asarray(slot_of_seq, I32), rows_per_seq)
    order = np.argsort(slot_of_row, kind="stable").astype(I32)
    order = order[slot_of_row[order] >= 0]
    seg_slots = np.unique(slot_of_row[order]).astype(I32)
    seg_offsets = np.append(np.searchsorted(slot_of_row[order], seg_slots), len(order))
    return LoraBatch(order, seg_offsets.astype(I32), seg_slots, [None] * len(seg_slots))


# ---- which batches, and their static inputs

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return load_model(directory, CpuBackend(), progress=False)


@pytest.fixture()
def runner4(tiny):
    model, config = tiny
    return ModelRunner(model, config, CpuBackend(), block_size=4, num_blocks=16)


def test_uniform_query_len(runner4):
    a, b = two_decodes()
    assert uniform_query_len(runner4.prepare(schedule([a, b], [1, 1]))) == 1
    verify = runner4.prepare(verify_schedule([a, b], [[7, 8], [9, 10]]))
    assert verify.num_tokens == 6 and uniform_query_len(verify) == 3
    # a sequence with fewer drafts than the other: no graph shape fits
    assert uniform_query_len(runner4.prepare(verify_schedule([a, b], [[7, 8], []]))) is None
    assert uniform_query_len(runner4.prepare(verify_schedule([a, b], [[7, 8], [9]]))) is None
    # a prompt chunk of 3 tokens samples only its last row
    fresh = make_seq(range(300, 303), 0, [9])
    assert uniform_query_len(runner4.prepare(schedule([fresh], [3]))) is None
    assert uniform_query_len(hand_batch(2, logits_indices=[1, 0])) is None


def test_pad_verify_inputs(runner4):
    a, b = two_decodes()
    batch = runner4.prepare(verify_schedule([a, b], [[7, 8], [9, 10]]))
    ra, rb = batch.block_table_rows.tolist()
    got = pad_decode_inputs(batch, 4, 5, zero_row=99, query_len=3)
    # a: token 109 at position 9, drafts at 10, 11 in blocks 7 (offset 1, 2), 7 (offset 3)
    # b: token 205 at position 5, drafts at 6, 7: block 4, offsets 1, 2, 3
    want = {
        "token_ids": [109, 7, 8, 205, 9, 10] + [0] * 6,
        "positions": [9, 10, 11, 5, 6, 7] + [0, 1, 2] * 2,
        "slot_mapping": [29, 30, 31, 17, 18, 19] + [-1] * 6,
        "query_start_loc": [0, 3, 6, 9, 12],
        "seq_lens": [12, 8, 3, 3],
        "block_table_rows": [ra, rb, 99, 99],
        "logits_indices": list(range(12)),
    }
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].tolist() == value, name
    with pytest.raises(ValueError, match="not a verify batch of 2 tokens"):
        pad_decode_inputs(batch, 4, 5, zero_row=99, query_len=2)
    with pytest.raises(ValueError, match="not a pure decode batch"):
        pad_decode_inputs(batch, 4, 5, zero_row=99)
    # with LoRA: each row's slot, -1 for the base model's rows and the padding
    batch.lora = lora_batch([-1, 1], 3)
    got = pad_decode_inputs(batch, 4, 5, zero_row=99, query_len=3, lora=True)
    assert got["lora_slots"].tolist() == [-1, -1, -1, 1, 1, 1] + [-1] * 6
    layout, n = input_layout(4, 3, lora=True)
    assert layout["lora_slots"] == (112, (12,)) and n == 124


def test_uneven_verify_rows_spread_to_the_verify_shape(runner4):
    a, b = two_decodes()
    batch = runner4.prepare(verify_schedule([a, b], [[7], []]))    # 2 rows, then a decode
    counts = verify_row_counts(batch, 3)
    assert counts.tolist() == [2, 1]
    assert verify_row_counts(batch, 1) is None        # a sequence past the verify graph
    fresh = make_seq(range(300, 303), 0, [9])         # a prompt chunk samples its last row only
    assert verify_row_counts(runner4.prepare(schedule([fresh], [3])), 3) is None
    tokens, positions, slots, seq_lens, real = spread_rows(batch, counts, 3)
    # a: 109 at 9 (slot 29), draft 7 at 10 (slot 30), one filler; b: 205 at 5 (slot 17), two
    # fillers; each filler repeats its sequence's last token and position and writes nothing,
    # and the context grows by the fillers so that the real rows keep their positions
    assert tokens.tolist() == [109, 7, 7, 205, 205, 205]
    assert positions.tolist() == [9, 10, 10, 5, 5, 5]
    assert slots.tolist() == [29, 30, -1, 17, -1, -1]
    assert seq_lens.tolist() == [12, 8] and batch.seq_lens.tolist() == [11, 6]
    assert real.tolist() == [0, 1, 3]


def test_write_slot_of_rows_inverts_the_segments():
    batch = lora_batch([2, -1, 0, 2, 1], [1, 3, 2, 1, 2])
    out = np.full(12, 55, I32)
    batch.write_slot_of_rows(out)
    assert out.tolist() == [2, -1, -1, -1, 0, 0, 2, 1, 1, -1, -1, -1]


# ---- replay against the eager forward

def random_adapters(model, config, backend, dtype, rng, R=4, scale=0.2):
    """LoRA slots attached to every projection of the model: slots 0 and 1 hold random adapters
    (every part a random rank up to R), slot 2 nothing. Returns the LoraStep they read."""
    step = LoraStep()
    projections = attach(model, config, backend, step, num_slots=3, max_rank=R, dtype=dtype)
    for projection in projections.values():
        for slot in (0, 1):
            parts = []
            for p in range(projection.num_parts):
                width = int(projection.parts[p + 1] - projection.parts[p])
                r = int(rng.integers(1, R + 1))
                parts.append(LoraPart(p, rng.standard_normal((r, projection.in_features))
                                      .astype(np.float32) * scale,
                                      rng.standard_normal((r, width)).astype(np.float32) * scale))
            projection.write(slot, parts)
    return step


@pytest.fixture()
def setup(tmp_path):
    """Eight prefilled sequences in two identical KV caches (the eager model's and the graphs'),
    blocks no table holds NaN; a model of its own with LoRA slots attached (slots 0 and 1 hold
    random adapters, slot 2 nothing)."""
    directory = tiny_checkpoint(tmp_path / "llama", "llama", seed=4)
    backend = CpuBackend()
    model, config = load_model(directory, backend, progress=False)
    rng = np.random.default_rng(9)
    step = random_adapters(model, config, backend, np.float32, rng)
    eager = ModelRunner(model, config, backend, BLOCK_SIZE, num_blocks=40)
    graphed = ModelRunner(model, config, backend, BLOCK_SIZE, num_blocks=40)
    free = list(rng.permutation(np.arange(1, 40)))
    seqs = []
    for n in [5, 13, 8, 21, 3, 17, 9, 11]:
        table = [int(free.pop()) for _ in range(-(-(n + 24) // BLOCK_SIZE))]
        seqs.append(make_seq(rng.integers(3, 500, n).tolist(), 0, table))
    live = {b for s in seqs for b in s.block_table}
    dead = np.array(sorted(set(range(40)) - live))
    for k, v in eager.kv_caches:
        k[dead] = np.nan
        v[dead] = np.nan
    logits = model.forward(eager.prepare(schedule(seqs, [len(s.token_ids) for s in seqs])),
                           eager.kv_caches)
    for seq, row in zip(seqs, logits):
        seq.num_computed_tokens = len(seq.token_ids)
        seq.append_token(int(np.argmax(row)))
    for (ka, va), (kb, vb) in zip(eager.kv_caches, graphed.kv_caches):
        kb[...] = ka
        vb[...] = va
    fake = FakeGraphBackend()
    tables = DeviceBlockTables(fake, eager.block_tables)

    def graphs(query_lens=(1, K + 1), lora=True, capture=None, block_size=None):
        return CudaGraphRunner(model, fake, graphed.kv_caches, MAX_SEQS, MAX_BLOCKS, tables,
                               query_lens, step if lora else None, capture, block_size)
    return types.SimpleNamespace(model=model, eager=eager, graphed=graphed, seqs=seqs, step=step,
                                 backend=fake, tables=tables, graphs=graphs, rng=rng)


def eager_forward(setup, batch):
    """The eager step as ModelRunner.run takes it: the adapter rows grouped (LoraManager.begin),
    the forward, the hooks off again."""
    st = setup.step
    if batch.lora is not None:
        st.rows, st.seg_offsets, st.seg_slots = (batch.lora.rows, batch.lora.seg_offsets,
                                                 batch.lora.seg_slots)
    try:
        return setup.model.forward(batch, setup.eager.kv_caches)
    finally:
        st.rows = None


def test_capture_keys_and_order(setup):
    runner = setup.graphs()
    runner.capture()
    assert sorted(runner.buckets) == [(s, q) for s in (1, 2, 4, 8) for q in (1, 3)]
    copies = [e[1] for e in setup.backend.events if e[0] == "copy"]
    # the most rows first (verify 8 x 3 grows the workspace and the pool to their peak), each
    # bucket's own inputs, the slots of its rows included
    order = [(8, 3), (4, 3), (8, 1), (2, 3), (4, 1), (1, 3), (2, 1), (1, 1)]
    assert copies == [input_layout(s, q, lora=True)[1] for s, q in order]
    assert runner._logits.shape == (MAX_SEQS * 3, 512)
    for (size, q), bucket in runner.buckets.items():
        assert bucket.logits.shape == (size * q, 512) and bucket.lora_slots.shape == (size * q,)
    # the hooks are off outside the captured forward
    assert setup.step.slot_of_row is None and setup.step.rows is None


STEPS = [  # (sequences, drafts per sequence or None for a decode, slot per sequence or None)
    ([0, 1], K, [0, -1]),
    ([2], K, None),
    ([0, 3, 5], None, [1, 0, -1]),
    ([1, 2, 4, 6, 7], K, [1, -1, 0, 0, 2]),
    (list(range(8)), None, None),
    ([3, 5, 6], K, [-1, -1, -1]),
    ([4], None, [1]),
    (list(range(8)), K, [0, 1, -1, 0, 1, -1, 0, 1]),
]


def test_replay_equals_eager(setup):
    """Decode and verify steps, with and without adapter rows: replay gives the eager forward's
    logits on every row and writes the same KV (padding rows write nothing)."""
    runner = setup.graphs()
    runner.capture()
    differs = 0
    for step, k, slots in STEPS:
        group = [setup.seqs[i] for i in step]
        if k is None:
            sched = schedule(group, [1] * len(group))
        else:
            sched = verify_schedule(group, [setup.rng.integers(3, 500, k).tolist()
                                            for _ in group])
        q = 1 if k is None else k + 1
        batch = setup.eager.prepare(sched)
        if slots is not None:
            batch.lora = lora_batch(slots, q)
        setup.tables.apply(setup.eager.block_tables.take_update())
        assert runner.can_run(batch), step
        want = eager_forward(setup, batch)
        if slots is not None and any(s in (0, 1) for s in slots):
            scratch = [(kk.copy(), vv.copy()) for kk, vv in setup.eager.kv_caches]
            base = setup.model.forward(batch, scratch)
            differs += not np.allclose(base, want, atol=1e-3)   # the adapters do something
        del setup.backend.events[:]
        got = runner.run(batch)
        size = bucket_for(len(step), runner.sizes)
        assert setup.backend.events == [("copy", input_layout(size, q, lora=True)[1]),
                                        ("launch", runner.buckets[size, q].graph)], step
        assert got.shape == want.shape == (len(step) * q, 512)
        assert np.isfinite(got).all(), step
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(step))
        for (ka, va), (kb, vb) in zip(setup.eager.kv_caches, setup.graphed.kv_caches):
            np.testing.assert_allclose(kb, ka, rtol=1e-5, atol=1e-6, equal_nan=True)
            np.testing.assert_allclose(vb, va, rtol=1e-5, atol=1e-6, equal_nan=True)
        for i, seq in enumerate(group):     # every draft accepted, then the next token
            if k is not None:
                for t in sched.drafts[i]:
                    seq.append_token(int(t))
            seq.num_computed_tokens += q
            seq.append_token(int(np.argmax(want[(i + 1) * q - 1])))
    assert runner.num_replays == len(STEPS)
    assert differs >= 4


def test_what_each_runner_may_run(setup):
    a, b = setup.seqs[0], setup.seqs[1]
    decode = setup.eager.prepare(schedule([a, b], [1, 1]))
    verify = setup.eager.prepare(verify_schedule([a, b], [[5, 6], [7, 8]]))
    uneven = setup.eager.prepare(verify_schedule([a, b], [[5, 6], [7]]))
    longer = setup.eager.prepare(verify_schedule([a, b], [[5, 6, 7], [7, 8, 9]]))
    setup.tables.apply(setup.eager.block_tables.take_update())
    plain = setup.graphs(query_lens=(1,), lora=False)
    plain.capture()
    both = setup.graphs()
    both.capture()
    assert plain.can_run(decode) and not plain.can_run(verify)
    assert both.can_run(decode) and both.can_run(verify)
    assert not both.can_run(uneven) and not both.can_run(longer)     # 3 + 2 rows; 4 rows
    padding = setup.graphs(block_size=BLOCK_SIZE)      # uneven rows padded to the verify graph
    padding.capture()
    assert padding.can_run(uneven) and not padding.can_run(longer)
    assert not setup.graphs(query_lens=(1,), block_size=BLOCK_SIZE).pad_query_len
    with_lora = setup.eager.prepare(verify_schedule([a, b], [[5, 6], [7, 8]]))
    with_lora.lora = lora_batch([0, -1], 3)
    assert both.can_run(with_lora) and not plain.can_run(with_lora)
    decode.lora = lora_batch([0, 1], 1)
    assert not plain.can_run(decode)
    with pytest.raises(ValueError, match="captured without adapters"):
        plain.run(decode)
    with pytest.raises(ValueError, match="not a pure decode batch"):
        plain.run(verify)
    with pytest.raises(ValueError, match="not a pure decode batch"):
        both.run(uneven)
    # a verify step of a hybrid model's state rows or a vision model's images runs eagerly
    verify.state_plan = object()
    assert not both.can_run(verify)


def test_lora_linear_slots_equals_lora_linear():
    """The generic (CPU) lora_linear_slots: the per-row slots regrouped into lora_linear's
    segments, every part at the full rank; against lora_linear with the slots' true ranks."""
    be = CpuBackend()
    rng = np.random.default_rng(2)
    S, R, K, parts = 3, 4, 24, np.array([0, 16, 24, 32], I32)
    P, N = 3, 32
    ranks = rng.integers(0, R + 1, (S, P)).astype(I32)
    a = np.zeros((S, P * R, K), np.float32)
    b = np.zeros((S, R, N), np.float32)
    for s in range(S):
        for p in range(P):
            r = ranks[s, p]
            a[s, p * R:p * R + r] = rng.standard_normal((r, K))
            b[s, :r, parts[p]:parts[p + 1]] = rng.standard_normal((r, parts[p + 1] - parts[p]))
    x = rng.standard_normal((10, K)).astype(np.float32)
    out = rng.standard_normal((10, N)).astype(np.float32)
    slot_of_row = np.array([2, -1, 0, 0, 1, -1, 2, 1, 0, -1], I32)
    got = out.copy()
    be.lora_linear_slots(x, a, b, parts, slot_of_row, got)
    batch = lora_batch(slot_of_row, 1)
    want = out.copy()
    be.lora_linear(x, a, b, ranks, parts, batch.rows, batch.seg_offsets, batch.seg_slots, want)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got[slot_of_row < 0] == out[slot_of_row < 0]).all()
    assert not np.allclose(got[slot_of_row >= 0], out[slot_of_row >= 0])


UNEVEN = [  # (sequences, drafts per sequence, slot per sequence or None)
    ([0, 1], [2, 0], [0, -1]),
    ([2, 3, 4], [1, 2, 0], None),
    ([0, 3, 5, 6, 7], [0, 1, 0, 2, 1], [1, 0, -1, 0, 1]),
    (list(range(8)), [1, 0, 2, 0, 1, 2, 0, 0], None),
    ([1, 4], [1, 1], [-1, 1]),       # even, but 2 rows each: no graph of its own
]


@pytest.mark.parametrize("kind", [None, "final"])
def test_uneven_verify_steps_replay_padded(setup, kind):
    """Decode-only steps whose sequences verify 0 to K drafts replay the (size, K + 1) graphs,
    padded: the logits (and a head's hidden states) of the batch's own rows equal the eager
    forward's, in its layout, and the KV written equals the eager step's (the filler rows write
    nothing)."""
    capture, eager_capture = (FinalCapture(), FinalCapture()) if kind else (None, None)
    runner = setup.graphs(lora=kind is None, capture=capture, block_size=BLOCK_SIZE)
    runner.capture()
    for step, ks, slots in UNEVEN:
        group = [setup.seqs[i] for i in step]
        sched = verify_schedule(group, [setup.rng.integers(3, 500, k).tolist() for k in ks])
        batch = setup.eager.prepare(sched)
        rows = [k + 1 for k in ks]
        if slots is not None and kind is None:
            batch.lora = lora_batch(slots, rows)
        setup.tables.apply(setup.eager.block_tables.take_update())
        assert uniform_query_len(batch) not in runner.query_lens and runner.can_run(batch), step
        if kind is None:
            want = eager_forward(setup, batch)
        else:
            want = setup.model.forward(batch, setup.eager.kv_caches, capture=eager_capture)
        del setup.backend.events[:]
        got = runner.run(batch)
        size = bucket_for(len(step), runner.sizes)
        assert setup.backend.events[-1] == ("launch", runner.buckets[size, K + 1].graph)
        assert got.shape == want.shape == (sum(rows), 512)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(step))
        if kind is not None:
            np.testing.assert_allclose(capture.states, eager_capture.states, rtol=1e-5,
                                       atol=1e-5, err_msg=str(step))
            capture.states = None
        for (ka, va), (kb, vb) in zip(setup.eager.kv_caches, setup.graphed.kv_caches):
            np.testing.assert_allclose(kb, ka, rtol=1e-5, atol=1e-6, equal_nan=True)
            np.testing.assert_allclose(vb, va, rtol=1e-5, atol=1e-6, equal_nan=True)
        ends = np.cumsum(rows)
        for i, seq in enumerate(group):     # every draft accepted, then the next token
            for t in sched.drafts[i]:
                seq.append_token(int(t))
            seq.num_computed_tokens += rows[i]
            seq.append_token(int(np.argmax(want[ends[i] - 1])))
    assert runner.num_replays == runner.num_padded_replays == len(UNEVEN)


def test_uneven_steps_past_the_tables_run_eagerly(setup):
    """A filler row's context must stay inside the graphs' block tables (MAX_BLOCKS blocks)."""
    runner = setup.graphs(lora=False, block_size=BLOCK_SIZE)
    runner.capture()
    seq = setup.seqs[3]                       # 22 tokens: its table holds 6 blocks, 48 tokens
    seq.token_ids += [7] * (MAX_BLOCKS * BLOCK_SIZE - 1 - len(seq.token_ids))
    seq.num_computed_tokens = len(seq.token_ids) - 1
    ok = setup.eager.prepare(verify_schedule([setup.seqs[0], seq], [[5, 6], []]))
    setup.tables.apply(setup.eager.block_tables.take_update())
    assert ok.seq_lens[1] == MAX_BLOCKS * BLOCK_SIZE - 1 and not runner.can_run(ok)


@pytest.mark.parametrize("kind", ["aux", "final"])
def test_replay_hands_over_the_captured_hidden_states(setup, kind):
    """Graphs captured with a speculative head's capture (EAGLE-3's aux states, an MTP head's
    final-norm states) hand it, after each decode and verify replay, the eager forward's states:
    same shape, same rows, from the static buffer (the forward's own array is a pool
    temporary, dropped inside the graph)."""
    def new():
        return AuxCapture((0, 1)) if kind == "aux" else FinalCapture()
    capture, eager_capture = new(), new()
    runner = setup.graphs(lora=False, capture=capture)
    runner.capture()
    assert capture.states is None
    width = 2 * 96 if kind == "aux" else 96
    assert runner._states.shape == (MAX_SEQS * (K + 1), width)
    for step, k, _ in STEPS:
        group = [setup.seqs[i] for i in step]
        sched = (schedule(group, [1] * len(group)) if k is None else
                 verify_schedule(group, [setup.rng.integers(3, 500, k).tolist() for _ in group]))
        q = 1 if k is None else k + 1
        batch = setup.eager.prepare(sched)
        setup.tables.apply(setup.eager.block_tables.take_update())
        assert runner.can_run(batch), step
        want = setup.model.forward(batch, setup.eager.kv_caches, capture=eager_capture)
        got = runner.run(batch)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(step))
        assert capture.states.shape == eager_capture.states.shape == (len(step) * q, width)
        np.testing.assert_allclose(capture.states, eager_capture.states, rtol=1e-5, atol=1e-5,
                                   err_msg=str(step))
        capture.states = None       # as the proposer's mirror takes them
        for i, seq in enumerate(group):
            if k is not None:
                for t in sched.drafts[i]:
                    seq.append_token(int(t))
            seq.num_computed_tokens += q
            seq.append_token(int(np.argmax(want[(i + 1) * q - 1])))

"""GPU: the device-resident block tables (engine/runner/device_block_tables.py) on the real CUDA backend.

The CPU tests (tests/test_device_block_tables.py, tests/test_cuda_engine_wiring.py) drive the same
code on NumPy "device" arrays; what only a GPU shows: CuPy's scatters (`table[rows] = 0`,
`table.reshape(-1)[index] = ids`) write the device table in place, the pinned staging buffer and
its async copy on the backend's stream land before the scatter reads them, a table reserved for
the graphs keeps its address, and the decode graphs' captured gather of their rows gives the same
tokens as the eager path through preemption, finishing sequences and reused rows.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_model import checkpoints  # noqa: F401  (the fixture)
from test_cuda_model import MIN_COMPARED, TIE, cpu_margins, random_prompts, trusted_prefix


class FakeSeq:
    def __init__(self, seq_id, blocks=()):
        self.seq_id, self.block_table = seq_id, list(blocks)
        self.num_preemptions, self.is_finished = 0, False
        self.trimmed_to = None      # BlockPool.trim's mark (speculative decoding's rollback)


@pytest.mark.parametrize("seed", [0, 1])
def test_device_table_equals_host_table_on_cupy(cuda_bf16, seed):
    import cupy

    from engine.runner.device_block_tables import DeviceBlockTables
    from engine.runner.input_buffers import BlockTables

    rng = np.random.default_rng(seed)
    host = BlockTables(num_rows=2, width=2)
    tables = DeviceBlockTables(cuda_bf16, host)
    assert isinstance(tables.table, cupy.ndarray)
    running, preempted, next_id = [], [], 0
    for step in range(200):
        if len(running) < 12 and rng.random() < 0.5:
            running.append(FakeSeq(next_id, rng.integers(1, 10**6, rng.integers(1, 4))))
            next_id += 1
        for seq in running:
            if rng.random() < 0.3:
                seq.block_table += rng.integers(1, 10**6, 20 if rng.random() < 0.03 else 1).tolist()
        if running and rng.random() < 0.1:
            seq = running.pop(rng.integers(len(running)))
            seq.block_table, seq.num_preemptions = [], seq.num_preemptions + 1
            preempted.append(seq)
        if preempted and rng.random() < 0.2:
            seq = preempted.pop(0)
            seq.block_table = rng.integers(1, 10**6, rng.integers(1, 6)).tolist()
            running.append(seq)
        if running and rng.random() < 0.15:
            running.pop(rng.integers(len(running))).is_finished = True
        if not running:
            continue
        batch = [s for s in running if rng.random() < 0.8] or running[:1]
        rows = host.rows_for(batch)
        tables.apply(host.take_update())
        width = max(len(s.block_table) for s in batch)
        gathered = tables.gather(cuda_bf16.asarray(rows.astype(np.int32)), width)
        cuda_bf16.synchronize()
        assert np.array_equal(cupy.asnumpy(tables.table[:-1]), host.table), step
        assert not cupy.asnumpy(tables.table[-1]).any()
        assert np.array_equal(cupy.asnumpy(gathered), host.table[rows, :width]), step
    # reserved: the address stays
    tables.reserve(64, 256)
    ptr = tables.table.data.ptr
    host.rows_for([FakeSeq(10**6, [5, 6, 7])])
    tables.apply(host.take_update())
    assert tables.table.data.ptr == ptr


def test_graph_replay_with_preemption_and_reused_rows(checkpoints):
    """Twelve requests of different lengths through 8 sequence slots and a KV pool too small for
    them all (preemptions, rows of finished sequences reused): graph replay against the eager
    path up to the CPU's first near-tie, and the eager path against the CPU likewise."""
    from engine import LLM, SamplingParams

    path = checkpoints("llama")
    config = dict(dtype="bf16", num_kv_blocks=12, max_num_seqs=8)
    graph = LLM(path, backend="cuda", cuda_graph=True, **config)
    eager = LLM(path, backend="cuda", cuda_graph=False, **config)
    cpu = LLM(path, backend="cpu", **config)
    prompts = random_prompts(7, np.random.default_rng(7).integers(5, 40, 12))
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in np.random.default_rng(8).integers(20, 60, 12)]
    got = graph.generate(prompts, params)
    want = eager.generate(prompts, params)
    ref = cpu.generate(prompts, params)
    engine = graph.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.graph_runner.num_replays > 20
    tables = engine.runner.device_block_tables
    assert tables.table is engine.runner.graph_runner._table       # never moved
    import cupy
    assert np.array_equal(cupy.asnumpy(tables.table[:-1]), engine.runner.block_tables.table)
    compared = 0
    for i in range(len(prompts)):
        n = trusted_prefix(cpu_margins(cpu, prompts[i], ref[i].token_ids), TIE)
        assert got[i].token_ids[:n] == want[i].token_ids[:n], (i, got[i].token_ids,
                                                               want[i].token_ids)
        assert want[i].token_ids[:n] == ref[i].token_ids[:n], (i, want[i].token_ids,
                                                               ref[i].token_ids)
        compared += n
    # The random tiny weights leave near-ties early (13 tokens over the 12 requests on the
    # 2026-11-28 H200 run); graph replay against eager is compared on those and must be equal.
    assert compared >= MIN_COMPARED, f"only {compared} tokens compared"

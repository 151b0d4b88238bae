"""CUDA graphs on tensor- and pipeline-parallel ranks, and the step inputs rank 0 sends them
(issue 28, item 2), between real MPI processes on the CPU: tests/parallel_graph_ranks.py runs
each rank under `mpiexec -n 2` on CpuAsCuda (the CPU backend dressed as CUDA; a "graph" replays
the captured forward, so a rank's all-reduces and its stage's hand-over run inside or around its
replays between the processes, as NCCL's would on GPUs).

- Rank 0 chooses the bucket every rank replays (StepInputs.graphs): with
  graphs_parallel=on every rank replays it, as many times as rank 0, and the tokens are the
  eager engine's.
- A rank that cannot replay the chosen bucket (its device table moved) runs the bucket's padded
  rows eagerly: the same collectives (tensor parallel) or hand-overs (pipeline parallel) of the
  same sizes as its peers' replays, so the step neither hangs nor fails, and the tokens are the
  same. (Were it to run its batch's own rows, or choose for itself, its all-reduce or receive
  would not match rank 0's and the group would fail or hang: the subprocess's timeout.)
- A pipeline stage's graph holds its layers only: no capture sends or receives, a replay
  receives the stream into the graph's input rows before the launch and sends its output rows
  after it (one process, tests/test_cuda_graph.py's fake backend, the neighbour recorded).
- A decode step's message carries the block table's changes, not the table: its block-table
  entries stay within the step's new blocks, and its size stays flat while the context grows
  past the table's width and the table widens (a resize sends the new shape, not the table).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from checkpoints import tiny_checkpoint

pytestmark = pytest.mark.timeout(600)

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31],
           [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("pg") / "m"), "llama",
                           max_position_embeddings=2048)


def ranks(model: str, tmp_path, name: str, **options) -> list[dict]:
    """Each rank's report (tests/parallel_graph_ranks.py) of one engine run by 2 processes."""
    from engine.parallel.mpi import import_mpi
    import_mpi()            # mpiexec on PATH
    out = tmp_path / name
    out.mkdir()
    run = subprocess.run(["mpiexec", "-n", "2", sys.executable,
                          os.path.join(HERE, "parallel_graph_ranks.py"), model, str(out),
                          json.dumps(options)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def graph_steps(sent: list) -> int:
    """Replays rank 0 asked of every rank: one per micro-batch it named a bucket for."""
    return sum(sum(key is not None for key in s["graphs"]) for s in sent if s["graphs"])


@pytest.mark.parametrize("split", [dict(tp=2), dict(pp=2, micro_batches=2)],
                         ids=["tensor", "pipeline"])
def test_every_rank_replays_the_bucket_rank_0_chose(model, tmp_path, split):
    eager = ranks(model, tmp_path, "eager", graphs="off", prompts=PROMPTS, **split)
    assert not eager[0]["captured"] and not eager[1]["captured"]
    graphs = ranks(model, tmp_path, "graphs", prompts=PROMPTS, **split)
    zero = graphs[0]
    assert zero["tokens"] == eager[0]["tokens"]
    wanted = graph_steps(zero["sent"])
    assert wanted >= 7                  # the decode steps after the prefill
    # the buckets are padded: 5 sequences replay the graph of 8 (of 4 and 2 in two micro-batches)
    keys = {tuple(k) for s in zero["sent"] if s["graphs"] for k in s["graphs"]}
    assert keys == ({(8, 1)} if "tp" in split else {(4, 1), (2, 1)}), keys
    for rank in graphs:
        assert rank["replays"] == rank["backend_replays"] == wanted
        assert rank["fallbacks"] == 0


@pytest.mark.parametrize("split", [dict(tp=2), dict(pp=2, micro_batches=2)],
                         ids=["tensor", "pipeline"])
def test_a_rank_that_cannot_replay_runs_the_padded_bucket_in_step(model, tmp_path, split):
    eager = ranks(model, tmp_path, "eager", graphs="off", prompts=PROMPTS, **split)
    zero, one = ranks(model, tmp_path, "stuck", prompts=PROMPTS, stuck_rank=1, **split)
    assert zero["tokens"] == eager[0]["tokens"]
    wanted = graph_steps(zero["sent"])
    assert zero["replays"] == wanted > 0 and zero["fallbacks"] == 0
    assert one["replays"] == 0 and one["fallbacks"] == wanted


@pytest.mark.parametrize("split", [dict(tp=2), dict(pp=2)], ids=["tensor", "pipeline"])
def test_decode_steps_send_the_new_blocks_not_the_table(model, tmp_path, split):
    """Two sequences decode from 5 to 565 tokens in blocks of 8: past 64 blocks the table
    widens from 64 to 128 columns, while every decode step's message holds a few ints of the
    table (a whole 64 x 128 table would be 32 KiB)."""
    zero, _ = ranks(model, tmp_path, "long", graphs="off", block_size=8, num_kv_blocks=160,
                    prompts=PROMPTS[:2], max_tokens=560, **split)
    sent = zero["sent"]
    decode = [s for s in sent if s["tokens"] == s["seqs"]]
    assert len(decode) >= 550
    assert not any(s["whole_table"] for s in sent)
    assert {tuple(s["table_shape"]) for s in sent} == {(64, 64), (64, 128)}     # it widened
    # each sequence gains at most one block a decode step: a flat index and an id
    assert max(s["entries"] for s in decode) <= 2 * 2
    # over the run, the ints of the blocks the two sequences gained (560 tokens: 70 blocks
    # each, an index and an id for each block), however wide the table
    assert sum(s["entries"] for s in decode) <= 2 * 2 * (560 // 8 + 1)
    sizes = [s["bytes"] for s in decode]
    assert max(sizes) - min(sizes) <= 64, (min(sizes), max(sizes))


def test_ranks_that_captured_other_buckets_stop():
    from types import SimpleNamespace
    from engine.parallel.launch import check_same_buckets

    class Group:
        rank = 1

        def __init__(self, *every):
            self.every = every

        def allgather(self, mine):
            return [list(b) for b in self.every]

    mine = SimpleNamespace(buckets={(1, 1): None, (2, 1): None})
    check_same_buckets(Group([(1, 1), (2, 1)], [(1, 1), (2, 1)]), mine)
    with pytest.raises(ValueError, match=r"rank 1 captured CUDA graphs for buckets \[\(1, 1\), "
                                         r"\(2, 1\)\], rank 0 for \[\(1, 1\)\]"):
        check_same_buckets(Group([(1, 1)], [(1, 1), (2, 1)]), mine)


# ---- a stage's graph and its hand-over, in one process (tests/test_cuda_graph.py's fake backend)

class Neighbour:
    """A stage's communicator: sends and receives go into the fake backend's event list (so
    their order against the copies, captures and launches shows); a receive fills its array
    with the first rows of `incoming`."""

    def __init__(self, events, incoming=None):
        self.events, self.incoming, self.sent = events, incoming, []

    def send(self, x, peer: int) -> None:
        self.events.append(("send", peer, x.shape))
        self.sent.append(np.array(x))

    def recv(self, x, peer: int) -> None:
        self.events.append(("recv", peer, x.shape))
        x[...] = self.incoming[:len(x)]

    def flush(self) -> None:
        pass


def test_a_stage_hands_its_stream_over_around_its_graph(tmp_path):
    """Two stages of the tiny Llama (a layer each) with graphs: no capture sends or receives
    (each stage captures alone); a replay of bucket 4 for 3 sequences is copy, launch, send on
    the first stage and copy, receive, launch on the second, the whole bucket's rows handed over
    (its padding rows included, as its peer's graph expects), the real rows the eager stage's,
    and the second stage's logits the eager ones."""
    from engine.loader.model_loader import load_model
    from engine.runner.cuda_graph import CudaGraphRunner
    from engine.runner.device_block_tables import DeviceBlockTables
    from engine.runner.model_runner import ModelRunner
    from pyx.cpu_backend import CpuBackend
    from test_cuda_graph import FakeGraphBackend, make_seq, schedule

    directory = tiny_checkpoint(str(tmp_path / "m"), "llama")
    seqs = [make_seq([7 + i], 0, [i + 1]) for i in range(3)]       # one token each, decoding
    incoming, results = None, []
    for stage in (0, 1):
        backend = FakeGraphBackend()
        comm = Neighbour(backend.events, incoming)
        model, config = load_model(directory, CpuBackend(), progress=False,
                                   pipeline=(stage, 2, 0, comm))
        eager = ModelRunner(model, config, CpuBackend(), 8, num_blocks=8)
        graphed = ModelRunner(model, config, CpuBackend(), 8, num_blocks=8)
        tables = DeviceBlockTables(backend, eager.block_tables)
        graphs = CudaGraphRunner(model, backend, graphed.kv_caches, 4, 4, tables)
        graphs.capture()
        assert not [e for e in backend.events if e[0] in ("send", "recv")]
        batch = eager.prepare(schedule(seqs, [1, 1, 1]))
        tables.apply(eager.block_tables.take_update())
        want = model.forward(batch, eager.kv_caches)
        del backend.events[:]
        got = graphs.run(batch, graphs.choose(batch))
        assert graphs.choose(batch) == (4, 1)
        kinds = [e[0] for e in backend.events]
        if stage == 0:
            assert kinds == ["copy", "launch", "send"] and got is None and want is None
            assert backend.events[-1][1:] == (1, (4, config.hidden_size))
            eager_sent, sent = comm.sent
            np.testing.assert_allclose(sent[:3], eager_sent, rtol=1e-6, atol=1e-6)
            incoming = sent
        else:
            assert kinds == ["copy", "recv", "launch"]
            assert backend.events[1][1:] == (0, (4, config.hidden_size))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        results.append(kinds)
    assert results[1] != results[0]

"""Pipeline parallel's CUDA path (issue 28): NCCL point-to-point send and receive through CuPy
(engine/parallel/nccl.py) on the backend's stream.

  one device   a group of one rank sends a bf16 array to itself (inside one NCCL group call,
               the only way a rank can be its own peer) and receives it unchanged; a stage of
               one (the whole model, every step cut into 2 micro-batches by PipelineRunner)
               with --kernels graphs_parallel=on replays a graph per micro-batch and gives the
               eager stage's tokens. (A stage of one has no neighbour: the hand-over of the
               stream around the replays is checked between processes on the CPU,
               tests/test_parallel_graphs.py, and on two GPUs below.)
  two devices  pipeline_parallel_size 2 (one stage per device) against one device (skipped
               with fewer than 2 GPUs: pending a machine with several); Gemma 4 E2B's shape
               too (the KV-shared layers and their sources on stage 1, each stage computing its
               layers' per-layer inputs).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_model import GEN, checkpoints, greedy, make_llm, random_prompts  # noqa: F401
from test_cuda_tensor_parallel import (OneRank, assert_two_devices_match_one, need_two_devices,
                                       tp_quant_checkpoint)


def test_nccl_send_and_receive_of_one_rank():
    from conftest import cuda_backend
    from engine.parallel.nccl import NcclCommunicator
    backend = cuda_backend("bf16")
    comm = NcclCommunicator(OneRank(), backend)
    cp = backend.xp
    x = cp.asarray(np.linspace(-3, 3, 4096, dtype=np.float32)).astype(backend.act_dtype)
    y = cp.zeros_like(x)
    comm.nccl.groupStart()
    comm.send(x, 0)
    comm.recv(y, 0)
    comm.nccl.groupEnd()
    comm.flush()
    backend.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y.astype(cp.float32)),
                                  cp.asnumpy(x.astype(cp.float32)))


def one_stage_llm(path, monkeypatch, **config):
    """An engine built as a pipeline of one stage on one rank (PipelineRunner's micro-batches,
    two a step, and the stage's graphs), its communicator NCCL's."""
    import engine.core.llm_engine as llm_engine
    from engine.core.builder import build
    from engine.parallel import launch
    monkeypatch.setattr(llm_engine, "build",
                        lambda config, loaded=None: build(config, loaded, group=OneRank()))
    monkeypatch.setattr(launch, "communicators", lambda group, backend, config: (
        None, (0, 1, 0, launch.communicator(group, backend))))
    return make_llm(path, "cuda", pipeline_micro_batches=2, **config)


def test_graphs_parallel_replays_each_micro_batch(checkpoints, monkeypatch):
    """Four sequences, two micro-batches of two a step: each replays the bucket-2 graph (the
    eager stage runs the same kernels on the same shapes: the same tokens)."""
    path = checkpoints("llama")
    prompts = random_prompts(6, (40, 17, 70, 9))
    eager_llm = one_stage_llm(path, monkeypatch)
    assert eager_llm.engine.runner.pipeline.num_micro_batches == 2
    assert eager_llm.engine.runner.graph_runner is None         # graphs_parallel=off
    eager = [list(o.token_ids) for o in greedy(eager_llm, prompts)]
    llm = one_stage_llm(path, monkeypatch, kernels="graphs_parallel=on")
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.stage is not None
    got = [list(o.token_ids) for o in greedy(llm, prompts)]
    assert got == eager
    assert graphs.num_replays >= 2 * (GEN - 2) and graphs.num_eager_fallbacks == 0


@pytest.mark.parametrize("kind", ["llama", "gemma4_e2b"])
def test_two_stages_on_two_devices_match_one(checkpoints, kind, tmp_path):
    need_two_devices(f"{kind} at pipeline_parallel_size 2 on two devices")
    path = checkpoints("llama") if kind == "llama" else tp_quant_checkpoint(kind, tmp_path)
    assert_two_devices_match_one(path, random_prompts(5, (40, 17)), pipeline_parallel_size=2)

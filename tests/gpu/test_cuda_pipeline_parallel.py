"""Pipeline parallel's CUDA path (issue 28): NCCL point-to-point send and receive through CuPy
(engine/parallel/nccl.py) on the backend's stream.

  one device   a group of one rank sends a bf16 array to itself (inside one NCCL group call,
               the only way a rank can be its own peer) and receives it unchanged.
  two devices  pipeline_parallel_size 2 (one stage per device) against one device (skipped
               with fewer than 2 GPUs: pending a machine with several).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_model import checkpoints, greedy, make_llm, random_prompts  # noqa: F401
from test_cuda_tensor_parallel import OneRank


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


def test_two_stages_on_two_devices_match_one(checkpoints):
    from pyx.cuda_backend import device_count
    if device_count() < 2:
        pytest.skip("pending a machine with 2+ GPUs: pipeline_parallel_size 2 on two devices")
    path = checkpoints("llama")
    prompts = random_prompts(5, (40, 17))
    one = [list(o.token_ids) for o in greedy(make_llm(path, "cuda"), prompts)]
    llm = make_llm(path, "cuda", pipeline_parallel_size=2)
    try:
        two = [list(o.token_ids) for o in greedy(llm, prompts)]
    finally:
        llm.engine.shutdown()
    for a, b in zip(one, two):     # micro-batches change the GEMMs' shapes: the first tokens agree
        assert a[:8] == b[:8], (a, b)

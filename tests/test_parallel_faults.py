"""A tensor- or pipeline-parallel worker killed under a live server (issue 28): the open
requests end with an error naming the dead rank (the stream that had started gets an error
event), the server logs it and exits with status 1, within seconds: never a hang (rank 0 would
otherwise wait in its next collective or receive for good). engine/parallel/steps.py's watchdog,
engine/async_engine.py's failing of the open requests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from server_fakes import LiveServer, client_for
from test_tensor_parallel import wait_for_workers_gone, worker_pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("flag,kind", [("--pipeline-parallel-size", "pipeline parallel"),
                                       ("--tensor-parallel-size", "tensor parallel")])
def test_a_killed_worker_fails_open_requests_and_ends_the_server(tmp_path, flag, kind):
    from server.demo_model import write_demo_checkpoint
    demo = write_demo_checkpoint(str(tmp_path / "demo"))
    before = worker_pids()
    server = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo", flag, "2")
    try:
        (worker,) = worker_pids() - before
        got = {"chunks": 0}

        def read():
            try:
                stream = client_for(server.port).completions.create(
                    model="demo", prompt="a very long story", max_tokens=3000, temperature=0,
                    stream=True, extra_body={"ignore_eos": True})
                for _ in stream:
                    got["chunks"] += 1
                got["result"] = "completed"
            except Exception as e:
                got["result"] = e

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.time() + 30
        while got["chunks"] < 10:
            assert time.time() < deadline and reader.is_alive(), server.log()
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after its worker died"
        error = got["result"]
        assert isinstance(error, Exception), error
        assert re.search(rf"The engine failed: {kind} rank 1 \(pid {worker}\) has died; the "
                         rf"model cannot run without it", str(error)), str(error)
        assert server.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed_at < 30
        assert f"{kind} rank 1 (pid {worker}) has died" in server.log()
    finally:
        server.close()


RANK_0_FAILS = """
import sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=64, **{sys.argv[2]: 2})
model, calls = llm.engine.runner.model, [0]
forward = model.forward
def failing(*args, **kwargs):   # rank 0's part of the 4th step fails, after the step was sent
    calls[0] += 1
    if calls[0] == 4:
        raise MemoryError("injected: rank 0's forward failed")
    return forward(*args, **kwargs)
model.forward = failing
try:
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=50, ignore_eos=True))
except Exception as e:
    print("the step failed:", e, flush=True)
llm.generate([[4, 5, 6]], SamplingParams(max_tokens=4))
print("generated after the failed step", flush=True)
"""


@pytest.mark.parametrize("size,kind", [("pipeline_parallel_size", "pipeline parallel"),
                                       ("tensor_parallel_size", "tensor parallel")])
def test_a_failed_forward_on_rank_0_ends_every_rank(tmp_path, size, kind):
    """Rank 0's part of a step raising after the step went out leaves the other ranks in a
    receive or collective of that step for good (MPI cannot cancel them): the next step would
    meet them there, and leaving the group (a collective) would wait on them. Rank 0 fails the
    open requests with the error, ends the workers and exits with status 1, in seconds."""
    from checkpoints import tiny_checkpoint
    tiny_checkpoint(str(tmp_path / "m"), arch="llama")
    before = worker_pids()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", RANK_0_FAILS, str(tmp_path / "m"), size],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"{kind}: rank 0's forward failed (MemoryError: injected: rank 0's forward "
            f"failed); the other ranks cannot finish the step: exiting") in proc.stderr
    assert "generated after the failed step" not in proc.stdout
    assert time.monotonic() - start < 60
    wait_for_workers_gone(before, "the workers outlived rank 0")

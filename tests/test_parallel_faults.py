"""A tensor- or pipeline-parallel worker killed under a live server (issue 28): the open
requests end with an error naming the dead rank (the stream that had started gets an error
event), the server logs it and exits with status 1, within seconds: never a hang (rank 0 would
otherwise wait in its next collective or receive for good). engine/parallel/steps.py's watchdog,
engine/async_engine.py's failing of the open requests."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from server_fakes import LiveServer, client_for
from test_tensor_parallel import worker_pids

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

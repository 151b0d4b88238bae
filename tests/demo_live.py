"""Module-scoped fixtures for the live-server tests: the random-weight demo checkpoint, one
`python -m server` serving it as "demo", and the official openai client on that server. A test
module imports the fixtures it uses (`from demo_live import client, demo_dir, live`)."""
from __future__ import annotations

import pytest

from server_fakes import LiveServer, client_for


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


@pytest.fixture(scope="module")
def live(demo_dir, tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("live"), demo_dir, "--mem", "64",
                        "--served-model-name", "demo")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live):
    return client_for(live.port)

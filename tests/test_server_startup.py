"""What `python -m server` says as it starts, as a real process: the port is bound and the model
loaded before "serving on" is logged; a port in use, a missing or corrupt model, an unknown
architecture each end it with one line naming the cause and the file (or port), exit code 1 and
no traceback (--debug shows it); and no notice about PyTorch's absence from transformers."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from gguf_fixtures import path_of
from server_fakes import ROOT, free_port, http_request

pytestmark = pytest.mark.timeout(300)

# How a machine without torch looks to Python: every import finder loses torch, so
# importlib.util.find_spec("torch") is None and `import torch` fails, as when it is not installed.
HIDE_TORCH = """
import sys
class HideTorch:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, name):
        return getattr(self.finder, name)
sys.meta_path[:] = [HideTorch(f) for f in sys.meta_path]
"""
SERVE = "import runpy; runpy.run_module('server', run_name='__main__', alter_sys=True)"
NO_TORCH_NOTICE = "PyTorch was not found. Models won't be available"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


def server_command(*flags: str, hide_torch: bool = False) -> list[str]:
    code = (HIDE_TORCH if hide_torch else "") + SERVE
    return [sys.executable, "-c", "import sys\n" + code, "--cpu", "--h", "127.0.0.1", "--mem",
            "32", *flags]


def start_failing(*flags: str) -> tuple[int, str]:
    """(exit code, stderr) of a server start that is expected to end by itself."""
    proc = subprocess.run(server_command(*flags), cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.stdout == "", proc.stdout
    return proc.returncode, proc.stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


def assert_one_line_failure(rc: int, stderr: str, *wanted: str):
    assert rc == 1, stderr
    errors = error_lines(stderr)
    assert len(errors) == 1, stderr
    for text in wanted:
        assert text in errors[0], stderr
    assert "Traceback" not in stderr, stderr
    # nothing claimed the server was up
    assert "serving on" not in stderr and "Running on" not in stderr, stderr


def copy_of(demo_dir: str, tmp_path, name: str) -> str:
    return shutil.copytree(demo_dir, tmp_path / name)


# ---- start-up order

def test_serving_on_is_logged_once_the_model_is_loaded(demo_dir, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command("--w", demo_dir, "--p", str(port),
                                               "--served-model-name", "demo"),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        statuses = []
        while True:
            try:
                status = http_request(port, "GET", "/health")[0]
            except OSError:
                status = None
            if status is not None:
                statuses.append(status)
                # /health says 200 only after the model loaded, and "serving on" was said then
                # (on the event loop, before it could answer)
                assert status in (200, 503), status
            if status == 200:
                text = log_path.read_text()
                assert f"serving on http://127.0.0.1:{port}" in text, text
                break
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    text = log_path.read_text()
    order = [text.index(f"loading {demo_dir}/: needs"),      # the loader, reading the weights
             text.index("model demo ready, max_model_len 4096"),
             text.index(f"serving on http://127.0.0.1:{port} (OpenAI API under /v1)"),
             text.index(f"web chat UI: http://127.0.0.1:{port}/ui/")]
    assert order == sorted(order), text
    assert "Running on" not in text, text          # Hypercorn's own claim, made as it binds
    assert "Traceback" not in text and " ERROR " not in text, text


# ---- failures: one line, exit code 1

def test_a_port_in_use_is_one_line_before_any_loading(demo_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err = start_failing("--w", demo_dir, "--p", str(port))
    assert_one_line_failure(rc, err, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "loading" not in err, err               # the port is bound before the model loads


def test_a_missing_model_directory(tmp_path):
    missing = str(tmp_path / "no-such-model")
    rc, err = start_failing("--w", missing, "--p", str(free_port()))
    assert_one_line_failure(rc, err, f"could not load {missing}: model directory {missing} "
                                     "does not exist")


def test_a_corrupt_safetensors_file(demo_dir, tmp_path):
    model = copy_of(demo_dir, tmp_path, "garbage")
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "wb") as f:        # garbage: the first 8 bytes give a huge header length
        f.write(bytes(range(256)) * 400)
    rc, err = start_failing("--w", model, "--p", str(free_port()))
    assert_one_line_failure(rc, err, f"could not load {model}: {weights}: not a safetensors "
                                     "file, or truncated", "beyond the file's 102400")


def test_an_unknown_architecture_names_the_config(demo_dir, tmp_path):
    import json
    model = copy_of(demo_dir, tmp_path, "unknown-arch")
    config_path = os.path.join(model, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["FooForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    rc, err = start_failing("--w", model, "--p", str(free_port()))
    assert_one_line_failure(rc, err, f"{config_path}: unsupported architecture FooForCausalLM")


def test_a_truncated_gguf_names_the_tensor(tmp_path):
    src = path_of("qwen2-f32")
    cut = str(tmp_path / "qwen2-f32.gguf")
    with open(src, "rb") as f:
        data = f.read()
    with open(cut, "wb") as f:
        f.write(data[:len(data) - 1000])
    rc, err = start_failing("--f", cut, "--p", str(free_port()))
    assert_one_line_failure(rc, err, f"{cut}: truncated GGUF file: tensor ", "needs bytes")


def test_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "no-such-model")
    rc, err = start_failing("--w", missing, "--p", str(free_port()), "--debug")
    assert rc == 1
    assert f"could not load {missing}: model directory {missing} does not exist" in err
    assert "Traceback (most recent call last)" in err and "FileNotFoundError" in err, err


# ---- no notice about PyTorch

def test_no_pytorch_notice_where_torch_is_not_installed(demo_dir, tmp_path):
    # the check is real: in an interpreter that cannot see torch, transformers gives the notice
    control = subprocess.run([sys.executable, "-c", HIDE_TORCH + "import transformers"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert control.returncode == 0, control.stderr
    assert NO_TORCH_NOTICE in control.stderr, control.stderr
    # ... and the server, in the same interpreter, starts without it; other warnings still show
    port = free_port()
    proc = subprocess.Popen(server_command("--w", demo_dir, "--p", str(port), hide_torch=True),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                if http_request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "serving on" in out, out
    assert NO_TORCH_NOTICE not in out and "PyTorch" not in out, out
    other = subprocess.run(
        [sys.executable, "-c", HIDE_TORCH + "import engine.text.hf_tokenizers\n"
         "from transformers.utils import logging\n"
         "logging.get_logger('transformers').warning('another transformers warning')"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    assert "another transformers warning" in other.stderr and NO_TORCH_NOTICE not in other.stderr

"""The README's serve command as a new user meets it (issue 27): typed in the root of a clean clone,
in a fresh virtualenv, it installs Taper and serves the demo model, which answers a chat completion
over HTTP; after that install, the same command run from another directory serves too.

The command is read from README.md, so the README and this test cannot drift apart. Two honest
shortcuts keep the cost low: the fresh virtualenv sees the packages already installed in the one
running the tests (as `--system-site-packages` would; Taper's own code and extensions are not among
them, see fresh_venv), and pip's download cache is the usual one. Taper itself is built from the
clone by the command, as a user's install builds it: without TAPER_CUDA* settings, so on a machine
without a GPU the CUDA kernels are not compiled. `--p PORT` is appended (a free port; 2000 may be
taken on a shared machine) and the demo checkpoint is written under a temporary XDG_CACHE_HOME.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_AND_START_S = 1800      # pip's build of the extensions; the CUDA kernels where a GPU is
                                # visible
ANSWER_S = 120


def readme_command(section: str) -> str:
    """The first ```bash block under README.md's `## {section}` heading, as one line."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, f"README.md has no '## {section}' section"
    block = re.search(r"^```bash\n(.*?)^```", m.group(1), re.S | re.M)
    assert block, f"README.md's '## {section}' section has no ```bash block"
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, f"the {section} command is one line, not {lines}"
    return lines[0]


SERVE = readme_command("Serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tracked_files() -> list[str]:
    done = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True)
    if done.returncode:
        pytest.skip(f"not a git checkout, so no clean clone to make: {done.stderr.decode()[:200]}")
    return [p for p in done.stdout.decode().split("\0") if p]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> str:
    """A clean clone of this checkout: the files git tracks, as they are in the working tree (so
    uncommitted edits are tested too), and nothing else (no built extensions, no build/)."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the checkout's files")
    dest = tmp_path_factory.mktemp("first-run") / "taper"
    for rel in tracked_files():
        src = os.path.join(ROOT, rel)
        if not os.path.lexists(src):            # deleted in the working tree, not committed yet
            continue
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copy(src, os.path.join(dest, rel), follow_symlinks=False)
    assert not glob.glob(os.path.join(dest, "pyx", "*.so"))
    return str(dest)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> str:
    """A new virtualenv whose sys.path ends with this interpreter's site-packages (a .pth file of
    plain paths). Those directories' own .pth files are not run, so the editable install of the
    checkout under test (a .pth hook) stays invisible: `server`, `engine` and `pyx` must come from
    what the command installs."""
    venv = str(tmp_path_factory.mktemp("venv") / "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    purelib = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "_outer_site_packages.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return venv


def user_env(venv: str, cache: str) -> dict:
    """The environment of a user who has just activated the fresh virtualenv: no TAPER_* build
    switches, no PYTHONPATH, the demo cache under `cache`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TAPER_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    home_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env.update(VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"],
               XDG_CACHE_HOME=cache,
               # pip's cache stays where it was (XDG_CACHE_HOME moves it otherwise)
               PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR") or os.path.join(home_cache, "pip"))
    return env


def get_json(url: str, body: dict | None = None, timeout: float = ANSWER_S) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def serve_and_chat(command: str, cwd: str, env: dict, log_path: str) -> dict:
    """Runs `command` (which installs and then serves) in a shell until /health answers 200, asks
    for a chat completion, stops the server with SIGTERM, and returns the completion."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", f"{command} --p {port}"], cwd=cwd, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + INSTALL_AND_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`{command}` in {cwd} exited with {proc.returncode} before serving:\n"
                            + tail(log_path))
            try:
                if get_json(base + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not serving after {INSTALL_AND_START_S} s:\n" \
                + tail(log_path)
            time.sleep(1)
        status, models = get_json(base + "/v1/models")
        assert status == 200, tail(log_path)
        model = models["data"][0]["id"]
        status, answer = get_json(base + "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 8})
        assert status == 200, tail(log_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, f"exit {proc.returncode} on SIGTERM:\n" + tail(log_path)
    return answer


def tail(path: str, n: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def check_answer(answer: dict) -> None:
    assert answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert 1 <= answer["usage"]["completion_tokens"] <= 8


def built_extensions(clone: str) -> dict[str, float]:
    return {p: os.path.getmtime(p) for p in glob.glob(os.path.join(clone, "pyx", "*.so"))}


def test_readme_serve_command_from_the_clone_root(clone, fresh_venv, tmp_path):
    # In the clone's root, `python -m server` imports the clone's server/ and pyx/ (the current
    # directory comes first on sys.path): the extensions must be there, not only in site-packages.
    assert SERVE.endswith("python -m server"), SERVE
    cache = str(tmp_path / "cache")
    start = time.monotonic()
    answer = serve_and_chat(SERVE, clone, user_env(fresh_venv, cache), str(tmp_path / "log"))
    print(f"`{SERVE}` from a clean clone's root: installed, served and answered in "
          f"{time.monotonic() - start:.0f} s")
    check_answer(answer)
    # README: the demo checkpoint is written to $XDG_CACHE_HOME/taper/demo
    assert os.path.exists(os.path.join(cache, "taper", "demo", "model.safetensors"))
    assert built_extensions(clone), "the install built no extension in the clone's pyx/"


def test_readme_serve_command_from_another_directory(clone, fresh_venv, tmp_path):
    # After the install in the clone's root (the test above, or the test command's
    # `pip install -e .`), the command pointed at the clone, from an unrelated directory: its
    # `python -m server` finds Taper through the install, and its reinstall rebuilds nothing.
    env = user_env(fresh_venv, str(tmp_path / "cache"))
    if not built_extensions(clone):
        subprocess.run(["bash", "-c", "pip install -e ."], cwd=clone, env=env, check=True,
                       capture_output=True, timeout=INSTALL_AND_START_S)
    before = built_extensions(clone)
    assert " -e . " in SERVE + " ", SERVE
    command = SERVE.replace(" -e . ", f" -e {clone} ", 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    start = time.monotonic()
    answer = serve_and_chat(command, str(elsewhere), env, str(tmp_path / "log"))
    print(f"`{command}` from another directory: served and answered in "
          f"{time.monotonic() - start:.0f} s")
    check_answer(answer)
    assert built_extensions(clone) == before, "the second install rebuilt extensions"
    with open(os.path.join(clone, "build", "taper-build.log")) as f:
        log = f.read()
    assert log.count("up to date (in place), not rebuilt") == len(before), log

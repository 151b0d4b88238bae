"""LoRA adapters through a live `python -m server` (vLLM's flags and routes) on the random demo
checkpoint, with adapters written by `peft`: /v1/models lists them with their parent, a request's
`model` picks one (the text equals the offline engine's with that adapter), adapters are loaded and
unloaded through the API, and bad adapters get a 400 (or stop start-up) naming them."""
from __future__ import annotations

import json
import time

import pytest

from engine import LLM, SamplingParams
from lora_fixtures import write_adapter
from server_fakes import LiveServer, client_for, http_request, post_json

pytestmark = pytest.mark.timeout(300)

PROMPT = "def hello(name): return"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


@pytest.fixture(scope="module")
def adapters(demo, tmp_path_factory):
    from hf_oracle import load_hf
    root, hf = tmp_path_factory.mktemp("adapters"), load_hf(demo)
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    return {"alpha": write_adapter(hf, root / "alpha", seed=1, r=8, lora_alpha=16,
                                   target_modules=targets),
            "beta": write_adapter(hf, root / "beta", seed=2, r=4, lora_alpha=8, use_rslora=True,
                                  target_modules=["k_proj", "up_proj"]),
            "wide": write_adapter(hf, root / "wide", seed=3, r=16, target_modules=["q_proj"])}


@pytest.fixture(scope="module")
def server(demo, adapters, tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp("lora"), demo, "--mem", "64",
                      "--served-model-name", "demo", "--enable-lora", "--lora-modules",
                      f"alpha={adapters['alpha']}", "--max-loras", "2", "--max-lora-rank", "8",
                      "--allow-runtime-lora-updating")
    yield live
    live.close()


@pytest.fixture(scope="module")
def offline(demo, adapters):
    """Greedy text of the offline engine, per adapter name (None: the base model)."""
    llm = LLM(demo, num_kv_blocks=64, lora=dict(modules=dict(adapters), max_lora_rank=16))

    def text(name):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, lora_name=name)
        return llm.generate([PROMPT], params)[0].text
    return text


def complete(port, model):
    out = client_for(port).completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                              temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_models_list_adapters_and_requests_pick_them(server, adapters, offline):
    models = client_for(server.port).models.list().data
    assert [m.id for m in models] == ["demo", "alpha"]
    alpha = models[1].model_dump()
    assert (alpha["parent"], alpha["root"]) == ("demo", adapters["alpha"])
    assert "parent" not in models[0].model_dump() or models[0].model_dump()["parent"] is None
    assert complete(server.port, "alpha") == offline("alpha")
    assert complete(server.port, "demo") == offline(None)
    assert offline("alpha") != offline(None)
    chat = client_for(server.port).chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "alpha"
    status, body = post_json(server.port, "/v1/embeddings", {"model": "alpha", "input": "x"})
    assert status == 400 and "is a LoRA adapter" in body["error"]["message"]


def test_load_and_unload_through_the_api(server, adapters, offline):
    port = server.port
    status, ctype, body = http_request(port, "POST", "/v1/load_lora_adapter",
                                       {"lora_name": "beta", "lora_path": adapters["beta"]})
    assert (status, body.decode()) == (200, "Success: LoRA adapter 'beta' added successfully.")
    assert ctype.startswith("text/plain")
    assert [m.id for m in client_for(port).models.list().data] == ["demo", "alpha", "beta"]
    assert complete(port, "beta") == offline("beta") != offline(None)
    status, body = post_json(port, "/v1/load_lora_adapter",
                             {"lora_name": "beta", "lora_path": adapters["beta"]})
    assert status == 400 and "'beta' has already been loaded" in body["error"]["message"]
    status, _, body = http_request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert (status, body.decode()) == (200, "Success: LoRA adapter 'beta' removed successfully.")
    status, body = post_json(port, "/v1/completions", {"model": "beta", "prompt": PROMPT})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = post_json(port, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert status == 404 and "'beta' cannot be found" in body["error"]["message"]
    assert complete(port, "alpha") == offline("alpha")      # the others are unaffected


def test_bad_adapters_are_a_400_naming_them(server, adapters, tmp_path):
    port = server.port
    status, body = post_json(port, "/v1/load_lora_adapter",
                             {"lora_name": "wide", "lora_path": adapters["wide"]})
    message = body["error"]["message"]
    assert status == 400 and body["error"]["param"] == "lora_path"
    assert "LoRA adapter 'wide'" in message and "rank 16, above --max-lora-rank 8" in message
    status, body = post_json(port, "/v1/load_lora_adapter",
                             {"lora_name": "gone", "lora_path": str(tmp_path / "nothing")})
    assert status == 400 and "LoRA adapter 'gone'" in body["error"]["message"]
    assert "no such directory" in body["error"]["message"]
    status, body = post_json(port, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "Both 'lora_name' and 'lora_path'" in body["error"]["message"]
    status, body = post_json(port, "/v1/load_lora_adapter",
                             {"lora_name": "demo", "lora_path": adapters["beta"]})
    assert status == 400 and "base model's name" in body["error"]["message"]
    assert [m.id for m in client_for(port).models.list().data] == ["demo", "alpha"]


def test_runtime_updates_are_off_unless_enabled(demo, adapters, tmp_path):
    live = LiveServer(tmp_path, demo, "--mem", "32", "--enable-lora", "--lora-modules",
                      f"alpha={adapters['alpha']}", "--max-lora-rank", "8",
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": ""})
    try:
        status, body = post_json(live.port, "/v1/load_lora_adapter",
                                 {"lora_name": "beta", "lora_path": adapters["beta"]})
        assert status == 404 and "--allow-runtime-lora-updating" in body["error"]["message"]
        complete(live.port, "alpha")                 # the adapters given at start are served
    finally:
        live.close()


def test_a_bad_adapter_stops_start_up_naming_it(demo, adapters, tmp_path):
    live = LiveServer(tmp_path, demo, "--mem", "32", "--enable-lora", "--lora-modules",
                      f"wide={adapters['wide']}", "--max-lora-rank", "8", wait_ready=False)
    try:
        deadline = time.time() + 120
        while live.proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert live.proc.returncode == 1
        assert "LoRA adapter 'wide'" in live.log() and "above --max-lora-rank 8" in live.log()
    finally:
        live.close()


def test_lora_flags():
    from server.__main__ import build_parser, check_args, engine_config, server_settings
    p = build_parser()
    args = p.parse_args(["--w", "/m", "--cpu", "--enable-lora", "--lora-modules", "a=/x",
                         json.dumps({"name": "b", "path": "/y", "base_model_name": "m"}),
                         "--max-loras", "3", "--max-lora-rank", "32",
                         "--allow-runtime-lora-updating"])
    assert check_args(args) is None
    config = engine_config(args)
    assert (config.lora.modules, config.lora.max_loras, config.lora.max_lora_rank) == (
        {"a": "/x", "b": "/y"}, 3, 32)
    assert server_settings(args, config).lora_runtime_updates
    assert engine_config(p.parse_args(["--w", "/m", "--cpu"])).lora is None
    for argv, problem in ((["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
                          (["--max-loras", "2"], "--max-loras needs --enable-lora"),
                          (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
                          (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "given twice"),
                          (["--enable-lora", "--max-loras", "0"], "--max-loras must be"),
                          (["--enable-lora", "--max-lora-rank", "1000"], "--max-lora-rank")):
        assert problem in check_args(p.parse_args(["--w", "/m", *argv])), argv

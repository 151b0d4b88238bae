"""A real `python -m server` process on the generated demo checkpoint: the same API end to end,
streamed text equal to non-streamed text, usage counted from an independent tokenizer, the CLI,
the SIGTERM drain, a load test with disconnects, and no torch in the server process."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import openai
import pytest

from server_fakes import (LiveServer, assert_error, client_for, http_request, post_json,
                          validate)

pytestmark = pytest.mark.timeout(300)


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


# ---- the CLI and the demo checkpoint

def test_cli_flags():
    from server.__main__ import build_parser
    p = build_parser()
    a = p.parse_args(["--h", "127.0.0.1", "--p", "8080", "--w", "/m", "--mem", "64",
                      "--disable-prefix-cache", "--cpu", "--served-model-name", "a", "b"])
    assert (a.host, a.port, a.weight_path, a.kvcache_mem, a.served_model_name) == (
        "127.0.0.1", 8080, "/m", 64, ["a", "b"])
    a = p.parse_args(["--host", "::1", "--port", "1", "--model-id", "org/x",
                      "--kvcache-mem-gpu", "8",
                      "--dtype", "bf16", "--block-size", "32", "--max-num-seqs", "4",
                      "--prefill-chunk-size", "64", "--max-model-len", "512",
                      "--yarn-scaling-factor", "2.0", "--log"])
    assert (a.host, a.model_id, a.kvcache_mem, a.block_size, a.yarn_scaling_factor) == (
        "::1", "org/x", 8, 32, 2.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--w", "/a", "--m", "b"])       # one model source only
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--help"])
    assert e.value.code == 0


def test_no_model_serves_the_demo_checkpoint(tmp_path, monkeypatch, caplog):
    from server.__main__ import build_parser, engine_config
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="taper.server"):
        config = engine_config(build_parser().parse_args(["--cpu", "--mem", "32"]))
    assert config.model == str(tmp_path / "taper" / "demo")
    assert "RANDOM weights" in caplog.text and "--m <hub id> or --w <dir>" in caplog.text
    assert (config.backend, config.kv_cache_memory_mb, config.enable_prefix_caching) == (
        "cpu", 32, True)


def test_demo_checkpoint_is_deterministic_and_cached(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from server.demo_model import ensure_demo_checkpoint, write_demo_checkpoint
    a, b = write_demo_checkpoint(str(tmp_path / "a")), write_demo_checkpoint(str(tmp_path / "b"))
    for name in sorted(os.listdir(a)):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
    config = json.loads((Path(a) / "config.json").read_text())
    tok = Tokenizer.from_file(str(Path(a) / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size()
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert tok.decode(tok.encode("Hello world").ids) == "Hello world"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = ensure_demo_checkpoint()
    stamp = os.stat(Path(path) / "model.safetensors").st_mtime_ns
    assert ensure_demo_checkpoint() == path
    assert os.stat(Path(path) / "model.safetensors").st_mtime_ns == stamp    # reused


# ---- the live server

def demo_tokenizer(live):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(live.model_dir, "tokenizer.json"))


def chatml(messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


MSGS = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"}]


def test_live_models(live):
    status, _, payload = http_request(live.port, "GET", "/v1/models")
    body = json.loads(payload)
    validate(body, "ListModelsResponse")
    assert [m["id"] for m in body["data"]] == ["demo"]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 1234}])
def test_live_chat_stream_equals_non_stream(live, sampling):
    client = client_for(live.port)
    args = dict(model="demo", messages=MSGS, max_tokens=12, extra_body={"ignore_eos": True},
                **sampling)
    raw = client.chat.completions.with_raw_response.create(**args)
    body = json.loads(raw.text)
    validate(body, "CreateChatCompletionResponse")
    whole = raw.parse()
    assert whole.choices[0].finish_reason == "length"
    num_prompt = len(demo_tokenizer(live).encode(chatml(MSGS), add_special_tokens=False).ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens,
            whole.usage.total_tokens) == (num_prompt, 12, num_prompt + 12)
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    for c in chunks:
        validate(c.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1


def test_live_completions(live):
    client = client_for(live.port)
    prompt = "The capital of France is"
    args = dict(model="demo", prompt=prompt, max_tokens=8, temperature=0.0,
                extra_body={"ignore_eos": True})
    raw = client.completions.with_raw_response.create(**args)
    body = json.loads(raw.text)
    validate(body, "CreateCompletionResponse")
    whole = raw.parse()
    num_prompt = len(demo_tokenizer(live).encode(prompt).ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, 8)
    parts = list(client.completions.create(**args, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    # batch with echo: each choice starts with its prompt; the same prompt gives the same text
    batch = client.completions.create(model="demo", prompt=[prompt, "Hello", prompt],
                                      max_tokens=8, temperature=0.0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert batch.choices[0].text == prompt + whole.choices[0].text == batch.choices[2].text
    assert batch.choices[1].text.startswith("Hello")
    assert batch.usage.completion_tokens == 24


def test_live_errors(live):
    client = client_for(live.port)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MSGS, temperature=2.5)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MSGS, n=2)
    assert e.value.param == "n" and "not yet supported" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MSGS)
    assert e.value.code == "model_not_found"
    status, _, payload = http_request(live.port, "POST", "/v1/completions", raw=b'{"prompt": ')
    assert_error(status, json.loads(payload), 400, None)
    status, body = post_json(live.port, "/v1/completions", {"prompt": "word " * 5000})
    assert_error(status, body, 400, "prompt", "context_length_exceeded")


def test_live_shutdown_is_clean_and_torch_free(live):
    # runs last in this module: it stops the server
    live.proc.send_signal(signal.SIGTERM)
    rc = live.proc.wait(timeout=60)
    log = live.log_path.read_text()
    assert rc == 0, log
    assert "TAPER_TORCH_IMPORTED=False" in log, log

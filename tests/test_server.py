"""The OpenAI-compatible server, pinned with the official `openai` client and the OpenAI schema.

Two layers:
- A scripted fake engine behind the real app on a real Hypercorn (in a thread): exact wire
  behaviour, validation, errors, batching, and that a client leaving mid-stream aborts the request.
- A real `python -m server` process on the generated demo checkpoint: the same API end to end,
  streamed text equal to non-streamed text, usage counted from an independent tokenizer, a clean
  exit on SIGTERM, and no torch in the server process.

Response bodies are validated against schemas copied from the OpenAI OpenAPI spec into
tests/data/openai_schemas.json (see tests/data/extract_openai_schemas.py).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.outputs import RequestOutput
from server.app import create_app

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = json.loads((ROOT / "tests" / "data" / "openai_schemas.json").read_text())["$defs"]


def validate(obj, schema_name: str):
    schema = {"$ref": f"#/$defs/{schema_name}", "$defs": SCHEMAS}
    jsonschema.Draft202012Validator(schema).validate(obj)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- raw HTTP helpers (the SDK hides the wire; these see it)

def http_request(port: int, method: str, path: str, body=None, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), payload


def post_json(port: int, path: str, body) -> tuple[int, dict]:
    status, _, payload = http_request(port, "POST", path, body)
    return status, json.loads(payload)


def post_sse(port: int, path: str, body) -> list:
    """The data lines of an SSE response: parsed JSON objects, then the literal "[DONE]"."""
    status, ctype, payload = http_request(port, "POST", path, body)
    assert status == 200, payload
    assert ctype.startswith("text/event-stream")
    text = payload.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def assert_error(status: int, body: dict, want_status: int, param: str | None, code=None):
    assert status == want_status, body
    validate(body, "ErrorResponse")
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


# ---- a scripted engine

class FakeTokenizer:
    """Bytes as token ids, BOS = 1; chat renders `<role>content` per message."""
    has_chat_template = True

    def encode(self, text: str) -> list[int]:
        return [1] + list(text.encode())

    def encode_chat(self, messages, add_generation_prompt=True, chat_template=None,
                    **template_kwargs) -> list[int]:
        self.last_template_kwargs = template_kwargs
        if messages[0]["role"] == "assistant":
            raise ValueError("Conversations must not start with an assistant message")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return list((text + ("<assistant>" if add_generation_prompt else "")).encode())

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i > 1).decode(errors="replace")


class FakeEngine:
    """Writes WORDS[i % len] for output position i; 'stop' on a stop string, else 'length'."""
    WORDS = ["Hello", " there", ",", " friend", ".", " How", " are", " you", "?"]

    def __init__(self, max_model_len: int = 256, delay: float = 0.0):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.is_running = True
        self.delay = delay
        self.requests: dict[str, tuple[list[int], object]] = {}
        self.aborted: list[str] = []
        self.fail_with: str | None = None

    def add_request(self, request_id, prompt_token_ids, params):
        self.requests[request_id] = (list(prompt_token_ids), params)
        return self._run(request_id, list(prompt_token_ids), params)

    async def _run(self, request_id, prompt, params):
        """Like AsyncEngine's stream: closing it before the end aborts the request."""
        done = False
        try:
            async for out in self._outputs(request_id, prompt, params):
                done = out.finished
                yield out
        finally:
            if not done:
                self.abort(request_id)

    async def _outputs(self, request_id, prompt, params):
        text = ""
        for i in range(params.max_tokens):
            await asyncio.sleep(self.delay)
            if request_id in self.aborted:
                yield RequestOutput(request_id, finished=True, finish_reason="abort")
                return
            if self.fail_with:
                yield RequestOutput(request_id, finished=True, finish_reason="error",
                                    error=self.fail_with)
                return
            word = self.WORDS[i % len(self.WORDS)]
            stop = next((s for s in params.stop if s in text + word), None)
            if stop:
                word = (text + word).split(stop)[0][len(text):]
            text += word
            done = stop is not None or i + 1 == params.max_tokens
            yield RequestOutput(request_id, new_token_ids=[100 + i], text_delta=word,
                                token_ids=list(range(100, 101 + i)), text=text, finished=done,
                                finish_reason=("stop" if stop else "length") if done else None,
                                num_prompt_tokens=len(prompt), num_output_tokens=i + 1,
                                num_cached_tokens=3 if len(prompt) > 3 else 0)
            if done:
                return

    def abort(self, request_id):
        self.aborted.append(request_id)

    # what the server reads for /metrics and the queue limit
    generation_defaults: dict = {}
    queued = 0

    def num_queued_requests(self):
        return self.queued

    def stats(self):
        from engine.stats import EngineStats
        return EngineStats(num_requests_running=2, num_requests_waiting=self.queued,
                           num_kv_blocks=100, num_free_kv_blocks=75, prefix_cache_queries=40,
                           prefix_cache_hits=30, num_preemptions=1, prompt_tokens=123,
                           generation_tokens=45)


def fake_text(n: int) -> str:
    return "".join(FakeEngine.WORDS[i % len(FakeEngine.WORDS)] for i in range(n))


class ThreadedServer:
    """The app on a real Hypercorn, in a background thread with its own event loop."""

    def __init__(self, app):
        self.app, self.port = app, free_port()
        self.loop = None
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "server did not start"
                time.sleep(0.05)

    async def _serve(self):
        from hypercorn.asyncio import serve
        from hypercorn.config import Config
        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.errorlog = logging.getLogger("test.hypercorn")
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        await serve(self.app, config, shutdown_trigger=self.stop.wait)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    server = ThreadedServer(create_app(engine, ["fake-model", "alias"]))
    server.engine = engine
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _reset_fake(request):
    if "fake" in request.fixturenames:
        eng = request.getfixturevalue("fake").engine
        eng.delay, eng.fail_with, eng.is_running = 0.0, None, True
    yield


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}


# ---- fake engine: the wire format

def test_models_and_health(fake):
    status, models = http_request(fake.port, "GET", "/v1/models")[::2]
    models = json.loads(models)
    assert status == 200
    validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == ["fake-model", "alias"]
    assert all(m["owned_by"] == "taper" and m["object"] == "model" for m in models["data"])
    assert [m.id for m in client_for(fake.port).models.list()] == ["fake-model", "alias"]
    assert http_request(fake.port, "GET", "/health")[0] == 200
    fake.engine.is_running = False
    assert http_request(fake.port, "GET", "/health")[0] == 503


def test_chat_non_streaming(fake):
    status, body = post_json(fake.port, "/v1/chat/completions", CHAT)
    assert status == 200, body
    validate(body, "CreateChatCompletionResponse")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                "message": {"role": "assistant", "content": fake_text(6),
                                            "refusal": None}}]
    prompt = FakeTokenizer().encode_chat(CHAT["messages"])
    usage = body["usage"]
    times = {k: usage.pop(k) for k in ("prompt_time_costs", "completion_time_costs")}
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 6,
                     "total_tokens": len(prompt) + 6, "prompt_tokens_details": {"cached_tokens": 3}}
    assert all(isinstance(t, int) and t >= 0 for t in times.values()), times
    ids, params = fake.engine.requests[body["id"]]
    assert ids == prompt and params.max_tokens == 6


def test_chat_streaming_wire_format(fake):
    events = post_sse(fake.port, "/v1/chat/completions", {**CHAT, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        validate(c, "CreateChatCompletionStreamResponse")
        assert c["object"] == "chat.completion.chunk" and "usage" not in c
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == fake_text(6)


def test_chat_streaming_include_usage(fake):
    events = post_sse(fake.port, "/v1/chat/completions",
                      {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    for c in chunks:
        validate(c, "CreateChatCompletionStreamResponse")
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    # and through the SDK
    stream = client_for(fake.port).chat.completions.create(
        model="fake-model", messages=CHAT["messages"], max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    got = list(stream)
    assert got[-1].choices == [] and got[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in got[:-1]) == fake_text(4)


def test_chat_sdk_and_sampling_params(fake):
    client = client_for(fake.port)
    r = client.chat.completions.create(
        model="alias", messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
        max_completion_tokens=20, temperature=0.5, top_p=0.9, seed=-5, stop=" How",
        presence_penalty=0.1, frequency_penalty=0.2,
        extra_body={"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "stop_token_ids": [9]})
    assert r.model == "alias"
    assert r.choices[0].message.content == fake_text(5)    # cut before the stop string
    assert r.choices[0].finish_reason == "stop"
    ids, p = fake.engine.requests[r.id]
    assert bytes(ids).decode() == "<system>Be brief.<user>a\nb<assistant>"
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (20, 0.5, 0.9, 7, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert (p.seed, p.stop, p.stop_token_ids, p.min_tokens, p.ignore_eos) == (
        2**64 - 5, [" How"], [9], 2, True)


def test_max_tokens_defaults_to_the_room_left(fake):
    status, body = post_json(fake.port, "/v1/completions",
                             {"model": "fake-model", "prompt": "abc", "max_tokens": None})
    assert status == 200
    _, params = fake.engine.requests[body["id"] + "-0"]
    assert params.max_tokens == fake.engine.max_model_len - 4     # BOS + 3 bytes
    assert body["usage"]["completion_tokens"] == params.max_tokens


def test_completions(fake):
    client = client_for(fake.port)
    r = client.completions.create(model="fake-model", prompt="Say", max_tokens=3)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, fake_text(3), "length")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 3, 7)
    status, body = post_json(fake.port, "/v1/completions",
                             {"model": "fake-model", "prompt": ["a", "bb", "ccc"], "max_tokens": 2,
                              "echo": True})
    assert status == 200
    validate(body, "CreateCompletionResponse")
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a" + fake_text(2)), (1, "bb" + fake_text(2)), (2, "ccc" + fake_text(2))]
    assert body["usage"]["prompt_tokens"] == 2 + 3 + 4
    assert body["usage"]["completion_tokens"] == 6
    for prompt, want in (([5, 6, 7], [[5, 6, 7]]), ([[5], [6, 7]], [[5], [6, 7]])):
        status, body = post_json(fake.port, "/v1/completions",
                                 {"model": "fake-model", "prompt": prompt, "max_tokens": 1})
        assert status == 200, body
        got = [fake.engine.requests[f"{body['id']}-{i}"][0] for i in range(len(want))]
        assert got == want
        assert len(body["choices"]) == len(want)


def test_completions_streaming_batch(fake):
    events = post_sse(fake.port, "/v1/completions",
                      {"prompt": ["x", "yy"], "max_tokens": 3, "stream": True, "echo": True,
                       "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    for c in chunks[:-1]:
        validate(c, "CreateCompletionStreamResponse")
        assert c["object"] == "text_completion" and len(c["choices"]) == 1
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: "x" + fake_text(3), 1: "yy" + fake_text(3)}
    finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    # SDK streaming
    parts = list(client_for(fake.port).completions.create(model="fake-model", prompt="q",
                                                          max_tokens=5, stream=True))
    assert "".join(p.choices[0].text for p in parts) == fake_text(5)
    assert parts[-1].choices[0].finish_reason == "length"


# ---- fake engine: errors

@pytest.mark.parametrize("extra, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"stop": 5}, "stop"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]},
                                     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_chat_params_are_400_naming_the_param(fake, extra, param):
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, **extra})
    assert_error(status, body, 400, param)


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"response_format": {"type": "json_object"}},
                                                  "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"use_beam_search": True}, "use_beam_search"),
])
def test_later_features_are_400_not_yet_supported(fake, extra, param):
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, **extra})
    assert_error(status, body, 400, param, "unsupported_parameter")
    assert "not yet supported" in body["error"]["message"]


def test_completion_errors(fake):
    for extra, param in (({"suffix": "x"}, "suffix"), ({"logprobs": 2}, "logprobs"),
                         ({"n": 3}, "n"), ({"prompt": []}, "prompt"), ({"prompt": 7}, "prompt"),
                         ({"prompt": [1, -2]}, "prompt")):
        status, body = post_json(fake.port, "/v1/completions",
                                 {"prompt": "hi", "max_tokens": 2, **extra})
        assert_error(status, body, 400, param)


def test_sdk_errors(fake):
    client = client_for(fake.port)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=CHAT["messages"], temperature=5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=CHAT["messages"], n=2)
    assert e.value.param == "n" and "not yet supported" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT["messages"])
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x")


def test_malformed_json_and_routes(fake):
    for raw in (b"{not json", b"[1, 2]", b"", "\u00e9".encode("latin-1")):
        status, _, payload = http_request(fake.port, "POST", "/v1/chat/completions", raw=raw)
        assert_error(status, json.loads(payload), 400, None)
    status, _, payload = http_request(fake.port, "GET", "/v1/nothing")
    assert status == 404 and json.loads(payload)["error"]["type"] == "not_found_error"
    status, _, payload = http_request(fake.port, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(payload)


def test_context_length(fake):
    long = "x" * 300
    status, body = post_json(fake.port, "/v1/completions", {"prompt": long})
    assert_error(status, body, 400, "prompt", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": long}]})
    assert_error(status, body, 400, "messages", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/completions", {"prompt": "x", "max_tokens": 255})
    assert_error(status, body, 400, "max_tokens", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/completions", {"prompt": "x", "max_tokens": 254})
    assert status == 200 and body["usage"]["total_tokens"] == 256


def test_null_means_not_given(fake):
    status, body = post_json(fake.port, "/v1/chat/completions",
                             {**CHAT, "stream": None, "n": None, "temperature": None,
                              "stop": None, "stream_options": None, "ignore_eos": None})
    assert status == 200, body
    assert body["object"] == "chat.completion"
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, "messages": None})
    assert_error(status, body, 400, "messages", "missing_required_parameter")


def test_template_rejection_is_400(fake):
    status, body = post_json(fake.port, "/v1/chat/completions",
                             {"messages": [{"role": "assistant", "content": "x"}]})
    assert_error(status, body, 400, "messages")


def test_engine_failure(fake):
    fake.engine.fail_with = "kernel exploded"
    status, body = post_json(fake.port, "/v1/chat/completions", CHAT)
    assert_error(status, body, 500, None, "engine_error")
    assert "kernel exploded" in body["error"]["message"]
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, "stream": True})
    assert_error(status, body, 500, None, "engine_error")    # failed before the first chunk
    fake.engine.is_running = False
    status, body = post_json(fake.port, "/v1/completions", {"prompt": "x"})
    assert_error(status, body, 503, None)


def test_client_disconnect_aborts_the_request(fake):
    fake.engine.delay = 0.02
    sock = socket.create_connection(("127.0.0.1", fake.port))
    body = json.dumps({**CHAT, "max_tokens": 10_000 // 50, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    sock.close()
    request_id = json.loads(received.split(b"data: ")[1].split(b"\n\n")[0])["id"]
    deadline = time.time() + 10
    while request_id not in fake.engine.aborted:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.02)


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


# ---- a real server process on the demo checkpoint

# Serves like `python -m server`, and on exit reports whether torch was ever imported.
SERVER_WRAPPER = """
import atexit, runpy, sys
atexit.register(lambda: print("TAPER_TORCH_IMPORTED=%s" % ("torch" in sys.modules), flush=True))
sys.argv = ["taper"] + sys.argv[1:]
runpy.run_module("server", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    tmp = tmp_path_factory.mktemp("live")
    model_dir = write_demo_checkpoint(str(tmp / "demo"))
    port = free_port()
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_WRAPPER, "--w", model_dir, "--p", str(port),
         "--h", "127.0.0.1", "--cpu", "--mem", "64", "--served-model-name", "demo"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while True:
        try:
            health = http_request(port, "GET", "/health")[0]
        except OSError:
            health = None
        if health == 200:
            break
        if proc.poll() is not None or time.time() > deadline:      # 503: still loading
            proc.kill()
            pytest.fail("server did not start:\n" + log_path.read_text())
        time.sleep(0.2)

    class Live:
        pass
    live = Live()
    live.port, live.proc, live.model_dir, live.log_path = port, proc, model_dir, log_path
    yield live
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


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

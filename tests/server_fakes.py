"""Shared by the server tests: a scripted engine behind the real app on a real Hypercorn, a live
`python -m server` process, raw HTTP helpers (the SDK hides the wire; these see it), and schema
validation against the OpenAI spec subset in tests/data/openai_schemas.json."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.core.outputs import RequestOutput

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

def http_response(port: int, method: str, path: str, body=None, raw: bytes | None = None,
                  headers: dict | None = None, content_type: str | None = "application/json",
                  timeout: float = 60) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    sent = {} if content_type is None else {"Content-Type": content_type}
    conn.request(method, path, body=data, headers={**sent, **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload


def http_request(port: int, method: str, path: str, body=None, raw: bytes | None = None):
    status, headers, payload = http_response(port, method, path, body, raw)
    return status, headers.get("content-type"), payload


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


def aborted_after_disconnect(fake, path: str, body: dict) -> set:
    """POSTs a non-streamed request to the fake engine's server over a raw socket and leaves
    while it generates (nothing sent yet); the ids the engine aborted for it, once it has."""
    fake.engine.delay = 0.02
    before = set(fake.engine.aborted)
    sock = socket.create_connection(("127.0.0.1", fake.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    time.sleep(0.3)                    # generating, nothing sent yet
    sock.close()
    deadline = time.time() + 10
    while not set(fake.engine.aborted) - before:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.02)
    return set(fake.engine.aborted) - before


def assert_error(status: int, body: dict, want_status: int, param: str | None, code=None):
    assert status == want_status, body
    validate(body, "ErrorResponse")
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


# ---- a scripted engine

def check_length(text: str, max_chars: int | None):
    from engine.text.tokenizer import TextTooLong
    if max_chars is not None and len(text) > max_chars:
        raise TextTooLong(len(text), max_chars)


class FakeTokenizer:
    """Bytes as token ids, BOS = 1; chat renders `<role>content` per message. Remembers what the
    last chat rendering was given."""
    has_chat_template = True
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True,
               max_chars: int | None = None) -> list[int]:
        check_length(text, max_chars)
        return [1] * add_special_tokens + list(text.encode())

    def encode_chat(self, messages, tools=None, add_generation_prompt=True, chat_template=None,
                    max_chars: int | None = None, rewrite=None, **template_kwargs) -> list[int]:
        self.last_messages, self.last_chat_template = messages, chat_template
        self.last_tools = tools
        self.last_template_kwargs = template_kwargs
        if messages[0]["role"] == "assistant":
            raise ValueError("Conversations must not start with an assistant message")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        text = rewrite(text) if rewrite else text
        check_length(text, max_chars)
        return list(text.encode())

    def max_text_chars(self, num_tokens: int) -> int:
        return num_tokens           # a token is a byte: it stands for at most one character

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i > 1).decode(errors="replace")

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [f"<{i}>" for i in ids]

    def has_tokens(self, strings) -> bool:
        return False

    def has_special_tokens(self, strings) -> bool:
        return False


class FakeEngine:
    """Writes WORDS[i % len] for output position i; 'stop' on a stop string, else 'length'."""
    WORDS = ["Hello", " there", ",", " friend", ".", " How", " are", " you", "?"]

    def __init__(self, max_model_len: int = 256, delay: float = 0.0):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.model_config = types.SimpleNamespace(architecture="FakeForCausalLM",
                                                  vocab_size=FakeTokenizer.vocab_size)
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
                                stop_reason=stop,
                                num_prompt_tokens=len(prompt), num_output_tokens=i + 1,
                                num_cached_tokens=3 if len(prompt) > 3 else 0)
            if done:
                return

    def abort(self, request_id):
        self.aborted.append(request_id)

    # what the server reads for /metrics and the queue limit
    generation_defaults: dict = {}
    queued = 0

    def num_queued_sequences(self):
        return self.queued

    def stats(self):
        from engine.core.stats import EngineStats
        return EngineStats(num_requests_running=2, num_requests_waiting=self.queued,
                           num_kv_blocks=100, num_free_kv_blocks=75, prefix_cache_queries=40,
                           prefix_cache_hits=30, num_preemptions=1, prompt_tokens=123,
                           generation_tokens=45)


def serve_fake(settings):
    """A FakeEngine behind create_app(settings) on a ThreadedServer (`.engine` is the engine),
    for a module fixture to `yield from`; closed when the module is done."""
    from server.app import create_app
    engine = FakeEngine()
    server = ThreadedServer(create_app(engine, settings))
    server.engine = engine
    yield server
    server.close()


@pytest.fixture(autouse=True)
def reset_fake(request):
    """Undoes a test's scripting of the module's `fake` server engine (delay, failure, stopped);
    active in a module that imports it."""
    if "fake" in request.fixturenames:
        eng = request.getfixturevalue("fake").engine
        eng.delay, eng.fail_with, eng.is_running = 0.0, None, True
    yield


def clients_per_tool_parser(engine, parsers):
    """{parser: an OpenAI client} for each tool-call format, each on its own ThreadedServer over
    the same engine, for a module fixture to `yield from`; closed when the module is done."""
    from server.app import ServerSettings, create_app
    servers, out = [], {}
    for name in parsers:
        server = ThreadedServer(create_app(engine, ServerSettings(["demo"], tool_parser=name)))
        servers.append(server)
        out[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                  max_retries=0, timeout=300)
    yield out
    for s in servers:
        s.close()


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


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}


# ---- a real `python -m server` process

# Serves like `python -m server`, and on exit reports whether torch was ever imported.
SERVER_WRAPPER = """
import atexit, runpy, sys
atexit.register(lambda: print("TAPER_TORCH_IMPORTED=%s" % ("torch" in sys.modules), flush=True))
sys.argv = ["taper"] + sys.argv[1:]
runpy.run_module("server", run_name="__main__", alter_sys=True)
"""


class LiveServer:
    """`python -m server` on a port of its own, its output in `log_path`; `model_dir` None gives no
    --w (the flags name the model), `host` None no --h (the default bind), `env` adds to the
    environment it inherits."""

    def __init__(self, tmp: Path, model_dir: str | None, *flags: str, wait_ready: bool = True,
                 env: dict | None = None, host: str | None = "127.0.0.1"):
        self.port, self.model_dir = free_port(), model_dir
        self.log_path = tmp / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_WRAPPER, *(["--w", model_dir] if model_dir else []),
             "--p", str(self.port), *(["--h", host] if host else []), "--cpu", *flags],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env})
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 180):
        deadline = time.time() + timeout
        while True:
            try:
                health = http_request(self.port, "GET", "/health")[0]
            except OSError:
                health = None
            if health == 200:
                return
            if self.proc.poll() is not None or time.time() > deadline:   # 503: still loading
                self.close()
                pytest.fail("server did not start:\n" + self.log_path.read_text())
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

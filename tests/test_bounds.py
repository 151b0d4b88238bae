"""Bounds on what one request may cost the server (issue 35, items 1-6 of its probes): the
Responses store's size in bytes, the text a prompt may have before it is tokenized and how many
tokenizations run at once, back-pressure from a client that does not read its stream, parsing
and serialization off the event loop, grammars that cannot be compiled or enforced, and
truncation in one pass. Each test is bounded in time and memory, and each was seen to fail with
its bound taken away."""
from __future__ import annotations

import base64
import json
import os
import time

import pytest

from server.app import ServerSettings, create_app
from server_fakes import (FakeEngine, ThreadedServer, assert_error, http_request, http_response,
                          post_json)

pytestmark = pytest.mark.timeout(120)


def serve(settings: ServerSettings, engine=None) -> ThreadedServer:
    server = ThreadedServer(create_app(engine or FakeEngine(), settings))
    server.engine = server.app.taper.engine
    return server


# ---- 1. the Responses store holds a bounded number of bytes

def big_tools(num_bytes: int) -> list[dict]:
    """A tool whose description does not compress (the store keeps entries compressed)."""
    text = base64.b64encode(os.urandom(num_bytes * 3 // 4)).decode()
    return [{"type": "function", "name": "lookup", "description": text,
             "parameters": {"type": "object", "properties": {}}}]


def held_bytes(store) -> int:
    """What the store holds, weighed here rather than by its own count."""
    return sum(len(blob) for blob in store._items.values())


def test_responses_store_is_bounded_in_bytes_unrendered_tools_included():
    limit = 3 * 2**20
    server = serve(ServerSettings(["fake-model"], responses_store_bytes=limit))
    try:
        ids = []
        for i in range(8):       # tool_choice none: the tools are never rendered, yet echoed
            status, body = post_json(server.port, "/v1/responses", {
                "model": "fake-model", "input": f"n{i}", "max_output_tokens": 1,
                "tools": big_tools(2**20), "tool_choice": "none"})
            assert status == 200, body
            assert len(body["tools"][0]["description"]) == 2**20
            ids.append(body["id"])
        store = server.app.taper_responses
        assert held_bytes(store) <= limit
        assert store.num_bytes <= limit
        assert store.ids() == ids[-len(store):] and len(store) >= 2     # the newest are kept
        assert http_request(server.port, "GET", f"/v1/responses/{ids[0]}")[0] == 404
        assert http_request(server.port, "GET", f"/v1/responses/{ids[-1]}")[0] == 200
        # one response larger than the whole store is not kept, and evicts nothing
        kept = store.ids()
        status, body = post_json(server.port, "/v1/responses", {
            "model": "fake-model", "input": "big", "max_output_tokens": 1,
            "tools": big_tools(4 * 2**20), "tool_choice": "none"})
        assert status == 200 and body["store"] is True
        assert store.ids() == kept
        assert http_request(server.port, "GET", f"/v1/responses/{body['id']}")[0] == 404
    finally:
        server.close()


# ---- a real engine on the demo checkpoint, in this process

@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


@pytest.fixture(scope="module")
def demo_engine(demo_dir):
    from engine import AsyncEngine, EngineConfig
    engine = AsyncEngine(EngineConfig(model=demo_dir, backend="cpu", num_kv_blocks=256,
                                      block_size=16, max_model_len=1024))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def demo(demo_engine):
    server = serve(ServerSettings(["demo"]), demo_engine)
    yield server
    server.close()


# ---- 5. grammars over the library's limits: 400s, never unconstrained text

HUGE_REGEX = "(x{1000}){1000}"        # one string, a million x long: the lexer gives up
# an object that must hold an object like itself: no finite instance
SELF_REF = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}


def chat_body(**extra) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8, **extra}


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": HUGE_REGEX}, "guided_regex"),
    ({"structured_outputs": {"regex": HUGE_REGEX}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r",
                                                                  "schema": SELF_REF}}},
     "response_format.json_schema.schema"),
    ({"guided_json": json.dumps(SELF_REF)}, "guided_json"),
    ({"guided_json": "[" * 100_000}, "guided_json"),       # too deep for json.loads
])
def test_grammars_over_the_limits_are_400s_every_time(demo, extra, param):
    for _ in range(2):           # the second is refused again (from the cache), never run free
        t0 = time.monotonic()
        status, body = post_json(demo.port, "/v1/chat/completions", chat_body(**extra))
        assert_error(status, body, 400, param, "invalid_value")
        assert time.monotonic() - t0 < 10


def test_a_grammar_failing_while_generating_fails_its_request(demo):
    """`(a|b)` passes compiling; the limit is met with the first token. The request is a 400
    naming the parameter, not an empty answer with finish_reason stop (what a failed matcher's
    EOS-only mask gave)."""
    regex = "(a|b)" + HUGE_REGEX
    for _ in range(2):
        status, body = post_json(demo.port, "/v1/chat/completions",
                                 chat_body(guided_regex=regex, temperature=1.0))
        assert_error(status, body, 400, "guided_regex", "invalid_value")
        assert "the grammar failed after" in body["error"]["message"]
    # a grammar within the limits still runs, beside it
    status, body = post_json(demo.port, "/v1/chat/completions",
                             chat_body(guided_regex="(a|b)x{5}"))
    assert status == 200 and body["choices"][0]["message"]["content"] in ("axxxxx", "bxxxxx")


def test_grammar_compiles_are_bounded_and_free_their_threads(demo_engine):
    """Slow grammars end (refused) within the library's limits, so the two compile threads are
    free again for the next request, however many came before."""
    from engine.sampling.structured_outputs import StructuredOutputsParams
    compiler = demo_engine.structured_outputs().compiler
    t0 = time.monotonic()
    slow = [compiler.submit(StructuredOutputsParams("regex", f"({c}{{1000}}){{1000}}"))
            for c in "pqrs"]
    quick = compiler.submit(StructuredOutputsParams("regex", "[0-9]{3}"))
    quick.result(timeout=60)
    for f in slow:
        with pytest.raises(ValueError, match="too complex"):
            f.result(timeout=60)
    assert time.monotonic() - t0 < 30


# ---- 3. a client that does not read pauses its request, then loses it

@pytest.fixture(scope="module")
def paced_engine(demo_dir):
    """The demo engine with a small stream buffer and a short stall timeout."""
    from engine import AsyncEngine, EngineConfig
    engine = AsyncEngine(EngineConfig(model=demo_dir, backend="cpu", num_kv_blocks=1024,
                                      block_size=16, max_model_len=4096),
                         stream_buffer=4, stall_timeout=2.0)
    yield engine
    engine.shutdown()


def output_tokens(engine, request_id: str) -> list[int]:
    """Tokens generated so far by each live choice of the request (read from this thread)."""
    request = engine.engine.requests.get(request_id)
    return [] if request is None else [s.num_output_tokens for s in list(request.seqs)]


def test_a_reader_that_stops_pauses_its_request(paced_engine):
    import asyncio
    from engine import SamplingParams
    engine = paced_engine
    params = SamplingParams(max_tokens=600, ignore_eos=True, temperature=0, n=2)

    async def run():
        stream = engine.add_request("slow", list(range(3, 40)), params)
        await anext(stream)
        await asyncio.sleep(0.8)                  # not reading: the engine must stop soon
        held = output_tokens(engine, "slow")
        forwards = engine.engine.runner.num_forward_tokens
        await asyncio.sleep(0.5)
        assert output_tokens(engine, "slow") == held       # paused: not one more token
        assert engine.engine.runner.num_forward_tokens == forwards   # the engine idles
        outs = [out async for out in stream]      # reading again resumes it to the end
        return held, outs

    held, outs = asyncio.run(run())
    # 2 choices x 4 buffered, and the steps already on their way when the pause arrived
    assert len(held) == 2 and max(held) <= 4 + 4, held
    ends = [o for o in outs if o.finished]
    assert sorted(o.index for o in ends) == [0, 1]
    assert all(o.finish_reason == "length" and o.num_output_tokens == 600 for o in ends)


def test_a_reader_stalled_past_the_timeout_loses_its_request(paced_engine):
    import asyncio
    from engine import SamplingParams
    from engine.async_engine import StreamStalled
    engine = paced_engine
    free = engine.engine.block_pool.num_free_blocks

    async def run():
        stream = engine.add_request("stalled", list(range(3, 40)),
                                    SamplingParams(max_tokens=600, ignore_eos=True))
        await anext(stream)
        await asyncio.sleep(3.0)                  # past the 2 s stall timeout
        assert "stalled" not in engine.engine.requests      # aborted, blocks freed
        assert engine.engine.block_pool.num_free_blocks == free
        with pytest.raises(StreamStalled, match="read nothing for 2 s"):
            await anext(stream)

    asyncio.run(run())
    assert not engine._streams


def test_an_sse_client_that_does_not_read_holds_the_engine_back(paced_engine):
    """Through Hypercorn: a client that stops reading fills its socket, the stream's writer
    waits, and the engine pauses the request well short of its end; gone, it is aborted."""
    import socket
    server = serve(ServerSettings(["demo"]), paced_engine)
    try:
        body = json.dumps({"model": "demo", "prompt": "Hi", "max_tokens": 3000, "n": 4,
                           "logprobs": 20, "ignore_eos": True, "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while True:                           # until the request stops moving
            engine_ids = list(paced_engine.engine.requests)
            before = [output_tokens(paced_engine, i) for i in engine_ids]
            time.sleep(1.0)
            after = [output_tokens(paced_engine, i) for i in engine_ids]
            if engine_ids and before == after:
                break
            assert time.monotonic() < deadline, "the request never paused"
        [tokens] = after
        assert len(tokens) == 4 and max(tokens) < 3000, tokens
        assert paced_engine.engine.requests[engine_ids[0]].paused
        sock.close()                          # gone: aborted at once
        deadline = time.monotonic() + 10
        while paced_engine.engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        server.close()


def test_a_slow_reader_is_not_a_stalled_one(paced_engine):
    """Reading one output a second, slower than the engine and than the 2 s timeout needs to
    drain half the buffer: paused and resumed, never aborted."""
    import asyncio
    from engine import SamplingParams
    engine = paced_engine

    async def run():
        stream = engine.add_request("slow-reader", list(range(3, 40)),
                                    SamplingParams(max_tokens=12, ignore_eos=True, n=2))
        outs = []
        async for out in stream:
            outs.append(out)
            await asyncio.sleep(0.35)   # 8 buffered: 4 reads (1.4 s) to resume; 2 s timeout
        return outs

    outs = asyncio.run(run())
    ends = [o for o in outs if o.finished]
    assert len(ends) == 2 and all(o.finish_reason == "length" for o in ends)


# ---- 6. truncation "auto" in one pass

def conversation(num_turns: int) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}: " + "word " * (i % 9)}
            for i in range(num_turns)] + [{"role": "user", "content": "and now?"}]


def test_truncation_auto_keeps_the_longest_fitting_tail_in_one_pass(demo, demo_engine):
    turns = conversation(2000)
    body = {"model": "demo", "input": turns, "instructions": "Be brief.",
            "max_output_tokens": 16, "truncation": "auto", "store": False}
    t0 = time.monotonic()
    status, _, payload = http_response(demo.port, "POST", "/v1/responses", body, timeout=15)
    elapsed = time.monotonic() - t0
    assert status == 200, payload
    assert elapsed < 5, elapsed              # rendering once per dropped turn: minutes
    usage = json.loads(payload)["usage"]
    # the longest tail that fits, found here from the end (starting at a user turn)
    tok, budget = demo_engine.tokenizer, demo_engine.max_model_len - 16
    system = [{"role": "system", "content": "Be brief."}]
    k = len(turns) - 1
    while True:
        longer = next(j for j in range(k - 1, -1, -1) if turns[j]["role"] == "user")
        if len(tok.encode_chat(system + turns[longer:])) > budget:
            break
        k = longer
    assert usage["input_tokens"] == len(tok.encode_chat(system + turns[k:]))
    assert 1 < k < len(turns) - 1


def test_truncation_auto_refuses_when_the_last_turn_alone_is_too_long(demo):
    turns = conversation(30)
    turns[-1]["content"] = "word " * 5000           # more tokens than the context
    body = {"model": "demo", "input": turns, "truncation": "auto"}
    status, body = post_json(demo.port, "/v1/responses", body)
    assert_error(status, body, 400, "input", "context_length_exceeded")


# ---- 2. text longer than the context can hold is refused before tokenizing; tokenizing is
# bounded in concurrency

class CountingEncode:
    """Wraps the demo tokenizer's transformers encode: calls, and the most at once."""

    def __init__(self, tok, delay: float = 0.0):
        import threading
        self.tok, self.original, self.delay = tok, tok.hf.encode, delay
        self.calls = self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay)
            return self.original(*args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1

    def __enter__(self):
        self.tok.hf.encode = self
        return self

    def __exit__(self, *exc):
        del self.tok.hf.encode          # the class's method again


def test_text_longer_than_the_context_can_hold_is_not_tokenized(demo, demo_engine):
    tok = demo_engine.tokenizer
    limit = tok.max_text_chars(demo_engine.max_model_len)
    assert limit == 13 * 1024        # the demo's longest token: <|endoftext|>, 13 characters
    huge = "word " * 2_000_000       # 10 MB
    with CountingEncode(tok) as encode:
        for path, body, param in [
                ("/v1/completions", {"model": "demo", "prompt": huge}, "prompt"),
                ("/v1/completions", {"model": "demo", "prompt": ["hi", "x" * (limit + 1)]},
                 "prompt"),
                ("/v1/chat/completions", {"model": "demo", "messages": [
                    {"role": "user", "content": huge}]}, "messages"),
                ("/tokenize", {"model": "demo", "prompt": huge}, "prompt"),
                ("/v1/responses", {"model": "demo", "input": huge}, "input")]:
            t0 = time.monotonic()
            status, body = post_json(demo.port, path, body)
            assert_error(status, body, 400, param, "context_length_exceeded")
            assert "characters" in body["error"]["message"]
            assert time.monotonic() - t0 < 3
        assert encode.calls == 0
        # within the bound, the text is tokenized and its tokens counted as before
        status, body = post_json(demo.port, "/v1/completions",
                                 {"model": "demo", "prompt": "x" * limit})
        assert_error(status, body, 400, "prompt", "context_length_exceeded")
        assert "tokens" in body["error"]["message"] and encode.calls == 1


def test_tokenizing_runs_a_few_at_a_time_off_the_event_loop(demo, demo_engine):
    from concurrent.futures import ThreadPoolExecutor
    from server.tokenizing import TOKENIZER_THREADS
    with CountingEncode(demo_engine.tokenizer, delay=0.5) as encode:
        with ThreadPoolExecutor(6) as pool:
            posts = [pool.submit(post_json, demo.port, "/v1/completions",
                                 {"model": "demo", "prompt": f"{i} " * 300, "max_tokens": 1})
                     for i in range(6)]
            time.sleep(0.2)
            t0 = time.monotonic()
            assert http_request(demo.port, "GET", "/health")[0] == 200
            assert time.monotonic() - t0 < 0.3
            assert all(p.result(timeout=60)[0] == 200 for p in posts)
        assert encode.calls == 6 and encode.most == TOKENIZER_THREADS


ADVERSARIAL = ["a" * 5000, " " * 5000, "\n" * 3000, "<|im_start|>" * 200, "<s></s>" * 300,
               "e\u0301" * 1000, "\u1100\u1161\u11a8" * 500, "😀" * 800, "你好世界" * 500,
               "hello world " * 400, "STOP" * 800, "\u0000\u0007" * 400, "ﷺ" * 300]


def test_the_character_bound_holds_for_tokenizers_that_keep_text(tmp_path):
    """A text never has more characters than its tokens times max_chars_per_token, on
    byte-level BPE (with an NFC normalizer too) and SentencePiece-style BPE, whatever the text."""
    from tokenizers import normalizers
    from tiny_tokenizers import build_byte_level, build_metaspace, build_sentencepiece
    toks = {"byte_level": build_byte_level(tmp_path / "bl"),
            "sentencepiece": build_sentencepiece(tmp_path / "sp"),
            "metaspace": build_metaspace(tmp_path / "ms")}
    nfc = build_byte_level(tmp_path / "nfc")
    nfc._rust.normalizer = normalizers.NFC()
    nfc._max_chars_per_token = False
    toks["byte_level_nfc"] = nfc
    for name, tok in toks.items():
        per_token = tok.max_chars_per_token
        assert per_token is not None, name
        for text in ADVERSARIAL:
            assert len(tok.encode(text, add_special_tokens=False)) * per_token >= len(text), (
                name, text[:20])
    assert toks["byte_level_nfc"].max_chars_per_token == 4 * toks["byte_level"].max_chars_per_token


def test_no_character_bound_for_tokenizers_that_drop_text():
    """WordPiece makes one [UNK] of a word of any length, BERT's normalizer drops accents and
    controls, Whitespace drops spaces: texts of any length may be a few tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from engine.text.char_bound import max_chars_per_token
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(wordpiece.encode("b" * 5000).ids) == 1
    assert max_chars_per_token(wordpiece) is None
    bpe = Tokenizer(models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]", fuse_unk=True))
    assert len(bpe.encode("b" * 5000).ids) == 1
    assert max_chars_per_token(bpe) is None
    for normalizer in (normalizers.BertNormalizer(), normalizers.Strip(),
                       normalizers.Replace(" ", "")):
        kept = Tokenizer(models.BPE({"a": 0, " ": 1}, [], byte_fallback=True))
        kept.normalizer = normalizer
        assert max_chars_per_token(kept) is None
    spaced = Tokenizer(models.BPE({"a": 0}, [], byte_fallback=True))
    spaced.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert len(spaced.encode(" " * 5000).ids) == 0
    assert max_chars_per_token(spaced) is None


# ---- 4. large bodies parsed and large responses written off the event loop

def worst_health_latency(port: int, work) -> tuple[float, object]:
    """Runs work() while polling /health; (the longest wait for an answer, work's result).
    The server runs in this process: a stall that holds the GIL stops the poller too, so the
    wait is measured from one answer to the next, not from when a request was sent."""
    import threading
    done, worst = threading.Event(), [0.0]

    def poll():
        last = time.monotonic()
        while not done.is_set():
            assert http_request(port, "GET", "/health")[0] == 200
            now = time.monotonic()
            worst[0] = max(worst[0], now - last)
            time.sleep(0.01)
            last = time.monotonic()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    return worst[0], result


def post_raw(port: int, path: str, raw: bytes) -> tuple[int, bytes]:
    """POST a body serialized beforehand: the server runs in this process, and json's C code
    here would hold the GIL against it."""
    status, _, payload = http_request(port, "POST", path, raw=raw)
    return status, payload


def test_a_huge_logit_bias_does_not_stall_the_server(demo):
    raw = json.dumps({"model": "demo", "prompt": "Hi", "max_tokens": 1,
                      "logit_bias": {str(i): 1.0 for i in range(1_000_000)}}).encode()   # 15 MB
    worst, (status, payload) = worst_health_latency(
        demo.port, lambda: post_raw(demo.port, "/v1/completions", raw))
    body = json.loads(payload)
    assert_error(status, body, 400, "logit_bias", "invalid_value")
    assert "more than this model has tokens" in body["error"]["message"]
    assert worst < 0.3, worst             # parsed on the event loop: a second


def test_a_huge_response_is_written_off_the_event_loop():
    """A stored response echoing 200,000 tool properties (each a small object): parsed, stored
    and written back without holding /health up."""
    server = serve(ServerSettings(["fake-model"]))
    try:
        tools = [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d"}
                                             for i in range(200_000)}}}]
        raw = json.dumps({"model": "fake-model", "input": "Hi", "tools": tools,
                          "tool_choice": "none", "max_output_tokens": 2}).encode()
        worst, (status, payload) = worst_health_latency(
            server.port, lambda: post_raw(server.port, "/v1/responses", raw))
        assert status == 200 and worst < 0.3, worst
        body = json.loads(payload)
        assert body["tools"][0]["parameters"] == tools[0]["parameters"]
        worst, (status, _, payload) = worst_health_latency(server.port, lambda: http_request(
            server.port, "GET", f"/v1/responses/{body['id']}"))
        assert status == 200 and worst < 0.3, worst
        assert json.loads(payload) == body
    finally:
        server.close()

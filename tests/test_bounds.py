"""Bounds on what one request may cost the server (issue 35, items 1-6 of its probes): the
Responses store's size in bytes, the text a prompt may have before it is tokenized and how many
tokenizations run at once, back-pressure from a client that does not read its stream, parsing
and serialization off the event loop, grammars that cannot be compiled or enforced, and
truncation in one pass. Each test is bounded in time and memory, and each was seen to fail with
its bound taken away."""
from __future__ import annotations

import json
import time

import pytest

from server.app import ServerSettings, create_app
from server_fakes import FakeEngine, ThreadedServer, assert_error, http_request, post_json

pytestmark = pytest.mark.timeout(120)


def serve(settings: ServerSettings, engine=None) -> ThreadedServer:
    server = ThreadedServer(create_app(engine or FakeEngine(), settings))
    server.engine = server.app.taper.engine
    return server


# ---- 1. the Responses store holds a bounded number of bytes

def big_tools(num_bytes: int) -> list[dict]:
    return [{"type": "function", "name": "lookup", "description": "x" * num_bytes,
             "parameters": {"type": "object", "properties": {}}}]


def stored_json_bytes(store) -> int:
    """What the store holds, weighed here rather than by its own count."""
    return sum(len(json.dumps([e.response, e.input_items, e.conversation]).encode())
               for e in (store.get(i) for i in store.ids()))


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
        assert stored_json_bytes(store) <= limit
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

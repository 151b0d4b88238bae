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

"""Bounds on what one request may cost the server (issue 35, items 1-6 of its probes): the
Responses store's size in bytes, the text a prompt may have before it is tokenized and how many
tokenizations run at once, back-pressure from a client that does not read its stream, parsing
and serialization off the event loop, grammars that cannot be compiled or enforced, and
truncation in one pass. Each test is bounded in time and memory, and each was seen to fail with
its bound taken away."""
from __future__ import annotations

import json

import pytest

from server.app import ServerSettings, create_app
from server_fakes import FakeEngine, ThreadedServer, http_request, post_json

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

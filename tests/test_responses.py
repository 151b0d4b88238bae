"""The Responses API (/v1/responses) against a scripted fake engine behind the real app on a real
Hypercorn: the Response object and every streamed event valid against OpenAI's schemas
(tests/data/openai_responses_schemas.json, from the official OpenAPI spec), the official SDK's
`responses.create` and `responses.stream` (whose accumulator checks the event order),
previous_response_id, the bounded store, reasoning items, 400s and 404s, and aborts.
(tests/test_responses_live.py runs a real `python -m server`.)
"""
from __future__ import annotations

import copy
import json
import socket
import time

import jsonschema
import openai
import pytest

from server.app import ServerSettings, create_app
from server_fakes import (ROOT, FakeEngine, FakeTokenizer, ThreadedServer,
                          aborted_after_disconnect, assert_error, client_for, fake_text,
                          http_request, post_json,
                          reset_fake,  # noqa: F401 (autouse fixture)
                          serve_fake)

pytestmark = pytest.mark.timeout(300)

SCHEMAS = json.loads((ROOT / "tests" / "data" / "openai_responses_schemas.json").read_text())[
    "$defs"]
# each stream event's own schema, by its `type` (ResponseStreamEvent is their union)
EVENT_SCHEMAS = {SCHEMAS[name]["properties"]["type"]["enum"][0]: name
                 for name in (r["$ref"].rsplit("/", 1)[-1]
                              for r in SCHEMAS["ResponseStreamEvent"]["anyOf"])}


def validate(obj, schema_name: str):
    schema = {"$ref": f"#/$defs/{schema_name}", "$defs": SCHEMAS}
    jsonschema.Draft202012Validator(schema).validate(obj)


def validate_event(ev: dict):
    validate(ev, EVENT_SCHEMAS[ev["type"]])     # names the failing field
    validate(ev, "ResponseStreamEvent")


def post_events(port: int, body: dict) -> list[dict]:
    """The events of a streamed response, read off the wire: `event: TYPE` then `data: {...}`
    per event, as OpenAI sends them."""
    status, ctype, payload = http_request(port, "POST", "/v1/responses", {**body, "stream": True})
    assert status == 200, payload
    assert ctype.startswith("text/event-stream")
    events = []
    for frame in payload.decode().split("\n\n"):
        if not frame:
            continue
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), frame
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == kind[7:]
    return events


class ThinkingEngine(FakeEngine):
    """A reasoning model: <think>...</think> then the answer."""
    WORDS = ["<think>", "\nLet", " me", " think", ".\n", "</think>", "\n\n", "Hi", " you", "!"]


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake(ServerSettings(["fake-model"], responses_store_size=50))


REQ = {"model": "fake-model", "input": "Hi", "max_output_tokens": 6}


def test_non_streamed_response(fake):
    status, body = post_json(fake.port, "/v1/responses",
                             {**REQ, "instructions": "Be brief.", "metadata": {"k": "v"},
                              "user": "u1", "temperature": 0.5})
    assert status == 200, body
    validate(body, "Response")
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert (body["status"], body["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    [message] = body["output"]
    assert message["id"].startswith("msg_")
    assert {k: message[k] for k in ("type", "role", "status")} == {
        "type": "message", "role": "assistant", "status": "incomplete"}
    assert message["content"] == [{"type": "output_text", "text": fake_text(6),
                                   "annotations": [], "logprobs": []}]
    # the echoed request
    assert (body["instructions"], body["metadata"], body["user"], body["temperature"],
            body["max_output_tokens"], body["store"], body["previous_response_id"]) == (
        "Be brief.", {"k": "v"}, "u1", 0.5, 6, True, None)
    # the instructions are a system message before the input
    prompt = FakeTokenizer().encode_chat([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])
    ids, params = fake.engine.requests[body["id"]]
    assert ids == prompt and (params.max_tokens, params.temperature) == (6, 0.5)
    assert body["usage"] == {"input_tokens": len(prompt), "output_tokens": 6,
                             "total_tokens": len(prompt) + 6,
                             "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}


def test_completed_when_the_model_stops(fake):
    status, body = post_json(fake.port, "/v1/responses", {**REQ, "stop": ["friend"]})
    validate(body, "Response")
    assert (body["status"], body["incomplete_details"]) == ("completed", None)
    assert body["completed_at"] >= body["created_at"]
    assert body["output"][0]["content"][0]["text"] == "Hello there, "


def test_streamed_events_in_order(fake):
    events = post_events(fake.port, REQ)
    for ev in events:
        validate_event(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    types = [ev["type"] for ev in events]
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * 6
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.incomplete"])
    assert events[0]["response"]["status"] == events[1]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    deltas = [ev["delta"] for ev in events if ev["type"] == "response.output_text.delta"]
    assert "".join(deltas) == fake_text(6) == events[-4]["text"]
    item_id = events[2]["item"]["id"]
    assert all(ev["item_id"] == item_id for ev in events[3:-2])
    final = events[-1]["response"]
    assert final["output"] == [events[-2]["item"]] and final["usage"]["output_tokens"] == 6
    ids = {ev["response"]["id"] for ev in events if "response" in ev}
    assert len(ids) == 1


def test_sdk_create_and_stream(fake):
    client = client_for(fake.port)
    args = dict(model="fake-model", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}]}], max_output_tokens=9,
        extra_body={"stop": ["friend"]})
    whole = client.responses.create(**args)
    assert whole.output_text == "Hello there, " and whole.status == "completed"
    events = list(client.responses.create(**args, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text and events[-1].type == "response.completed"
    with client.responses.stream(**args) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 4     # " friend" counts


def test_previous_response_id_continues_the_conversation(fake):
    client = client_for(fake.port)
    first = client.responses.create(model="fake-model", input="Hi", max_output_tokens=4,
                                    instructions="Be brief.")
    second = client.responses.create(model="fake-model", input="And?", max_output_tokens=2,
                                     previous_response_id=first.id, instructions="Be kind.")
    # the earlier turn and its answer come first; the earlier instructions do not carry over
    want = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": fake_text(4)}, {"role": "user", "content": "And?"}]
    assert fake.engine.requests[second.id][0] == FakeTokenizer().encode_chat(want)
    assert second.previous_response_id == first.id
    third = client.responses.create(model="fake-model", max_output_tokens=1,
                                    previous_response_id=second.id,
                                    input=[{"type": "message", "role": "developer",
                                            "content": "Now stop."}])
    want = want[1:] + [{"role": "assistant", "content": fake_text(2)},
                       {"role": "system", "content": "Now stop."}]
    assert fake.engine.requests[third.id][0] == FakeTokenizer().encode_chat(want)
    # an output item sent back as input is an assistant turn
    replay = client.responses.create(model="fake-model", max_output_tokens=1, input=[
        {"role": "user", "content": "Hi"}, first.output[0].model_dump(),
        {"role": "user", "content": "And?"}])
    assert fake.engine.requests[replay.id][0] == FakeTokenizer().encode_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": fake_text(4)},
         {"role": "user", "content": "And?"}])


def test_get_delete_and_input_items(fake):
    client = client_for(fake.port)
    created = client.responses.create(model="fake-model", max_output_tokens=2, input=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"}])
    status, _, payload = http_request(fake.port, "GET", f"/v1/responses/{created.id}")
    got = json.loads(payload)
    validate(got, "Response")
    assert status == 200 and got == created.model_dump(exclude_unset=True)
    assert client.responses.retrieve(created.id).output_text == created.output_text
    status, _, payload = http_request(fake.port, "GET",
                                      f"/v1/responses/{created.id}/input_items?order=asc")
    listing = json.loads(payload)
    validate(listing, "ResponseItemList")
    texts = [item["content"][0]["text"] for item in listing["data"]]
    assert texts == ["one", "two", "three"] and listing["has_more"] is False
    page = client.responses.input_items.list(created.id, limit=2)     # newest first
    assert [i.content[0].text for i in page.data] == ["three", "two"] and page.has_more
    rest = client.responses.input_items.list(created.id, limit=2, after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["one"]
    status, _, payload = http_request(fake.port, "GET",
                                      f"/v1/responses/{created.id}?stream=true")
    assert_error(status, json.loads(payload), 400, "stream", "unsupported_parameter")
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_unknown_ids_are_404(fake):
    for method, path in (("GET", "/v1/responses/resp_nope"),
                         ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        status, _, payload = http_request(fake.port, method, path)
        assert_error(status, json.loads(payload), 404, None, "response_not_found")
    status, body = post_json(fake.port, "/v1/responses",
                             {**REQ, "previous_response_id": "resp_nope"})
    assert_error(status, body, 404, "previous_response_id", "response_not_found")


def test_store_false_is_not_retrievable(fake):
    status, body = post_json(fake.port, "/v1/responses", {**REQ, "store": False})
    assert status == 200 and body["store"] is False
    status, _, payload = http_request(fake.port, "GET", f"/v1/responses/{body['id']}")
    assert_error(status, json.loads(payload), 404, None, "response_not_found")
    status, again = post_json(fake.port, "/v1/responses",
                              {**REQ, "previous_response_id": body["id"]})
    assert_error(status, again, 404, "previous_response_id")


def test_the_store_forgets_the_oldest_first():
    engine = FakeEngine()
    server = ThreadedServer(create_app(engine, ServerSettings(["fake-model"],
                                                              responses_store_size=3)))
    try:
        client = client_for(server.port)
        ids = [client.responses.create(model="fake-model", input=f"n{i}",
                                       max_output_tokens=1).id for i in range(3)]
        client.responses.retrieve(ids[0])          # reading does not make it younger
        ids.append(client.responses.create(model="fake-model", input="n3",
                                           max_output_tokens=1).id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        assert server.app.taper_responses.ids() == ids[1:]
        client.responses.create(model="fake-model", input="n4", max_output_tokens=1,
                                store=False)     # not stored: evicts nothing
        assert server.app.taper_responses.ids() == ids[1:]
        ids.append(client.responses.create(model="fake-model", input="n5",
                                           max_output_tokens=1).id)
        assert server.app.taper_responses.ids() == ids[2:]
    finally:
        server.close()


@pytest.mark.parametrize("extra, param", [
    ({"input": 3}, "input"),
    ({"input": ["x"]}, "input"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "{}"}]},
     "input[0].call_id"),                  # answers no earlier call
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}]},
     "input[0].arguments"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]},
     "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),   # no parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
     "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"reasoning": {"budget": 5}}, "reasoning.budget"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"input": [{"type": "reasoning", "encrypted_content": "gAAAAB-openai"},
                {"role": "user", "content": "x"}]}, "input[0].encrypted_content"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "stream"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9/mcp"}]},
     "tools[0].server_url"),                                         # not allowed
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].server_url"),
    ({"tools": [{"type": "mcp", "server_url": "http://h/mcp"}]}, "tools[0].server_label"),
    ({"tools": [{"type": "mcp", "server_label": "x", "connector_id": "connector_gmail"}]},
     "tools[0].connector_id"),
    ({"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_1",
                 "approve": True}]}, "input[0].approval_request_id"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"model": "other"}, "model"),
])
def test_bad_requests_are_400_naming_the_param(fake, extra, param):
    status, body = post_json(fake.port, "/v1/responses", {**REQ, **extra})
    assert_error(status, body, 404 if param == "model" else 400, param)


def test_fields_that_cannot_change_the_output_are_accepted(fake):
    status, body = post_json(fake.port, "/v1/responses", {
        **REQ, "truncation": "disabled", "parallel_tool_calls": False, "tool_choice": "none",
        "tools": [], "text": {"format": {"type": "text"}}, "reasoning": {"effort": None},
        "service_tier": "auto", "prompt_cache_key": "k", "store": None, "stream": None})
    assert status == 200, body
    validate(body, "Response")
    assert (body["parallel_tool_calls"], body["tool_choice"], body["store"]) == (
        False, "none", True)


def test_context_length_names_the_responses_fields(fake):
    status, body = post_json(fake.port, "/v1/responses", {**REQ, "input": "x" * 300})
    assert_error(status, body, 400, "input", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/responses", {**REQ, "max_output_tokens": 250})
    assert_error(status, body, 400, "max_output_tokens", "context_length_exceeded")
    # truncation "auto" cannot drop the only turn
    status, body = post_json(fake.port, "/v1/responses",
                             {**REQ, "input": "x" * 300, "truncation": "auto"})
    assert_error(status, body, 400, "input", "context_length_exceeded")


def test_truncation_auto_drops_the_oldest_turns(fake):
    """The fake's context is 256 tokens (one per byte of `<role>content`): the whole
    conversation has 368, without its first two turns 211."""
    turns = [{"role": "user", "content": "u" * 70}, {"role": "assistant", "content": "a" * 70},
             {"role": "user", "content": "v" * 70}, {"role": "assistant", "content": "b" * 70},
             {"role": "user", "content": "w" * 20}]
    args = {**REQ, "input": turns, "instructions": "Be brief.", "max_output_tokens": 10}
    status, body = post_json(fake.port, "/v1/responses", args)
    assert_error(status, body, 400, "input", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/responses", {**args, "truncation": "auto"})
    assert status == 200 and body["truncation"] == "auto", body
    # the oldest user turn goes, then the assistant turn that would open the conversation
    system = [{"role": "system", "content": "Be brief."}]
    want = FakeTokenizer().encode_chat(system + turns[2:])
    assert fake.engine.requests[body["id"]][0] == want
    assert len(FakeTokenizer().encode_chat(system + turns[1:])) + 10 > 256 >= len(want) + 10


def test_engine_failure_before_and_during_the_stream(fake):
    fake.engine.fail_with = "kernel exploded"
    status, body = post_json(fake.port, "/v1/responses", REQ)
    assert_error(status, body, 500, None, "engine_error")
    status, _, payload = http_request(fake.port, "POST", "/v1/responses", {**REQ, "stream": True})
    assert status == 500                  # nothing was sent yet: a plain error status
    # fails after the first output: the stream ends with response.failed
    fake.engine.fail_with = None
    original = fake.engine._outputs

    async def fail_later(request_id, prompt, params):
        async for out in original(request_id, prompt, params):
            yield out
            fake.engine.fail_with = "kernel exploded"
    fake.engine._outputs = fail_later
    try:
        events = post_events(fake.port, REQ)
    finally:
        del fake.engine._outputs
    for ev in events:
        validate_event(ev)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert "kernel exploded" in events[-1]["response"]["error"]["message"]


def test_client_disconnect_aborts_the_request(fake):
    fake.engine.delay = 0.02
    sock = socket.create_connection(("127.0.0.1", fake.port))
    body = json.dumps({**REQ, "max_output_tokens": 200, "stream": True}).encode()
    sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while received.count(b"response.output_text.delta") < 6:     # event: + data: per delta
        received += sock.recv(65536)
    sock.close()
    response_id = json.loads(received.split(b"data: ")[1].split(b"\n\n")[0])["response"]["id"]
    deadline = time.time() + 10
    while response_id not in fake.engine.aborted:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.02)
    # never finished: not stored
    status, _, _ = http_request(fake.port, "GET", f"/v1/responses/{response_id}")
    assert status == 404


def test_reasoning_goes_to_a_reasoning_item():
    engine = ThinkingEngine()
    server = ThreadedServer(create_app(engine, ServerSettings(["fake-model"])))
    try:
        args = {**REQ, "max_output_tokens": 20, "stop": ["!"]}
        status, body = post_json(server.port, "/v1/responses", args)
        validate(body, "Response")
        reasoning, message = body["output"]
        assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
        assert message["content"][0]["text"] == "Hi you"
        # "<think>", "Let", " me", " think", ".", "</think>": six tokens of reasoning
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
        assert body["usage"]["output_tokens"] == 10

        events = post_events(server.port, args)
        for ev in events:
            validate_event(ev)
        types = [ev["type"] for ev in events]
        assert types == (["response.created", "response.in_progress",
                          "response.output_item.added", "response.content_part.added"]
                         + ["response.reasoning_text.delta"] * 4
                         + ["response.reasoning_text.done", "response.content_part.done",
                            "response.output_item.done", "response.output_item.added",
                            "response.content_part.added"]
                         + ["response.output_text.delta"] * 2
                         + ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done", "response.completed"])
        assert [ev["output_index"] for ev in events if "output_index" in ev] == [0] * 9 + [1] * 7
        assert events[-1]["response"]["output"] == [events[10]["item"], events[-2]["item"]]

        client = client_for(server.port)
        with client.responses.stream(model="fake-model", input="Hi", max_output_tokens=20,
                                     extra_body={"stop": ["!"]}) as stream:
            final = stream.get_final_response()
        assert final.output_text == "Hi you"
        assert final.output[0].content[0].text == "Let me think."
        # cut inside the reasoning: only a reasoning item, incomplete
        status, body = post_json(server.port, "/v1/responses", {**REQ, "max_output_tokens": 3})
        assert body["status"] == "incomplete"
        assert [(i["type"], i["status"]) for i in body["output"]] == [("reasoning", "incomplete")]
        assert body["output"][0]["content"][0]["text"] == "Let me"
    finally:
        server.close()


def test_the_schemas_can_fail(fake):
    """A real response validates; broken copies do not."""
    _, body = post_json(fake.port, "/v1/responses", REQ)
    validate(body, "Response")
    for breaking in (lambda r: r.pop("output"), lambda r: r.update(status="done"),
                     lambda r: r["output"][0]["content"][0].pop("annotations"),
                     lambda r: r["usage"]["input_tokens_details"].pop("cached_tokens")):
        broken = copy.deepcopy(body)
        breaking(broken)
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, "Response")
    delta = post_events(fake.port, REQ)[4]
    validate_event(delta)
    with pytest.raises(jsonschema.ValidationError):
        validate_event({k: v for k, v in delta.items() if k != "sequence_number"})


def test_a_prompt_that_opens_the_reasoning():
    """DeepSeek-R1's template ends the prompt with <think>: the text starts inside it."""
    class OpenedTokenizer(FakeTokenizer):
        def encode_chat(self, messages, **kwargs):
            return super().encode_chat(messages, **kwargs) + list(b"<think>\n")

    class R1Engine(FakeEngine):
        WORDS = ["Let", " me", " see", "\n", "</think>", "\n\n", "Hi", "!"]

    engine = R1Engine()
    engine.tokenizer = OpenedTokenizer()
    server = ThreadedServer(create_app(engine, ServerSettings(["fake-model"])))
    try:
        status, body = post_json(server.port, "/v1/responses",
                                 {**REQ, "max_output_tokens": 20, "stop": ["!"]})
        validate(body, "Response")
        assert [(i["type"], i["content"][0]["text"]) for i in body["output"]] == [
            ("reasoning", "Let me see"), ("message", "Hi")]
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    finally:
        server.close()
    # the same text after a prompt that does not open it is all answer
    server = ThreadedServer(create_app(R1Engine(), ServerSettings(["fake-model"])))
    try:
        status, body = post_json(server.port, "/v1/responses",
                                 {**REQ, "max_output_tokens": 20, "stop": ["!"]})
        assert [(i["type"], i["content"][0]["text"]) for i in body["output"]] == [
            ("message", "Let me see\n</think>\n\nHi")]
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    finally:
        server.close()


def test_client_disconnect_aborts_a_non_streamed_request(fake):
    [response_id] = aborted_after_disconnect(fake, "/v1/responses",
                                             {**REQ, "max_output_tokens": 200})
    assert response_id.startswith("resp_")
    assert http_request(fake.port, "GET", f"/v1/responses/{response_id}")[0] == 404


def test_reasoning_round_trips_encoded_or_as_text():
    """include reasoning.encrypted_content: the reasoning item carries its text, encoded; sent
    back (by its content, by its encrypted_content alone, or kept by previous_response_id) it
    is the assistant turn's reasoning_content, which templates that show reasoning read."""
    engine = ThinkingEngine()
    server = ThreadedServer(create_app(engine, ServerSettings(["fake-model"])))
    try:
        args = {**REQ, "max_output_tokens": 20, "stop": ["!"]}
        _, plain = post_json(server.port, "/v1/responses", args)
        assert plain["output"][0]["encrypted_content"] is None
        status, body = post_json(server.port, "/v1/responses",
                                 {**args, "include": ["reasoning.encrypted_content"],
                                  "reasoning": {"effort": "low", "summary": "auto"}})
        validate(body, "Response")
        assert body["reasoning"] == {"effort": "low", "summary": "auto"}
        assert engine.tokenizer.last_template_kwargs["reasoning_effort"] == "low"
        reasoning, message = body["output"]
        assert reasoning["summary"] == [] and reasoning["encrypted_content"].startswith("taper.")
        events = post_events(server.port, {**args, "include": ["reasoning.encrypted_content"]})
        done = [ev["item"] for ev in events if ev["type"] == "response.output_item.done"]
        assert done[0]["encrypted_content"] == reasoning["encrypted_content"]

        want = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hi you", "reasoning_content": "Let me think."},
                {"role": "user", "content": "And?"}]
        encoded_only = {**reasoning, "content": []}
        for sent in (reasoning, encoded_only):
            status, again = post_json(server.port, "/v1/responses", {**REQ, "input": [
                {"role": "user", "content": "Hi"}, sent, message,
                {"role": "user", "content": "And?"}]})
            assert status == 200, again
            assert engine.tokenizer.last_messages == want
        post_json(server.port, "/v1/responses", {**REQ, "input": "And?",
                                                 "previous_response_id": body["id"]})
        assert engine.tokenizer.last_messages == want
        # what no template reads is not sent: without reasoning, no reasoning_content
        post_json(server.port, "/v1/responses", {**REQ, "input": [
            {"role": "user", "content": "Hi"}, message, {"role": "user", "content": "And?"}]})
        assert "reasoning_content" not in engine.tokenizer.last_messages[1]
    finally:
        server.close()


def test_reasoning_effort_reaches_the_template():
    from server.responses_protocol import CreateResponseRequest
    req = CreateResponseRequest(model="m", input="x", reasoning={"effort": "none"})
    assert req.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    req = CreateResponseRequest(model="m", input="x", reasoning={"effort": "high"},
                                chat_template_kwargs={"reasoning_effort": "low"})
    assert req.template_kwargs() == {"reasoning_effort": "low"}       # the client's own wins


@pytest.fixture
def slow():
    """A server whose engine takes 20 ms a token and that runs one background response at a
    time."""
    engine = FakeEngine(delay=0.02)
    server = ThreadedServer(create_app(engine, ServerSettings(
        ["fake-model"], responses_max_background=1)))
    yield server, engine
    server.close()


def poll(client, response_id: str, until: set[str], seen: set[str]):
    deadline = time.time() + 30
    while True:
        got = client.responses.retrieve(response_id)
        seen.add(got.status)
        if got.status in until:
            return got
        assert time.time() < deadline, f"still {got.status}"
        time.sleep(0.02)


def test_a_background_response_ending_during_a_lookup_is_found(slow, monkeypatch):
    """The run ends, is stored and leaves the running ones while GET's store lookup waits on
    its thread: the lookup must still find it (CI once answered 404 here)."""
    server, engine = slow
    store = server.app.taper_responses
    lookup = store.get

    def slow_get(response_id):
        entry = lookup(response_id)
        time.sleep(0.5)         # the 5-token run (20 ms a token) ends meanwhile
        return entry
    monkeypatch.setattr(store, "get", slow_get)
    client = client_for(server.port)
    queued = client.responses.create(model="fake-model", input="Hi", background=True,
                                     max_output_tokens=5)
    done = poll(client, queued.id, {"completed", "incomplete"}, set())
    assert done.output_text == fake_text(5)


def test_background_responses_are_polled_and_cancelled(slow):
    server, engine = slow
    client = client_for(server.port)
    args = dict(model="fake-model", input="Hi", background=True)
    raw = client.responses.with_raw_response.create(**args, max_output_tokens=20)
    validate(json.loads(raw.text), "Response")
    queued = raw.parse()
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    seen: set[str] = set()
    done = poll(client, queued.id, {"completed", "incomplete"}, seen)
    assert "in_progress" in seen and done.output_text == fake_text(20)
    status, _, payload = http_request(server.port, "GET", f"/v1/responses/{done.id}")
    validate(json.loads(payload), "Response")
    assert client.responses.cancel(done.id).status == "incomplete"      # it had ended
    assert client.responses.input_items.list(done.id).data[0].content[0].text == "Hi"

    running = client.responses.create(**args, max_output_tokens=200)
    with pytest.raises(openai.RateLimitError):          # --responses-max-background 1
        client.responses.create(**args, max_output_tokens=1)
    poll(client, running.id, {"in_progress"}, set())
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.background
    deadline = time.time() + 10
    while running.id not in engine.aborted:
        assert time.time() < deadline, "the cancelled response's engine request runs on"
        time.sleep(0.02)
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"       # idempotent
    # room again; a failing one is stored as failed
    engine.fail_with = "kernel exploded"
    failed = client.responses.create(**args, max_output_tokens=5)
    got = poll(client, failed.id, {"failed"}, set())
    assert "kernel exploded" in got.error.message
    engine.fail_with = None
    # only background responses can be cancelled
    plain = client.responses.create(model="fake-model", input="Hi", max_output_tokens=1)
    status, _, payload = http_request(server.port, "POST", f"/v1/responses/{plain.id}/cancel")
    assert_error(status, json.loads(payload), 400, None)
    status, _, payload = http_request(server.port, "POST", "/v1/responses/resp_nope/cancel")
    assert_error(status, json.loads(payload), 404, None, "response_not_found")
    # a running one is deleted (and stopped)
    doomed = client.responses.create(**args, max_output_tokens=200)
    client.responses.delete(doomed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(doomed.id)

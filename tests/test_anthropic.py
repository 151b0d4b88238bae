"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK and on the wire, on the scripted engines of the server tests:

- the fake engine (tests/server_fakes.py): a message created and streamed (the SDK's own stream
  accumulator rebuilds the created one), the events in Anthropic's order, stop sequences,
  max_tokens cut to the context, usage and count_tokens against the prompt the engine ran, what
  the chat template is given (system blocks, combined turns, prefill, thinking), auth by
  x-api-key, and every error in Anthropic's shape, parsed by the SDK into its exception classes;
- the token-level scripted engine of tests/test_tool_calls_server.py (markers as special tokens,
  a model that reasons in <think> tags): thinking, text and tool_use blocks streamed and not,
  input_json_delta rebuilding each input, tool_choice reaching the engine as the chat route's
  grammar, and tool_result turns rendered as transformers renders the same conversation written
  by hand in the chat shape.
(tests/test_anthropic_live.py runs a forced call on the real engine.)
"""
from __future__ import annotations

import json
import time

import anthropic
import pytest

from server.app import ServerSettings, create_app
from server.limits import Limits
from server_fakes import ThreadedServer, fake_text, http_response, serve_fake
from server_fakes import reset_fake  # noqa: F401 (an autouse fixture)
from test_responses_tools import ToolEngine
from test_tool_calls_server import scripted_servers
from test_tool_calls_server import tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)

KEY = "sekret"
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake(ServerSettings(["fake-model"], api_key=KEY))


def sdk(port: int, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", max_retries=0, timeout=60,
                               **({"api_key": KEY} | kwargs))


def wire_events(port: int, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed message, as sent."""
    status, head, payload = http_response(port, "POST", "/v1/messages", {**body, "stream": True},
                                          headers={"x-api-key": KEY, **(headers or {})})
    assert status == 200, payload
    assert head["content-type"].startswith("text/event-stream")
    out = []
    for frame in payload.decode().split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), frame
            out.append((name[7:], json.loads(data[6:])))
    return out


def last_request(engine):
    """(prompt ids, sampling params) of the engine's last request."""
    return list(engine.requests.values())[-1]


# ---- the fake engine: text messages

def test_created_and_streamed_messages_agree(fake):
    client = sdk(fake.port)
    args = dict(model="fake-model", max_tokens=6, messages=ASK, system="Be brief.")
    whole = client.messages.create(**args)
    prompt, params = last_request(fake.engine)
    assert params.max_tokens == 6
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == fake_text(6)
    assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
    assert whole.id.startswith("msg_") and whole.model == "fake-model"
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt)
    assert usage.cache_read_input_tokens == 3          # the fake's prefix-cache hit
    assert usage.output_tokens == 6 and usage.cache_creation_input_tokens == 0

    with client.messages.stream(**args) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) == 6 and "".join(texts) == whole.content[0].text
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_the_stream_is_in_anthropics_order(fake):
    events = wire_events(fake.port, {"model": "fake-model", "max_tokens": 4, "messages": ASK})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names == ["message_start", "ping", "content_block_start"] + \
        ["content_block_delta"] * 4 + ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for _, d in events[3:7])
    assert text == fake_text(4)
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:7])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]


def test_a_stop_sequence_ends_the_message(fake):
    client = sdk(fake.port)
    msg = client.messages.create(model="fake-model", max_tokens=8, messages=ASK,
                                 stop_sequences=["nope", "friend"])
    assert last_request(fake.engine)[1].stop == ["nope", "friend"]
    assert msg.content[0].text == "Hello there, "
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "friend")
    with client.messages.stream(model="fake-model", max_tokens=8, messages=ASK,
                                stop_sequences=["friend"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "friend")


def test_max_tokens_beyond_the_context_is_cut_to_the_room_left(fake):
    client = sdk(fake.port)
    msg = client.messages.create(model="fake-model", max_tokens=64000, messages=ASK)
    prompt, params = last_request(fake.engine)
    room = fake.engine.max_model_len - len(prompt)
    assert params.max_tokens == room and msg.usage.output_tokens == room
    assert msg.stop_reason == "model_context_window_exceeded"
    # within the room, max_tokens is the client's and ending there is max_tokens
    msg = client.messages.create(model="fake-model", max_tokens=room - 1, messages=ASK)
    assert last_request(fake.engine)[1].max_tokens == room - 1
    assert msg.stop_reason == "max_tokens"


def test_sampling_fields_reach_the_engine(fake):
    sdk(fake.port).messages.create(model="fake-model", max_tokens=3, messages=ASK,
                                   extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    params = last_request(fake.engine)[1]
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 7)


def test_what_the_chat_template_is_given(fake):
    client = sdk(fake.port)
    tok = fake.engine.tokenizer
    client.messages.create(
        model="fake-model", max_tokens=2000,
        system=[{"type": "text", "text": "Rule one."},
                {"type": "text", "text": "Rule two.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Hi"},
                  {"role": "user", "content": [{"type": "text", "text": "there"}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "They greet.", "signature": "s"},
                      {"type": "text", "text": "Hello!"}]},
                  {"role": "user", "content": "Bye"}],
        thinking={"type": "enabled", "budget_tokens": 1024})
    assert tok.last_messages == [
        {"role": "system", "content": "Rule one.\nRule two."},
        {"role": "user", "content": "Hi\nthere"},     # consecutive turns are one, as Anthropic's
        {"role": "assistant", "content": "Hello!", "reasoning_content": "They greet."},
        {"role": "user", "content": "Bye"}]
    assert tok.last_template_kwargs == {"enable_thinking": True}
    assert last_request(fake.engine)[1].reasoning_budget == 1024   # the engine enforces it
    client.messages.create(model="fake-model", max_tokens=2, messages=ASK,
                           thinking={"type": "disabled"})
    assert tok.last_template_kwargs == {"enable_thinking": False}
    assert last_request(fake.engine)[1].reasoning_budget is None
    client.messages.create(model="fake-model", max_tokens=2, messages=ASK,
                           thinking={"type": "adaptive"})
    assert last_request(fake.engine)[1].reasoning_budget is None   # adaptive has no budget
    client.messages.create(model="fake-model", max_tokens=2, messages=ASK)
    assert tok.last_template_kwargs == {}               # the template's own default

    # a conversation ending with the assistant's text is continued, not answered
    client.messages.create(model="fake-model", max_tokens=2, messages=[
        *ASK, {"role": "assistant", "content": "The answer is"}])
    assert tok.last_template_kwargs == {"continue_final_message": True}
    prompt = bytes(last_request(fake.engine)[0]).decode()
    assert prompt.endswith("<assistant>The answer is")    # no new assistant turn opened


def test_count_tokens_is_the_prompt_a_message_runs(fake):
    client = sdk(fake.port)
    args = dict(model="fake-model", messages=[*ASK, {"role": "assistant", "content": "Yo"},
                                              {"role": "user", "content": "Again"}],
                system="Be brief.")
    count = client.messages.count_tokens(**args)
    client.messages.create(**args, max_tokens=2)
    assert count.input_tokens == len(last_request(fake.engine)[0])
    assert count.input_tokens != client.messages.count_tokens(model="fake-model",
                                                              messages=ASK).input_tokens


def test_the_key_may_come_as_x_api_key_or_bearer(fake):
    assert sdk(fake.port).messages.create(model="fake-model", max_tokens=1, messages=ASK)
    bearer = sdk(fake.port, api_key=None, auth_token=KEY)
    assert bearer.messages.create(model="fake-model", max_tokens=1, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as err:
        sdk(fake.port, api_key="wrong").messages.create(model="fake-model", max_tokens=1,
                                                        messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in err.value.body["error"]["message"]
    status, _, _ = http_response(fake.port, "POST", "/v1/messages/count_tokens",
                                 {"model": "fake-model", "messages": ASK},
                                 headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                          "anthropic-beta": "whatever-2025-01-01"})
    assert status == 200


# ---- errors

def post_error(port: int, body: dict, path: str = "/v1/messages") -> tuple[int, dict]:
    status, _, payload = http_response(port, "POST", path, body, headers={"x-api-key": KEY})
    out = json.loads(payload)
    assert set(out) == {"type", "error"} and out["type"] == "error", out
    assert set(out["error"]) == {"type", "message"}, out
    return status, out["error"]


GOOD = {"model": "fake-model", "max_tokens": 4, "messages": ASK}


@pytest.mark.parametrize("body, says", [
    ({"model": "fake-model", "messages": ASK}, "max_tokens: Field required"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "temperature": 1.5}, "temperature"),
    ({**GOOD, "top_k": -1}, "top_k"),
    ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "messages[0].content[0].type"),
    ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({**GOOD, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, "tool_result"),
    ({**GOOD, "system": [{"type": "image"}]}, "system[0].type"),
    ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 100}},
     "thinking.budget_tokens"),
    ({**GOOD, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "greater than thinking.budget_tokens"),
    ({**GOOD, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({**GOOD, "stop_sequences": [""]}, "stop_sequences"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({**GOOD, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({**GOOD, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({**GOOD, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
     "mcp_servers"),
    ({**GOOD, "output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    # the server's limits (server/limits.py) bound these routes too
    ({**GOOD, "stop_sequences": ["x"] * 17}, "--max-stop-strings"),
    ({**GOOD, "messages": ASK * 2049}, "--max-messages"),
    ({**GOOD, "system": json.loads("[" * 70 + "]" * 70)}, "--max-json-depth"),
])
def test_bad_requests_are_invalid_request_errors(fake, body, says):
    status, error = post_error(fake.port, body)
    assert (status, error["type"]) == (400, "invalid_request_error"), error
    assert says in error["message"], error


def test_errors_are_parsed_by_the_sdk(fake):
    client = sdk(fake.port)
    with pytest.raises(anthropic.BadRequestError) as err:    # the SDK would not send this
        client.post("/v1/messages", cast_to=anthropic.types.Message,
                    body={"model": "fake-model", "messages": ASK})
    assert err.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model="fake-model", max_tokens=2, messages=ASK,
                               extra_body={"temperature": 3})
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nope", max_tokens=2, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
    assert "fake-model" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=ASK)
    status, error = post_error(fake.port, GOOD, "/v1/messages/batches")
    assert (status, error["type"]) == (404, "not_found_error")

    fake.engine.fail_with = "kernel exploded"        # before anything was sent: a status
    with pytest.raises(anthropic.InternalServerError, match="kernel exploded"):
        client.messages.create(**GOOD)


def test_an_error_after_the_stream_started_is_an_error_event(fake):
    fake.engine.delay = 0.05
    seen = []
    with pytest.raises(anthropic.APIStatusError, match="kernel exploded") as err:
        with sdk(fake.port).messages.stream(**{**GOOD, "max_tokens": 50}) as stream:
            for event in stream:
                seen.append(event.type)
                if event.type == "text":
                    fake.engine.fail_with = "kernel exploded"
    assert "text" in seen
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "api_error"


def test_a_client_that_leaves_aborts_its_request(fake):
    fake.engine.delay = 0.05
    before = set(fake.engine.aborted)
    with sdk(fake.port).messages.stream(**{**GOOD, "max_tokens": 200}) as stream:
        for event in stream:
            if event.type == "text":
                break                      # leaving the block closes the connection
    deadline = time.time() + 10
    while not set(fake.engine.aborted) - before:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.02)


def test_loading_and_too_large_are_anthropic_errors():
    server = ThreadedServer(create_app(None, ServerSettings(["m"], limits=Limits(max_body_bytes=2000))))
    try:
        status, error = post_error(server.port, {**GOOD, "model": "m"})
        assert (status, error["type"]) == (503, "overloaded_error")
        assert "loading" in error["message"]
        status, error = post_error(server.port, {**GOOD, "system": "x" * 3000})
        assert (status, error["type"]) == (413, "request_too_large")
        # the OpenAI routes keep OpenAI's shape
        status, _, payload = http_response(server.port, "POST", "/v1/chat/completions", GOOD)
        assert status == 503 and json.loads(payload)["error"]["code"] == "model_loading"
    finally:
        server.close()


# ---- the scripted engine: thinking and tools

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "days": {"type": "integer"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object"}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "Weather in Paris and the time?"}]
SCRIPT = ('<think>They want two things.</think>Let me see.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Pa\\"ris", "days": 2}}\n</tool_call>\n<tool_call>\n'
          '{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.fixture
def serve(tokenizer):  # noqa: F811
    yield from scripted_servers(tokenizer, ToolEngine)


def without_ids(message) -> dict:
    """The message without its id and its tool_use ids (each request's own)."""
    out = message.model_dump(exclude={"id"})
    for block in out["content"]:
        block.pop("id", None)
    return out


def scripted(serve, script: str = SCRIPT):
    _, engine, server = serve("qwen", script)
    return sdk(server.port, api_key="x"), engine, server


def test_thinking_text_and_tool_use_blocks_streamed_or_not(serve):
    client, engine, server = scripted(serve)
    whole = client.messages.create(model="m", max_tokens=200, messages=QUESTION, tools=TOOLS)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole.content[0].thinking == "They want two things."
    assert whole.content[1].text == "Let me see."
    calls = [(b.name, b.input) for b in whole.content[2:]]
    assert calls == [("get_weather", {"city": 'Pa"ris', "days": 2}), ("get_time", {})]
    ids = [b.id for b in whole.content[2:]]
    assert len(set(ids)) == 2 and all(ids)
    assert whole.stop_reason == "tool_use"
    assert 0 < whole.usage.output_tokens_details.thinking_tokens < whole.usage.output_tokens

    with client.messages.stream(model="m", max_tokens=200, messages=QUESTION,
                                tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(whole)

    events = wire_events(server.port, {"model": "m", "max_tokens": 200, "messages": QUESTION,
                                       "tools": TOOLS}, headers={"x-api-key": "x"})
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == \
        [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    assert starts[2]["content_block"]["input"] == {}
    assert starts[2]["content_block"]["name"] == "get_weather"
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    for index, (_, want) in zip((2, 3), calls):      # the input_json_deltas rebuild each input
        pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                  and d["index"] == index]
        assert all(d["delta"]["type"] == "input_json_delta" for n, d in events
                   if n == "content_block_delta" and d["index"] == index)
        assert json.loads("".join(pieces)) == want
    assert len([1 for n, d in events if n == "content_block_delta" and d["index"] == 2]) > 2
    # a block ends before the next starts: the events interleave no two blocks
    order = [d["index"] for n, d in events if n.startswith("content_block")]
    assert order == sorted(order)


def test_display_omitted_keeps_the_thinking_block_without_its_text(serve):
    client, _, _ = scripted(serve)
    msg = client.messages.create(model="m", max_tokens=2000, messages=QUESTION, tools=TOOLS,
                                 thinking={"type": "enabled", "budget_tokens": 1024,
                                           "display": "omitted"})
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == ""
    assert msg.content[1].text == "Let me see."


def test_a_call_cut_by_max_tokens_keeps_its_partial_input(serve, tokenizer):  # noqa: F811
    client, _, server = scripted(serve, '<tool_call>\n{"name": "get_weather", "arguments": '
                                        '{"city": "Paris", "days": 12}}\n</tool_call>')
    cut = len(tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": '
                               '{"city": "Paris", ', add_special_tokens=False))
    args = dict(model="m", max_tokens=cut, messages=QUESTION, tools=TOOLS)
    whole = client.messages.create(**args)
    assert whole.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in whole.content] == \
        [("tool_use", "get_weather", {"city": "Paris"})]
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(whole)
    events = wire_events(server.port, args, headers={"x-api-key": "x"})
    sent = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert sent == '{"city": "Paris", '


def test_an_output_schema_is_the_chat_routes_response_format(serve):
    client, engine, _ = scripted(serve, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    msg = client.messages.create(model="m", max_tokens=50, messages=QUESTION,
                                 extra_body={"output_config": {
                                     "format": {"type": "json_schema", "schema": schema}}})
    so = engine.requests[msg.id][1].structured_outputs
    assert so.kind == "json" and json.loads(so.spec)["properties"] == schema["properties"]
    with pytest.raises(anthropic.BadRequestError, match="output_config.format.schema"):
        client.messages.create(model="m", max_tokens=50, messages=QUESTION,
                               extra_body={"output_config": {"format": {
                                   "type": "json_schema", "schema": {"type": "nope"}}}})


def grammar_of(client, engine, **kwargs):
    msg = client.messages.create(model="m", max_tokens=200, messages=QUESTION, **kwargs)
    so = engine.requests[msg.id][1].structured_outputs
    return so and so.spec


def test_tool_choice_reaches_the_engine_as_the_chat_routes_grammar(serve):
    client, engine, _ = scripted(serve)
    spec = grammar_of(client, engine, tools=TOOLS, tool_choice={"type": "any"})
    assert "start: thought? WS? call+" in spec     # this tokenizer's model reasons first
    spec = grammar_of(client, engine, tools=TOOLS, tool_choice={
        "type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    assert '"get_time"' in spec and '"get_weather"' not in spec and "call+" not in spec
    assert grammar_of(client, engine, tools=TOOLS, tool_choice={"type": "auto"}) is None
    spec = grammar_of(client, engine, tools=[{**WEATHER, "strict": True}, TIME])
    assert spec.startswith("%llguidance {}\nstart: TEXT | BEFORE <[")   # strict: a lazy grammar
    # none: no tools rendered, no grammar, no calls read
    msg = client.messages.create(model="m", max_tokens=200, messages=QUESTION, tools=TOOLS,
                                 tool_choice={"type": "none"})
    assert engine.requests[msg.id][1].structured_outputs is None
    assert [b.type for b in msg.content] == ["thinking", "text"]
    bare = client.messages.create(model="m", max_tokens=200, messages=QUESTION)
    assert engine.requests[msg.id][0] == engine.requests[bare.id][0]

    with pytest.raises(anthropic.BadRequestError, match="not in tools"):
        client.messages.create(model="m", max_tokens=20, messages=QUESTION, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice 'any' needs tools"):
        client.messages.create(model="m", max_tokens=20, messages=QUESTION,
                               tool_choice={"type": "any"})


def chat_tools() -> list[dict]:
    return [{"type": "function", "function": {
        "name": t["name"], **({"description": t["description"]} if "description" in t else {}),
        "parameters": t["input_schema"]}} for t in TOOLS]


def test_a_tool_result_turn_renders_as_the_chat_conversation(serve, tokenizer):  # noqa: F811
    client, engine, _ = scripted(serve)
    first = client.messages.create(model="m", max_tokens=200, messages=QUESTION, tools=TOOLS)
    uses = [b for b in first.content if b.type == "tool_use"]
    turn = [*QUESTION, first.to_param(),
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id,
                 "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sun"}]},
                {"type": "tool_result", "tool_use_id": uses[1].id, "content": "12:30",
                 "is_error": False},
                {"type": "text", "text": "Thanks. Anything else?"}]}]
    # the same conversation, written by hand in the chat shape
    by_hand = [*QUESTION,
               {"role": "assistant", "content": "Let me see.",
                "reasoning_content": "They want two things.",
                "tool_calls": [{"id": b.id, "type": "function",
                                "function": {"name": b.name, "arguments": b.input}}
                               for b in uses]},
               {"role": "tool", "tool_call_id": uses[0].id, "content": "18 C\nsun"},
               {"role": "tool", "tool_call_id": uses[1].id, "content": "12:30"},
               {"role": "user", "content": "Thanks. Anything else?"}]
    want = tokenizer.hf.apply_chat_template(by_hand, tools=chat_tools(),
                                            add_generation_prompt=True, tokenize=False)
    want_ids = tokenizer.encode(want, add_special_tokens=False)
    second = client.messages.create(model="m", max_tokens=200, messages=turn, tools=TOOLS)
    assert engine.requests[second.id][0] == want_ids
    assert client.messages.count_tokens(model="m", messages=turn,
                                        tools=TOOLS).input_tokens == len(want_ids)
    # without the results the prompt differs, so the comparison can fail
    assert client.messages.count_tokens(model="m", messages=turn[:2] + [
        {"role": "user", "content": "Thanks. Anything else?"}], tools=TOOLS).input_tokens \
        != len(want_ids)


def test_a_request_shaped_as_claude_codes(serve):
    """What Claude Code sends: `?beta=true`, beta headers, system blocks with cache_control,
    tools whose schemas carry `$schema`, metadata, a max_tokens far past the context, and
    fields this server has no use for (accepted and ignored)."""
    _, engine, server = scripted(serve)
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    body = {"model": "m", "max_tokens": 32000, "stream": True, "temperature": 1,
            "metadata": {"user_id": "user_abc_session_1"},
            "system": [{"type": "text", "text": "You are a coding agent.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": schema},
                      {**TIME, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Weather in Paris?",
                 "cache_control": {"type": "ephemeral"}}]}],
            "context_management": {"edits": []}, "service_tier": "auto"}
    status, head, payload = http_response(
        server.port, "POST", "/v1/messages?beta=true", body,
        headers={"x-api-key": "x", "anthropic-version": "2023-06-01",
                 "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    assert status == 200, payload
    frames = [f for f in payload.decode().split("\n\n") if f]
    names = [f.split("\n")[0][7:] for f in frames]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                   "message_stop"]
    delta = json.loads(frames[-2].split("\ndata: ")[1])
    assert delta["delta"]["stop_reason"] == "tool_use"
    prompt, params = last_request(engine)
    assert params.max_tokens == engine.max_model_len - len(prompt)

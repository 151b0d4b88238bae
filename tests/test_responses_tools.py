"""Function tools in the Responses API, through the real app and the official `openai` client,
on the token-level scripted engine of tests/test_tool_calls_server.py (a tokenizer whose
markers are special tokens, answers forced into each format):

- a call comes back as a `function_call` output item (call_id, name, arguments), the same calls
  streamed and not, every streamed event valid against its schema from OpenAI's spec, and the
  SDK's own stream accumulator rebuilds exactly the non-streamed output;
- `function_call` and `function_call_output` input items (sent back by the client, or the calls
  of a stored response through previous_response_id) render as the assistant tool calls and tool
  messages that transformers' apply_chat_template renders from the conversation written by hand;
- tool_choice and strict reach the engine as the grammar that enforces them; bad input is a 400
  naming the field.
(tests/test_tool_strict_live.py runs the enforcement on the real engine.)
"""
from __future__ import annotations

import json

import pytest

from server_fakes import assert_error, http_request, post_json
from test_responses import validate, validate_event
from test_tool_calls_server import FORMATS, ScriptedEngine, scripted_servers
from test_tool_calls_server import tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "days": {"type": "integer"}},
                          "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"},
        "strict": False}
TOOLS = [WEATHER, TIME]
ASK = "Weather in Paris and the time?"


class ToolEngine(ScriptedEngine):
    """The scripted engine with the real grammar compiler, so the server can compile the
    grammar that enforces tool_choice (the script is what the engine answers regardless)."""
    _structured = None

    def structured_outputs(self):
        if self._structured is None:
            from engine.sampling.structured_outputs import GrammarCompiler, StructuredOutputs
            tok = self.tokenizer
            self._structured = StructuredOutputs(
                GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id]), tok)
        return self._structured


@pytest.fixture
def serve(tokenizer):  # noqa: F811
    yield from scripted_servers(tokenizer, ToolEngine)


def post_events(port: int, body: dict) -> list[dict]:
    status, _, payload = http_request(port, "POST", "/v1/responses", {**body, "stream": True})
    assert status == 200, payload
    return [json.loads(frame.split("\ndata: ", 1)[1])
            for frame in payload.decode().split("\n\n") if frame]


def calls_of(output) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in output if item.type == "function_call"]


@pytest.mark.parametrize("parser, script, content, calls", FORMATS,
                         ids=[f"{f[0]}-{i}" for i, f in enumerate(FORMATS)])
def test_calls_are_function_call_items_streamed_or_not(serve, parser, script, content, calls):
    client, engine, server = serve(parser, script)
    whole = client.responses.create(model="m", input=ASK, tools=TOOLS)
    assert whole.status == "completed"
    assert calls_of(whole.output) == calls
    assert whole.output_text == (content or "")
    kinds = [item.type for item in whole.output]
    assert kinds == ["message"] * (content is not None) + ["function_call"] * len(calls)
    call_ids = [item.call_id for item in whole.output if item.type == "function_call"]
    assert len(set(call_ids)) == len(call_ids)
    status, body = post_json(server.port, "/v1/responses", {"model": "m", "input": ASK,
                                                            "tools": TOOLS})
    validate(body, "Response")
    assert [t["strict"] for t in body["tools"]] == [True, False]     # the Responses default

    events = post_events(server.port, {"model": "m", "input": ASK, "tools": TOOLS})
    for ev in events:
        validate_event(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    done = [ev for ev in events if ev["type"] == "response.function_call_arguments.done"]
    assert [(ev["name"], ev["arguments"]) for ev in done] == calls
    for ev in done:      # the deltas of an item add up to its arguments
        deltas = [d["delta"] for d in events if d["type"] ==
                  "response.function_call_arguments.delta" and d["item_id"] == ev["item_id"]]
        assert "".join(deltas) == ev["arguments"]
    added = [ev["item"] for ev in events if ev["type"] == "response.output_item.added"
             and ev["item"]["type"] == "function_call"]
    assert [(a["name"], a["arguments"], a["status"]) for a in added] == \
        [(name, "", "in_progress") for name, _ in calls]

    with client.responses.stream(model="m", input=ASK, tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert calls_of(final.output) == calls and final.output_text == whole.output_text


def hand_written_conversation(call_ids: list[str], calls, outputs: list[str]) -> list[dict]:
    """What the client's items mean, as a chat conversation: the calls (arguments as objects,
    which templates expect) in one assistant message, then one tool message per output."""
    return ([{"role": "user", "content": ASK},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": i, "type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                 for i, (n, a) in zip(call_ids, calls)]}]
            + [{"role": "tool", "tool_call_id": i, "content": out}
               for i, out in zip(call_ids, outputs)])


def chat_tools() -> list[dict]:
    return [{"type": "function", "function": {
        **{k: t[k] for k in ("name", "description", "parameters") if k in t},
        "strict": t.get("strict", True)}} for t in TOOLS]


def test_function_call_outputs_render_through_the_template(serve, tokenizer):  # noqa: F811
    parser, script, _, calls = FORMATS[4]                  # qwen, two calls after some text
    client, engine, _ = serve(parser, script)
    first = client.responses.create(model="m", input=ASK, tools=TOOLS)
    items = [item for item in first.output if item.type == "function_call"]
    outputs = ["18 C and sunny", "12:30"]
    results = [{"type": "function_call_output", "call_id": item.call_id, "output": out}
               for item, out in zip(items, outputs)]
    want = tokenizer.hf.apply_chat_template(
        hand_written_conversation([i.call_id for i in items], calls, outputs),
        tools=chat_tools(), add_generation_prompt=True, tokenize=False)
    want_ids = tokenizer.encode(want, add_special_tokens=False)

    # the client sends the calls back with their results
    sent = client.responses.create(model="m", tools=TOOLS, input=[
        {"role": "user", "content": ASK}, *[i.model_dump() for i in items], *results])
    assert engine.requests[sent.id][0] == want_ids
    # or continues the stored response: only the results are new
    cont = client.responses.create(model="m", tools=TOOLS, input=results,
                                   previous_response_id=first.id)
    assert engine.requests[cont.id][0] == want_ids
    # a turn without the calls renders differently, so the comparison can fail
    bare = tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": ASK}], tools=chat_tools(), add_generation_prompt=True,
        tokenize=False)
    assert tokenizer.encode(bare, add_special_tokens=False) != want_ids
    listing = client.responses.input_items.list(cont.id, order="asc")
    assert [(i.type, i.call_id) for i in listing.data] == \
        [("function_call_output", i.call_id) for i in items]
    status, _, payload = http_request(int(client.base_url.port), "GET",
                                      f"/v1/responses/{sent.id}/input_items?order=asc")
    validate(json.loads(payload), "ResponseItemList")


def test_a_replayed_call_whose_arguments_are_not_json_renders_as_sent(serve, tokenizer):  # noqa: F811
    """A function_call cut by max_output_tokens, replayed by an agent with an error output, is
    accepted: its argument text reaches the template as it came."""
    client, engine, _ = serve("qwen", "Retrying.")
    cut = '{"city": "Par'
    sent = client.responses.create(model="m", tools=TOOLS, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": cut},
        {"type": "function_call_output", "call_id": "call_1", "output": "error: not JSON"}])
    assert sent.output_text == "Retrying."
    want = tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": ASK},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": cut}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "error: not JSON"}],
        tools=chat_tools(), add_generation_prompt=True, tokenize=False)
    assert engine.requests[sent.id][0] == tokenizer.encode(want, add_special_tokens=False)


def test_tool_choice_and_strict_reach_the_engine_as_grammars(serve):
    client, engine, _ = serve("qwen", FORMATS[4][1])

    def grammar(**kwargs):
        r = client.responses.create(model="m", input=ASK, **kwargs)
        so = engine.requests[r.id][1].structured_outputs
        return r, so and so.spec
    r, spec = grammar(tools=TOOLS, tool_choice="required")
    assert r.tool_choice == "required" and "<tool_call>" not in (spec or "")  # a special token
    assert "start: thought? WS? call+" in spec      # this tokenizer's model reasons first
    r, spec = grammar(tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                      parallel_tool_calls=False)
    assert '"get_time"' in spec and '"get_weather"' not in spec
    assert r.tool_choice.name == "get_time" and r.parallel_tool_calls is False
    _, spec = grammar(tools=TOOLS)                          # auto: strict by default
    assert spec.startswith("%llguidance {}\nstart: TEXT | BEFORE <[")
    _, spec = grammar(tools=[{**t, "strict": False} for t in TOOLS])
    assert spec is None
    _, spec = grammar(tools=TOOLS, tool_choice="none")
    assert spec is None


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "input": [{"type": "function_call_output", "call_id": "x",
                                 "output": "1"}]}, "input[0].call_id"),
    ({"tools": TOOLS, "input": [{"type": "function_call", "name": "get_time",
                                 "arguments": "{}"}]}, "input[0].call_id"),
    ({"tools": TOOLS, "input": [
        {"type": "function_call", "call_id": "x", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "x", "output": [{"type": "input_image"}]}]},
     "input[1].output[0]"),
])
def test_bad_tool_input_is_a_400_naming_it(serve, body, param):
    _, _, server = serve("qwen", "hi")
    status, out = post_json(server.port, "/v1/responses", {"model": "m", "input": ASK, **body})
    assert_error(status, out, 400, param)


def test_a_strict_schema_the_grammar_cannot_enforce_is_a_400_naming_tools(serve):
    """`not` is a keyword llguidance refuses: under auto the strict tool's grammar fails to
    compile, and the 400 names `tools` (under required, `tool_choice`)."""
    _, _, server = serve("qwen", "hi")
    bad = {**WEATHER, "parameters": {"type": "object", "properties": {
        "city": {"not": {"type": "string"}}}}}
    for choice, param in (("auto", "tools"), ("required", "tool_choice")):
        status, out = post_json(server.port, "/v1/responses", {
            "model": "m", "input": ASK, "tools": [bad], "tool_choice": choice})
        assert_error(status, out, 400, param)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}


def test_text_format_reaches_the_engine_as_chat_response_format_does(serve):
    """text.format json_schema / json_object is the grammar chat's response_format makes; the
    SDK's responses.parse reads the answer into its model (the openai-agents SDK's structured
    output agent goes through it)."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=8)
    client, engine, server = serve("qwen", '{"city": "Oslo"}')
    fmt = {"type": "json_schema", "name": "City", "schema": CITY, "strict": True}
    r = client.responses.create(model="m", input=ASK, text={"format": fmt})
    so = engine.requests[r.id][1].structured_outputs
    assert (so.kind, json.loads(so.spec), so.param) == ("json", CITY, "text.format.schema")
    assert r.text.format.name == "City" and r.text.format.schema_ == CITY
    status, body = post_json(server.port, "/v1/responses", {"model": "m", "input": ASK,
                                                            "text": {"format": fmt}})
    validate(body, "Response")
    parsed = client.responses.parse(model="m", input=ASK, text_format=City)
    assert parsed.output_parsed == City(city="Oslo")
    so = engine.requests[parsed.id][1].structured_outputs
    assert json.loads(so.spec)["properties"]["city"]["maxLength"] == 8
    r = client.responses.create(model="m", input=ASK, text={"format": {"type": "json_object"}})
    assert engine.requests[r.id][1].structured_outputs.kind == "json_object"
    r = client.responses.create(model="m", input=ASK, text={"format": {"type": "text"}})
    assert engine.requests[r.id][1].structured_outputs is None
    # the problems are 400s naming text.format
    bad = {**fmt, "schema": {"type": "object", "properties": {"x": {"not": {}}}}}
    status, out = post_json(server.port, "/v1/responses", {"model": "m", "input": ASK,
                                                           "text": {"format": bad}})
    assert_error(status, out, 400, "text.format.schema")
    status, out = post_json(server.port, "/v1/responses", {
        "model": "m", "input": ASK, "text": {"format": fmt}, "tools": TOOLS,
        "tool_choice": "required"})
    assert_error(status, out, 400, "text.format.schema")


def test_function_call_round_trips_over_many_turns(serve, tokenizer):  # noqa: F811
    """Three rounds of calls and outputs: continued by previous_response_id, or sent whole by
    a store: false client, the prompt is the one the template makes of the conversation."""
    parser, script, _, calls = FORMATS[4]                  # qwen, two calls after some text
    client, engine, _ = serve(parser, script)
    by_id = client.responses.create(model="m", input=ASK, tools=TOOLS)
    whole_input = [{"role": "user", "content": ASK}]
    conversation = [{"role": "user", "content": ASK}]
    sent = client.responses.create(model="m", input=whole_input, tools=TOOLS, store=False)
    for round_ in range(3):
        assert engine.requests[by_id.id][0] == engine.requests[sent.id][0]
        want = tokenizer.hf.apply_chat_template(conversation, tools=chat_tools(),
                                                add_generation_prompt=True, tokenize=False)
        assert engine.requests[by_id.id][0] == tokenizer.encode(want, add_special_tokens=False)
        items = [i for i in sent.output if i.type == "function_call"]
        assert [(i.name, i.arguments) for i in items] == calls
        results = [{"type": "function_call_output", "call_id": i.call_id,
                    "output": f"result {round_}.{k}"} for k, i in enumerate(items)]
        by_id_items = [i for i in by_id.output if i.type == "function_call"]
        by_id = client.responses.create(model="m", tools=TOOLS, previous_response_id=by_id.id,
                                        input=[{**r, "call_id": i.call_id}
                                               for r, i in zip(results, by_id_items)])
        whole_input += [i.model_dump() for i in sent.output] + results
        sent = client.responses.create(model="m", input=whole_input, tools=TOOLS, store=False)
        conversation += [
            {"role": "assistant", "content": "Let me see.", "tool_calls": [
                {"id": i.call_id, "type": "function",
                 "function": {"name": i.name, "arguments": json.loads(i.arguments)}}
                for i in items]},
            *[{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]}
              for r in results]]
    assert len(engine.requests[sent.id][0]) > len(tokenizer.encode(ASK))

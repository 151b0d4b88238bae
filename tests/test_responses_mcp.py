"""Server-side MCP tools in the Responses API, through the official `openai` client, against real
MCP servers written here with the official `mcp` SDK (one over streamable HTTP, allowed by
--mcp-allowed-urls; one over stdio, named in --mcp-config), on the token-level scripted engine
of tests/test_tool_calls_server.py answering one script per model turn:

- the model's call runs on the MCP server with its arguments (valid for the listed schema), the
  result is an `mcp_call` item and reaches the model: the next turn's prompt is exactly what the
  chat template renders of the conversation with the call and its result;
- the stream has the mcp_list_tools and mcp_call items and their events in order, each event
  valid against OpenAI's schema, and the SDK's accumulator rebuilds the response;
- approvals (an mcp_approval_request ends the response; an mcp_approval_response runs or
  declines the call), max_tool_calls and the server's default bound, allowed_tools, a tool's
  error, the replayed items of a store: false conversation;
- a URL outside the allow-list is a 400, a server that cannot be listed a 424.
(tests/test_responses_live.py runs an mcp tool on the real engine.)
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import jsonschema
import pytest

pytest.importorskip("mcp", reason="could not import the mcp SDK (requirements-test.txt pins it)")

from server.app import ServerSettings, create_app  # noqa: E402
from server.mcp_tools import McpServerSpec, McpTools  # noqa: E402
from server_fakes import (ThreadedServer, assert_error, client_for, free_port,  # noqa: E402
                          post_json)
from test_responses import validate, validate_event  # noqa: E402
from test_responses_tools import ToolEngine, post_events  # noqa: E402
from test_tool_calls_server import tokenizer  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.timeout(300)

SERVER = textwrap.dedent('''
    import json, os, sys
    from typing import Annotated
    from pydantic import Field
    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations

    mcp = MCPServer("calc")

    def record(name, **args):
        with open(os.environ["CALLS_FILE"], "a") as f:
            f.write(json.dumps({"tool": name, **args}) + "\\n")

    @mcp.tool()
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> str:
        """Add two integers."""
        record("add", a=a, b=b)
        return f"sum={a + b}"

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
    def lookup(key: str) -> str:
        """Look a key up."""
        record("lookup", key=key)
        return "value of " + key

    @mcp.tool()
    def explode() -> str:
        """Always fails."""
        from mcp.server.mcpserver.exceptions import ToolError
        raise ToolError("the fuse blew")

    # Closed schemas, as strict tools have them: the random demo model (test_responses_live.py)
    # would otherwise add keys of its own to the arguments.
    for tool in mcp._tool_manager._tools.values():
        tool.parameters["additionalProperties"] = False

    if sys.argv[1:] == ["stdio"]:
        mcp.run()
    else:
        import uvicorn
        uvicorn.run(mcp.streamable_http_app(), host="127.0.0.1", port=int(sys.argv[1]),
                    log_level="warning")
''')

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ASK = "Add 2 and 3."


class TurnsEngine(ToolEngine):
    """Answers its scripts one per model turn of a response (turn k's request id ends in -k),
    the last one again after."""
    scripts: list[str] = []

    def add_request(self, request_id, prompt, params):
        turn = int(request_id.rsplit("-", 1)[1]) if "-" in request_id else 0
        self.script = self.scripts[min(turn, len(self.scripts) - 1)]
        return super().add_request(request_id, prompt, params)


@pytest.fixture(scope="module")
def calls_file(tmp_path_factory):
    return tmp_path_factory.mktemp("mcp") / "calls.jsonl"


@pytest.fixture(scope="module")
def server_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp-server") / "calc_server.py"
    path.write_text(SERVER)
    return str(path)


@pytest.fixture(scope="module")
def http_url(server_script, calls_file):
    port = free_port()
    proc = subprocess.Popen([sys.executable, server_script, str(port)],
                            env={**__import__("os").environ, "CALLS_FILE": str(calls_file)})
    deadline = time.time() + 30
    import socket
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline and proc.poll() is None, "MCP server did not start"
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def serve(tokenizer, http_url, server_script, calls_file):  # noqa: F811
    """start(scripts, **settings) -> (client, engine, server): the app on the scripted engine,
    the HTTP server's URL allowed, the stdio server configured as "local"."""
    servers, configs = [], []
    calls_file.write_text("")

    def start(scripts: list[str], config: bool = False, **settings):
        engine = TurnsEngine(tokenizer, "Qwen3ForCausalLM")
        engine.scripts = scripts
        settings.setdefault("mcp_allowed_urls", [http_url])
        app = create_app(engine, ServerSettings(["m"], tool_parser="qwen", **settings))
        server = ThreadedServer(app)
        servers.append(server)
        if config:
            mcp = McpTools([McpServerSpec("local", command=sys.executable,
                                          args=(server_script, "stdio"),
                                          env={"CALLS_FILE": str(calls_file)})],
                           connect_timeout_s=30)
            asyncio.run_coroutine_threadsafe(mcp.start(), server.loop).result(60)
            app.taper.mcp = mcp
            configs.append((server, mcp))
        return client_for(server.port), engine, server
    yield start
    for server, mcp in configs:
        asyncio.run_coroutine_threadsafe(mcp.close(), server.loop).result(60)
    for server in servers:
        server.close()


def calls_made(calls_file) -> list[dict]:
    return [json.loads(line) for line in calls_file.read_text().splitlines()]


def mcp_tool(url, **extra) -> dict:
    return {"type": "mcp", "server_label": "calc", "server_url": url,
            "require_approval": "never", **extra}


def rendered(tokenizer, messages, listing) -> list[int]:  # noqa: F811
    """The prompt the chat template makes of `messages`, with the listed MCP tools offered as
    strict function tools."""
    tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"] or "",
        "parameters": t["input_schema"], "strict": True}} for t in listing["tools"]]
    text = tokenizer.hf.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_call_runs_and_its_result_reaches_the_model(serve, tokenizer, http_url,  # noqa: F811
                                                      calls_file):
    client, engine, server = serve([CALL, "The sum is 5."])
    tool = mcp_tool(http_url)
    r = client.responses.create(model="m", input=ASK, tools=[tool])
    validate(json.loads(client.responses.with_raw_response.retrieve(r.id).text), "Response")
    assert [i.type for i in r.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert (r.status, r.output_text) == ("completed", "The sum is 5.")
    listing, call = r.output[0].model_dump(), r.output[1]
    assert sorted(t["name"] for t in listing["tools"]) == ["add", "explode", "lookup"]
    assert (call.server_label, call.name, call.status, call.output, call.error) == (
        "calc", "add", "completed", "sum=5", None)
    # the MCP server ran it with the model's arguments, valid for the tool's listed schema
    args = json.loads(call.arguments)
    assert calls_made(calls_file) == [{"tool": "add", **args}] and args == {"a": 2, "b": 3}
    schema = next(t["input_schema"] for t in listing["tools"] if t["name"] == "add")
    jsonschema.validate(args, schema)
    # the next model turn read the call and its result: exactly the template's rendering
    first, second = engine.requests[r.id][0], engine.requests[f"{r.id}-1"][0]
    ask = [{"role": "user", "content": ASK}]
    assert first == rendered(tokenizer, ask, listing)
    answered = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sum=5"}]
    assert second == rendered(tokenizer, answered, listing)
    assert "sum=5" in tokenizer.decode(second, skip_special_tokens=False)
    assert r.usage.input_tokens == len(first) + len(second)
    assert r.tools[0].server_url == http_url and r.tools[0].headers is None

    # streamed: the same items, their events in OpenAI's order, each valid
    events = post_events(server.port, {"model": "m", "input": ASK, "tools": [tool]})
    for ev in events:
        validate_event(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    kinds = [ev["type"] for ev in events]
    head = kinds[:kinds.index("response.content_part.added")]
    assert head == ["response.created", "response.in_progress",
                    "response.output_item.added", "response.mcp_list_tools.in_progress",
                    "response.mcp_list_tools.completed", "response.output_item.done",
                    "response.output_item.added", "response.mcp_call.in_progress",
                    "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
                    "response.mcp_call.completed", "response.output_item.done",
                    "response.output_item.added"]
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert final["output"][1]["output"] == "sum=5"
    done = [ev["item"] for ev in events if ev["type"] == "response.output_item.done"]
    assert done == final["output"]
    with client.responses.stream(model="m", input=ASK, tools=[tool]) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response()
    assert [i.type for i in streamed.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert streamed.output[1].output == "sum=5" and streamed.output_text == "The sum is 5."
    assert len(calls_made(calls_file)) == 3


def test_the_conversation_continues_by_id_or_by_replayed_items(serve, tokenizer,  # noqa: F811
                                                               http_url):
    client, engine, _ = serve([CALL, "5."])
    tool = mcp_tool(http_url)
    first = client.responses.create(model="m", input=ASK, tools=[tool])
    by_id = client.responses.create(model="m", input="Thanks.", tools=[tool],
                                    previous_response_id=first.id)
    # a store: false client sends the output back itself
    replayed = client.responses.create(model="m", tools=[tool], store=False, input=[
        {"role": "user", "content": ASK}, *[i.model_dump() for i in first.output],
        {"role": "user", "content": "Thanks."}])
    assert engine.requests[by_id.id][0] == engine.requests[replayed.id][0]
    text = tokenizer.decode(engine.requests[by_id.id][0], skip_special_tokens=False)
    assert text.count("sum=5") == 1 and text.index("sum=5") < text.index("Thanks.")


def test_approval_ends_the_response_and_its_answer_runs_or_declines_the_call(
        serve, tokenizer, calls_file):  # noqa: F811
    client, engine, server = serve([CALL], config=True)
    tool = {"type": "mcp", "server_label": "local"}          # require_approval: always
    asked = client.responses.create(model="m", input=ASK, tools=[tool])
    assert [i.type for i in asked.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = asked.output[1]
    assert (asked.status, request.server_label, request.name) == ("completed", "local", "add")
    assert calls_made(calls_file) == []                     # nothing ran
    events = post_events(server.port, {"model": "m", "input": ASK, "tools": [tool]})
    for ev in events:
        validate_event(ev)
    engine.scripts = ["Answered."]
    approved = client.responses.create(
        model="m", tools=[tool], previous_response_id=asked.id,
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                "approve": True}])
    assert [i.type for i in approved.output] == ["mcp_list_tools", "mcp_call", "message"]
    call = approved.output[1]
    assert (call.approval_request_id, call.output, call.arguments) == (
        request.id, "sum=5", request.arguments)
    assert calls_made(calls_file) == [{"tool": "add", "a": 2, "b": 3}]
    assert approved.output_text == "Answered."
    prompt = tokenizer.decode(engine.requests[approved.id][0], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>tool\nsum=5<|im_end|>\n<|im_start|>assistant\n")
    listing = client.responses.input_items.list(approved.id)
    assert [(i.type, i.approve) for i in listing.data] == [("mcp_approval_response", True)]

    engine.scripts = [CALL]
    asked = client.responses.create(model="m", input=ASK, tools=[tool])
    request = asked.output[1]
    engine.scripts = ["Declined."]
    declined = client.responses.create(model="m", tools=[tool], input=[
        {"role": "user", "content": ASK}, request.model_dump(),
        {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": False,
         "reason": "not now"}])
    assert [i.type for i in declined.output] == ["mcp_list_tools", "message"]
    assert len(calls_made(calls_file)) == 1                 # the declined call never ran
    prompt = tokenizer.decode(engine.requests[declined.id][0], skip_special_tokens=False)
    assert "The user declined to run this tool call. Reason: not now" in prompt
    # an approval for a server this request does not name
    status, body = post_json(server.port, "/v1/responses", {
        "model": "m", "previous_response_id": asked.id, "input": [
            {"type": "mcp_approval_response", "approval_request_id": request.id,
             "approve": True}]})
    assert_error(status, body, 400, "tools")


def test_calls_stop_at_max_tool_calls_and_the_server_default(serve, http_url,  # noqa: F811
                                                              calls_file, tokenizer):
    client, engine, _ = serve([CALL, CALL, CALL, CALL])
    r = client.responses.create(model="m", input=ASK, tools=[mcp_tool(http_url)],
                                max_tool_calls=2)
    assert r.max_tool_calls == 2
    assert len(calls_made(calls_file)) == 2
    kinds = [(i.type, getattr(i, "status", None)) for i in r.output]
    assert kinds[:3] == [("mcp_list_tools", None), ("mcp_call", "completed"),
                         ("mcp_call", "completed")]
    # the third turn ran without the MCP tools (so without a tool parser: its text is the
    # answer), and was the last
    third = tokenizer.decode(engine.requests[f"{r.id}-2"][0], skip_special_tokens=False)
    assert "TOOLS" not in third and f"{r.id}-3" not in engine.requests
    assert kinds[3:] == [("message", "completed")]
    # the server's bound (--mcp-max-calls) holds without max_tool_calls
    client, engine, _ = serve([CALL], mcp_max_calls=1)
    calls_file.write_text("")
    r = client.responses.create(model="m", input=ASK, tools=[mcp_tool(http_url)])
    assert len(calls_made(calls_file)) == 1 and len(engine.requests) == 2


def test_a_tool_error_is_a_failed_call_the_model_reads(serve, http_url, tokenizer):  # noqa: F811
    client, engine, _ = serve(['<tool_call>\n{"name": "explode", "arguments": {}}\n</tool_call>',
                               "It failed."])
    r = client.responses.create(model="m", input=ASK, tools=[mcp_tool(http_url)])
    call = r.output[1]
    assert (call.status, call.output, call.error.type) == ("failed", None,
                                                           "mcp_tool_execution_error")
    assert "the fuse blew" in call.error.content[0]["text"]
    prompt = tokenizer.decode(engine.requests[f"{r.id}-1"][0], skip_special_tokens=False)
    assert "<|im_start|>tool\nError: " in prompt and "the fuse blew" in prompt


def test_allowed_tools_and_approval_filters(serve, http_url, calls_file):
    lookup = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>'
    client, engine, _ = serve([lookup, "ok"])
    tool = mcp_tool(http_url, allowed_tools=["add", "lookup"],
                    require_approval={"never": {"read_only": True}})
    r = client.responses.create(model="m", input=ASK, tools=[tool])
    assert sorted(t.name for t in r.output[0].tools) == ["add", "lookup"]
    assert [i.type for i in r.output] == ["mcp_list_tools", "mcp_call", "message"]  # read-only
    engine.scripts = [CALL]
    r = client.responses.create(model="m", input=ASK, tools=[tool])
    assert [i.type for i in r.output] == ["mcp_list_tools", "mcp_approval_request"]
    r = client.responses.create(model="m", input=ASK, tools=[
        mcp_tool(http_url, allowed_tools={"read_only": True})])
    assert [t.name for t in r.output[0].tools] == ["lookup"]
    assert calls_made(calls_file) == [{"tool": "lookup", "key": "k"}]


def test_urls_outside_the_allow_list_and_unreachable_servers(serve, http_url):
    _, _, server = serve(["hi"], mcp_allowed_urls=[http_url, "http://127.0.0.1:9/mcp"])
    for url, status, code in ((http_url + "x", 400, "mcp_server_not_allowed"),
                              ("http://127.0.0.1:9/mcp", 424, "mcp_list_tools_failed")):
        s, body = post_json(server.port, "/v1/responses", {
            "model": "m", "input": ASK, "tools": [mcp_tool(url)]})
        assert_error(s, body, status, "tools[0]" if status == 424 else "tools[0].server_url",
                     code)
    # a function tool and an MCP tool of one name: leave one out
    s, body = post_json(server.port, "/v1/responses", {"model": "m", "input": ASK, "tools": [
        mcp_tool(http_url), {"type": "function", "name": "add", "parameters": {}}]})
    assert_error(s, body, 400, "tools[0].allowed_tools")

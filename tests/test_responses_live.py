"""The Responses API on a real `python -m server` process with the generated demo checkpoint:
the official SDK's `responses.create` (plain and streamed) and `responses.stream` agree under
greedy decoding, every object is valid against OpenAI's schemas, the prompt the engine ran is
the one an independent tokenizer makes of the conversation (previous_response_id included), and
the store's size comes from the command line."""
from __future__ import annotations

import json

import openai
import pytest

from server_fakes import LiveServer, client_for, http_request, post_json
from test_responses import post_events, validate, validate_event
from test_server_live import chatml, demo_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    demo = write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))
    server = LiveServer(tmp_path_factory.mktemp("live"), demo, "--mem", "64",
                        "--served-model-name", "demo", "--responses-store-size", "2")
    yield server
    server.close()


def input_tokens(live, messages) -> int:
    return len(demo_tokenizer(live).encode(chatml(messages), add_special_tokens=False).ids)


GREEDY = dict(model="demo", instructions="You are terse.", input="What is the capital of France?",
              temperature=0.0, max_output_tokens=16, extra_body={"ignore_eos": True, "seed": 7})


def test_live_create_stream_and_accumulator_agree(live):
    client = client_for(live.port)
    raw = client.responses.with_raw_response.create(**GREEDY)
    validate(json.loads(raw.text), "Response")
    cut = raw.parse()
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cut.usage.output_tokens == 16 and cut.output_text
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    assert cut.usage.input_tokens == input_tokens(live, messages)

    # a stop string from inside that text ends the same greedy run early: status completed,
    # which the SDK's accumulator needs for its final response
    stop = cut.output_text[len(cut.output_text) // 2:][:3]
    args = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "stop": [stop]}}
    whole = client.responses.create(**args)
    assert whole.status == "completed" and whole.output_text and stop not in whole.output_text
    assert cut.output_text.startswith(whole.output_text)

    events = list(client.responses.create(**args, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))

    with client.responses.stream(**args) as stream:
        streamed = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(streamed) == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens

    for ev in post_events(live.port, {k: v for k, v in args.items() if k != "extra_body"}
                          | args["extra_body"]):
        validate_event(ev)


def test_live_previous_response_id(live):
    client = client_for(live.port)
    first = client.responses.create(model="demo", input="Name a colour.", max_output_tokens=6,
                                    instructions="Answer in one word.",
                                    extra_body={"ignore_eos": True})
    second = client.responses.create(model="demo", input="And another?", max_output_tokens=6,
                                     previous_response_id=first.id,
                                     extra_body={"ignore_eos": True})
    turn = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}]
    # the engine ran the earlier turn and its answer, without the earlier instructions
    assert second.usage.input_tokens == input_tokens(live, turn)
    assert second.usage.input_tokens > input_tokens(live, turn[2:])
    _, tokenized = post_json(live.port, "/tokenize", {"messages": turn})
    assert tokenized["count"] == second.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_live_store_size_flag(live):
    client = client_for(live.port)
    ids = [client.responses.create(model="demo", input=f"n{i}", max_output_tokens=1).id
           for i in range(3)]
    with pytest.raises(openai.NotFoundError):             # --responses-store-size 2
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    status, _, payload = http_request(live.port, "GET", f"/v1/responses/{ids[0]}")
    assert status == 404 and json.loads(payload)["error"]["code"] == "response_not_found"
    # function tools run (the demo model's parser is chosen from its architecture)
    answered = client.responses.create(model="demo", input="x", max_output_tokens=4, tools=[
        {"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert answered.status == "incomplete" and answered.tools[0].strict is True


def test_store_size_flag_is_checked(tmp_path, capsys):
    from server.__main__ import build_parser, main, server_settings
    args = build_parser().parse_args(["--w", "/m", "--responses-store-size", "5"])
    assert server_settings(args, type("Config", (), {"model": "/m"})).responses_store_size == 5
    assert build_parser().parse_args([]).responses_store_size == 1000
    with pytest.raises(SystemExit) as e:
        main(["--cpu", "--w", str(tmp_path), "--responses-store-size", "-1"])
    assert e.value.code == 2
    assert "--responses-store-size must be at least 0" in capsys.readouterr().err


def test_live_text_format_parses_into_the_model(live):
    """responses.parse with a Pydantic model: the grammar holds the random model to the schema
    (short fields, so it ends within max_output_tokens)."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)
        country: Literal["France", "Norway"]
        population: int = Field(ge=0, le=99)
    client = client_for(live.port)
    parsed = client.responses.parse(model="demo", input="Describe a city.", temperature=1.0,
                                    max_output_tokens=60, text_format=City,
                                    extra_body={"seed": 3})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    assert parsed.output_parsed == City.model_validate_json(parsed.output_text)
    free = client.responses.create(model="demo", input="Describe a city.", temperature=1.0,
                                   max_output_tokens=60, extra_body={"seed": 3})
    with pytest.raises(ValueError):                  # unconstrained, it writes no such JSON
        City.model_validate_json(free.output_text)


def test_live_background_and_cancel(live):
    import time
    client = client_for(live.port)
    queued = client.responses.create(model="demo", input="Hi", max_output_tokens=4000,
                                     background=True, extra_body={"ignore_eos": True})
    assert queued.status == "queued"
    deadline = time.time() + 60
    while client.responses.retrieve(queued.id).status != "in_progress":
        assert time.time() < deadline
        time.sleep(0.05)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    short = client.responses.create(model="demo", input="Hi", max_output_tokens=3,
                                    background=True, extra_body={"ignore_eos": True})
    while (got := client.responses.retrieve(short.id)).status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage.output_tokens == 3


@pytest.fixture(scope="module")
def live_mcp(tmp_path_factory):
    """The demo server allowed to reach one MCP server (test_responses_mcp.py's, over HTTP)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from server.demo_model import write_demo_checkpoint
    from server_fakes import free_port
    from test_responses_mcp import SERVER
    tmp = tmp_path_factory.mktemp("live-mcp")
    (tmp / "calc_server.py").write_text(SERVER)
    calls = tmp / "calls.jsonl"
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(tmp / "calc_server.py"), str(port)],
                            env={**os.environ, "CALLS_FILE": str(calls)})
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline and proc.poll() is None, "MCP server did not start"
            time.sleep(0.2)
    url = f"http://127.0.0.1:{port}/mcp"
    demo = write_demo_checkpoint(str(tmp / "demo"))
    server = LiveServer(tmp, demo, "--mem", "64", "--served-model-name", "demo",
                        "--mcp-allowed-urls", url)
    yield server, url, calls
    server.close()
    proc.terminate()
    proc.wait(10)


def test_live_mcp_call_on_the_real_engine(live_mcp):
    """The random demo model, forced by the grammar to call (tool_choice required, one call),
    calls the MCP server with arguments valid for the tool's schema; the result is the mcp_call's
    output and the model's next turn reads it (its input is longer by the call and result)."""
    import jsonschema
    server, url, calls = live_mcp
    client = client_for(server.port)
    tool = {"type": "mcp", "server_label": "calc", "server_url": url,
            "require_approval": "never", "allowed_tools": ["add"]}
    args = dict(model="demo", input="Add 2 and 3.", tools=[tool], tool_choice="required",
                parallel_tool_calls=False, max_tool_calls=1, max_output_tokens=120,
                temperature=1.0, extra_body={"seed": 5})
    r = client.responses.create(**args)
    assert [i.type for i in r.output][:2] == ["mcp_list_tools", "mcp_call"]
    listing, call = r.output[0], r.output[1]
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, listing.tools[0].input_schema)
    assert call.status == "completed"
    assert call.output == f"sum={arguments['a'] + arguments['b']}"
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [
        {"tool": "add", **arguments}]
    # two model turns; the second read the first's prompt, the call and its result
    assert r.usage.input_tokens > 2 * input_tokens(server, [{"role": "user",
                                                             "content": "Add 2 and 3."}])
    events = post_events(server.port, {k: v for k, v in args.items() if k != "extra_body"}
                         | args["extra_body"])
    for ev in events:
        validate_event(ev)
    kinds = [ev["type"] for ev in events]
    assert "response.mcp_call.completed" in kinds and "response.mcp_list_tools.completed" in kinds
    done = [ev["item"] for ev in events if ev["type"] == "response.output_item.done"]
    assert done[1]["type"] == "mcp_call" and done[1]["arguments"] == call.arguments   # seeded
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{**args, "tools": [{**tool, "server_url": url + "/other"}]})
    assert "--mcp-allowed-urls" in e.value.message


def test_mcp_and_background_flags_are_checked(tmp_path, capsys):
    from server.__main__ import build_parser, main, server_settings
    args = build_parser().parse_args(["--w", "/m", "--mcp-allowed-urls", "http://a/mcp",
                                      "https://b/mcp", "--mcp-max-calls", "3",
                                      "--responses-max-background", "2"])
    settings = server_settings(args, type("Config", (), {"model": "/m"}))
    assert (settings.mcp_allowed_urls, settings.mcp_max_calls,
            settings.responses_max_background) == (["http://a/mcp", "https://b/mcp"], 3, 2)
    defaults = server_settings(build_parser().parse_args(["--w", "/m"]),
                               type("Config", (), {"model": "/m"}))
    assert (defaults.mcp_allowed_urls, defaults.mcp_max_calls,
            defaults.responses_max_background) == ([], 20, 64)
    for flags, message in ((["--mcp-allowed-urls", "ftp://x"], "is not an http:// or https://"),
                           (["--mcp-max-calls", "-1"], "--mcp-max-calls must be at least 0"),
                           (["--responses-max-background", "-1"],
                            "--responses-max-background must be at least 0")):
        with pytest.raises(SystemExit) as e:
            main(["--cpu", "--w", str(tmp_path), *flags])
        assert e.value.code == 2
        assert message in capsys.readouterr().err

"""tool_choice "required" and named functions enforced by the token mask, on the real engine:
the random-weight demo model never writes a tool call by itself (tool_choice "auto" shows it), and
with a required choice it must, in every format, with arguments valid for the function."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_fakes import clients_per_tool_parser

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time",
                                         "parameters": {"type": "object", "properties": {},
                                                        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like?"}]
FORMATS = ["qwen", "mistral", "llama", "json", "pythonic", "qwen_coder"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from server.demo_model import write_demo_checkpoint
    path = write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))
    eng = AsyncEngine(EngineConfig(model=path, kv_cache_memory_mb=32))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def clients(engine):
    yield from clients_per_tool_parser(engine, FORMATS)


def ask(client, **kwargs):
    return client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, seed=7,
                                          temperature=1.0, max_tokens=120, **kwargs).choices[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_forces_a_valid_call(clients, fmt):
    free = ask(clients[fmt])
    assert free.message.tool_calls is None            # left alone, the model calls nothing
    # One call (parallel_tool_calls false), so the grammar ends after it: with several allowed, a
    # random model goes on calling until max_tokens.
    forced = ask(clients[fmt], tool_choice="required", parallel_tool_calls=False)
    assert forced.finish_reason == "tool_calls", forced
    assert len(forced.message.tool_calls) == 1
    for call in forced.message.tool_calls:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_named_function_is_the_one_called(clients, fmt):
    choice = ask(clients[fmt], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {}


def test_streamed_required_call_equals_the_whole_one(clients):
    whole = ask(clients["qwen"], tool_choice="required", parallel_tool_calls=False)
    with clients["qwen"].chat.completions.stream(
            model="demo", messages=ASK, tools=TOOLS, seed=7, temperature=1.0, max_tokens=120,
            tool_choice="required", parallel_tool_calls=False) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_required_call_and_response_format_are_refused_together(clients):
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        ask(clients["qwen"], tool_choice="required", response_format={"type": "json_object"})

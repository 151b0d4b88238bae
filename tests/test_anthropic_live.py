"""Anthropic's Messages API on the real engine (the random-weight demo checkpoint, rendered with
Qwen2.5's chat template, which shows tools, calls and results), through the official `anthropic`
SDK:

- a created and a streamed message agree under greedy decoding;
- a tool call forced by tool_choice {"type": "tool"} (the chat route's grammar: the random model
  never calls a tool by itself): its input is valid against the tool's input_schema, and its
  streamed input_json_deltas rebuild it;
- the tool_result turn after it runs, and count_tokens (and the message's usage) equal the
  prompt transformers' tokenizer makes of the same conversation written by hand in the chat
  shape, with the same template.
"""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest

from server_fakes import ThreadedServer

pytestmark = pytest.mark.timeout(600)

TEMPLATE = (Path(__file__).parent / "data" / "chat_templates" /
            "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {},
                                             "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


@pytest.fixture(scope="module")
def client(demo_dir):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from server.app import ServerSettings, create_app
    engine = AsyncEngine(EngineConfig(model=demo_dir, kv_cache_memory_mb=32))
    server = ThreadedServer(create_app(engine, ServerSettings(
        ["demo"], tool_parser="qwen", chat_template=TEMPLATE)))
    yield anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                              max_retries=0, timeout=300)
    server.close()
    engine.shutdown()


def test_created_and_streamed_messages_agree(client):
    args = dict(model="demo", max_tokens=12, messages=ASK, system="Be brief.",
                extra_body=GREEDY)
    whole = client.messages.create(**args)
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    with client.messages.stream(**args) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens <= 12


def test_a_forced_tool_call_and_its_result(client, demo_dir):
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    args = dict(model="demo", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=choice,
                extra_body=GREEDY)
    free = client.messages.create(**{**args, "tool_choice": {"type": "auto"}})
    assert all(b.type != "tool_use" for b in free.content)   # left alone, it calls nothing

    whole = client.messages.create(**args)
    assert whole.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in whole.content] == [("tool_use", "get_weather")]
    call = whole.content[0]
    jsonschema.validate(call.input, WEATHER["input_schema"])

    partials = []
    with client.messages.stream(**args) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partials.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(partials) > 1                      # the input came over several events
    assert json.loads("".join(partials)) == final.content[0].input == call.input
    assert final.stop_reason == "tool_use"

    turn = [*ASK, whole.to_param(),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "18 C and sunny"}]}]
    count = client.messages.count_tokens(model="demo", messages=turn, tools=TOOLS)
    answer = client.messages.create(model="demo", max_tokens=5, messages=turn, tools=TOOLS,
                                    extra_body=GREEDY)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == \
        count.input_tokens

    # the same conversation, written by hand in the chat shape, rendered by transformers
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_dir)
    by_hand = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.input}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    chat_tools = [{"type": "function", "function": {
        "name": t["name"], **({"description": t["description"]} if "description" in t else {}),
        "parameters": t["input_schema"]}} for t in TOOLS]
    want = tok.apply_chat_template(by_hand, tools=chat_tools, chat_template=TEMPLATE,
                                   add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert count.input_tokens == len(want)
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in tok.decode(want)


def test_a_prefill_is_continued(client, demo_dir):
    """A conversation ending with the assistant's text renders as transformers'
    continue_final_message does: no end of turn after it, no new turn opened."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_dir)
    conversation = [*ASK, {"role": "assistant", "content": "The weather is"}]
    count = client.messages.count_tokens(model="demo", messages=conversation)
    want = tok.apply_chat_template(conversation, chat_template=TEMPLATE, tokenize=True,
                                   continue_final_message=True, return_dict=False)
    assert count.input_tokens == len(want)
    assert tok.decode(want).endswith("<|im_start|>assistant\nThe weather is")
    answered = tok.apply_chat_template(conversation, chat_template=TEMPLATE, tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
    assert len(answered) != len(want)
    message = client.messages.create(model="demo", max_tokens=4, messages=conversation,
                                     extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(want)

"""Tool-call parsers: golden cases per format, and every case streamed in deltas of every size
from one character to the whole text, reassembled the way the OpenAI SDK's stream accumulator
does, equal to the non-streamed parse."""
from __future__ import annotations

import json
import re

import pytest

from server.tool_parsers import PARSERS, ToolCallStream, choose_parser, get_parser

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "code": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}}}]

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    # Qwen / Hermes
    ("qwen", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("qwen", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"y": [1, {"z": "}"}]}}\n</tool_call>',
     None, [("a", '{"x": 1}'), ("b", '{"y": [1, {"z": "}"}]}')]),
    ("qwen", 'Let me look. <tool_call>{"name": "f", "arguments": {}}</tool_call> Done.',
     "Let me look.  Done.", [("f", "{}")]),
    ("qwen", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("qwen", '<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [("f", "{}")]),
    ("qwen", '<tool_call>{"name": "say", "arguments": {"s": "a \\"quoted\\" } and \\\\"}}'
             '</tool_call>', None, [("say", '{"s": "a \\"quoted\\" } and \\\\"}')]),
    ("qwen", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     None, [("f", '{"a": 1}')]),
    ("qwen", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
     None, [("f", '{"a": 1}')]),
    ("qwen", "the <tools> tag and <tool_calls are not markers", "the <tools> tag and <tool_calls "
             "are not markers", []),
    ("qwen", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("qwen", '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
    ("qwen", '<tool_call>{"name": "f", "arguments": {"a": 1',        # truncated (length)
     None, [("f", '{"a": 1')]),
    ("qwen", "plain answer, no calls <", "plain answer, no calls <", []),
    # Qwen3-Coder
    ("qwen_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("qwen_coder", "<tool_call><function=get_weather><parameter=metric>true</parameter>"
                   "<parameter=ratio>0.5</parameter><parameter=tags>[\"a\", 2]</parameter>"
                   "<parameter=opts>{\"k\": null}</parameter><parameter=code>007</parameter>"
                   "<parameter=maybe>null</parameter><parameter=days>many</parameter>"
                   "</function></tool_call>",
     None, [("get_weather", '{"metric": true, "ratio": 0.5, "tags": ["a", 2], '
                            '"opts": {"k": null}, "code": "007", "maybe": null, '
                            '"days": "many"}')]),
    ("qwen_coder", "Checking.\n<tool_call><function=ping></function></tool_call>"
                   "<tool_call><function=get_weather><parameter=city>a <b> c</parameter>"
                   "</function></tool_call>",
     "Checking.", [("ping", "{}"), ("get_weather", '{"city": "a <b> c"}')]),
    # Mistral
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", '
                '"arguments": {}}]', None, [("f", '{"a": 1}'), ("g", "{}")]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "x"}[TOOL_CALLS]g[ARGS]{}',
     None, [("f", '{"a": "x"}'), ("g", "{}")]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     "Sure.", [("get_weather", '{"city": "Paris"}')]),
    ("mistral", "[TOOL_CALLS] nonsense", "[TOOL_CALLS] nonsense", []),
    ("mistral", "A [TOOL answer", "A [TOOL answer", []),
    # Llama 3.x
    ("llama", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("llama", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", '
              '"parameters": {}}', None, [("f", '{"a": 1}'), ("g", "{}")]),
    ("llama", 'Here: <function=f>{"a": [1, 2]}</function> ok', "Here:  ok", [("f", '{"a": [1, 2]}')]),
    ("llama", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    ("llama", '```json\n{"name": "f", "parameters": {}}\n```',
     '```json\n{"name": "f", "parameters": {}}\n```', []),
    # Pythonic
    ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2.5)]',
     None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2.5}')]),
    ("pythonic", '<|python_start|>[f(s="a) b, c]", n=None, l=[1, "]"])]<|python_end|>',
     None, [("f", '{"s": "a) b, c]", "n": null, "l": [1, "]"]}')]),
    ("pythonic", "[ping()]", None, [("ping", "{}")]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("pythonic", "[Note] this is text", "[Note] this is text", []),
    # bare JSON
    ("json", '{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ("json", '[{"name": "f", "arguments": {}}, {"type": "function", "function": {"name": "g", '
             '"arguments": {"b": [1, 2]}}}]', None, [("f", "{}"), ("g", '{"b": [1, 2]}')]),
    ("json", '{"result": "not a call"}', '{"result": "not a call"}', []),
    ("json", '{"type": "object", "properties": {}}', '{"type": "object", "properties": {}}', []),
    ("json", "Just words.", "Just words.", []),
]


def ids(case):
    return f"{case[0]}:{case[1][:30]}"


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
def test_golden(case):
    name, text, content, calls = case
    got_content, got_calls = get_parser(name)(WEATHER_TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        if not text.endswith('{"a": 1'):     # the truncated case
            json.loads(c.arguments)


def accumulate(deltas) -> tuple[str | None, list[dict]]:
    """What the OpenAI SDK's chat stream accumulator builds from the deltas, with the delta
    contract checked on the way: the first delta of a call carries index, id, type and the whole
    name; later ones carry only argument text."""
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            i = tc["index"]
            if i not in calls:
                assert tc["type"] == "function" and tc["id"] and tc["function"]["name"]
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[i]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
def test_streamed_equals_non_streamed_at_every_delta_size(case):
    name, text, _, _ = case
    parser = get_parser(name)(WEATHER_TOOLS)
    want_content, want_calls = parser.parse(text)
    for size in range(1, len(text) + 1):
        stream = ToolCallStream(parser, "req-1")
        deltas = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)]
        deltas.append(stream.finish())
        content, calls = accumulate(deltas)
        assert content == want_content, size
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.name, c.arguments) for c in want_calls], size
        assert len({c["id"] for c in calls}) == len(calls)


def test_content_that_cannot_be_a_marker_is_sent_at_once():
    stream = ToolCallStream(get_parser("qwen")(), "r")
    assert stream.feed("Hello <tool").content == "Hello"       # "<tool" may become a marker
    assert stream.feed("s>").content == " <tools>"            # now it cannot
    stream = ToolCallStream(get_parser("json")(), "r")
    assert stream.feed('{"na').content == ""
    assert stream.feed("x").content == '{"nax'     # the first key is "nax...": not a call
    assert stream.feed('": 1}').content == '": 1}'


def test_mistral_ids_are_nine_alphanumerics_and_distinct():
    stream = ToolCallStream(get_parser("mistral")(), "chatcmpl-1")
    d = stream.feed("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}")
    d2 = stream.finish()
    ids_ = [tc["id"] for tc in d.tool_calls + d2.tool_calls if "id" in tc]
    assert len(ids_) == 2 and len(set(ids_)) == 2
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids_)


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", ["", "<", "[", "{", '{"', "<tool_call>", "[TOOL_CALLS]",
                                  "<tool_call>{", "[TOOL_CALLS][", "<|python_tag|>{\"name\"",
                                  '{"name": "f", "arguments": {"a": [1, 2}}', "[f(", "}}]]",
                                  "<function=>{}</function>", "\\", '"\\u12'])
def test_malformed_input_never_raises(name, text):
    parser = get_parser(name)(WEATHER_TOOLS)
    parser.parse(text)
    stream = ToolCallStream(parser, "r")
    for ch in text:
        stream.feed(ch)
    stream.finish()


def test_choice_of_parser():
    assert choose_parser("Qwen3ForCausalLM", "{{ '<tool_call>' }}")[0] == "qwen"
    assert choose_parser("Qwen3MoeForCausalLM", "<tool_call><function=x><parameter=y>")[0] \
        == "qwen_coder"
    assert choose_parser("MistralForCausalLM", "")[0] == "mistral"
    assert choose_parser("LlamaForCausalLM", "<|python_tag|>")[0] == "llama"
    assert choose_parser("LlamaForCausalLM", "<|python_start|>")[0] == "pythonic"
    assert choose_parser("unknown", "... [TOOL_CALLS] ...")[0] == "mistral"
    assert choose_parser("unknown", "")[0] is None
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        get_parser("nope")

"""The tool-call grammars (server/tool_grammar.py) against the parsers that read the calls: a
call the grammar accepts, token by token through llguidance, parses (server/tool_parsers/) into
arguments that validate against the function's schema (jsonschema); calls that break the schema
are refused; under strict "auto" prose is accepted as it is. Markers are plain text here (the
demo tokenizer); tests/test_tool_strict_live.py runs special-token markers on the engine."""
from __future__ import annotations

import json
import types

import jsonschema
import pytest

from server.tool_grammar import strict_call_constraint, tool_call_constraint
from server.tool_parsers import get_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "limit": {"type": "integer"}},
        "required": ["query"], "additionalProperties": False}}},
]
# format -> (a valid call, the same call breaking the schema)
CALLS = {
    "qwen": ('<tool_call>\n{"name":"search","arguments":{"query":"a <b> c","limit":3}}\n'
             '</tool_call>', '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome",'),
    "qwen_coder": ("<tool_call>\n<function=search>\n<parameter=query>\nline one\nx < y\n"
                   "</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>",
                   "<tool_call>\n<function=get_weather>\n<parameter=days>\n"),
    "mistral": ('[TOOL_CALLS][{"name":"search","arguments":{"query":"weather"}}]',
                '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo","days":9'),
    "llama": ('{"name":"get_weather","parameters":{"city":"Oslo","days":2}}',
              '{"name":"get_weather","parameters":{"town"'),
    "json": ('{"name":"search","arguments":{"query":"weather"}}',
             '{"name":"search","arguments":{"limit":1,'),
    "pythonic": ('[get_weather(city="Paris", days=7)]', '[get_weather(days=2'),
}
PROSE = "Which city do you mean? I can look up Paris or Oslo."


@pytest.fixture(scope="module")
def tok():
    from llguidance import LLTokenizer
    from server.demo_model import build_tokenizer
    rust = build_tokenizer()
    eos = rust.token_to_id("<|im_end|>")
    return rust, LLTokenizer(rust.to_str(), eos_token=[eos]), eos


PLAIN_MARKERS = types.SimpleNamespace(has_special_tokens=lambda strings: False,
                                      has_tokens=lambda strings: False)
# A reasoning model's tokenizer: <think> and </think> are tokens, as plain text (Qwen3's).
THINKING = types.SimpleNamespace(has_special_tokens=lambda strings: False,
                                 has_tokens=lambda strings: True)


def accepts(tok, spec: str, text: str, whole: bool = True) -> bool:
    import llguidance
    from llguidance import LLMatcher
    rust, ll, eos = tok
    m = LLMatcher(ll, llguidance.grammar_from("lark", spec), log_level=0)
    assert not m.is_error(), m.get_error()
    if not m.consume_tokens(rust.encode(text).ids):
        return False
    return m.consume_token(eos) if whole else True


@pytest.mark.parametrize("fmt", list(CALLS))
def test_grammars_accept_valid_calls_and_refuse_broken_ones(tok, fmt):
    valid, broken = CALLS[fmt]
    parser = get_parser(fmt)(TOOLS)
    content, [call] = parser.parse(valid)
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])   # the parser's reading
    required = tool_call_constraint(parser, TOOLS, "required", False, PLAIN_MARKERS).spec
    strict = strict_call_constraint(parser, TOOLS, False, PLAIN_MARKERS).spec
    for spec in (required, strict):
        assert accepts(tok, spec, valid)
        assert not accepts(tok, spec, broken, whole=False)
    assert accepts(tok, strict, PROSE) and not accepts(tok, required, PROSE, whole=False)
    if fmt in ("qwen", "qwen_coder", "mistral"):           # a marker anywhere starts a call
        assert accepts(tok, strict, "Let me look. " + valid)
        assert not accepts(tok, strict, "Let me look. " + broken, whole=False)
    if fmt == "llama":                                     # or the python tag, at the start
        assert accepts(tok, strict, "<|python_tag|>" + valid)
        assert not accepts(tok, strict, "<|python_tag|>" + broken, whole=False)


def test_only_strict_tools_make_a_grammar_under_auto():
    loose = [{"type": "function", "function": {**t["function"], "strict": False}} for t in TOOLS]
    assert strict_call_constraint(get_parser("qwen")(loose), loose, True, PLAIN_MARKERS) is None
    # a loose tool beside a strict one: its arguments are any object
    mixed = [TOOLS[0], loose[1]]
    spec = strict_call_constraint(get_parser("json")(mixed), mixed, True, PLAIN_MARKERS).spec
    assert '"enum": ["Paris", "Oslo"]' in spec and '"query"' not in spec


@pytest.mark.parametrize("fmt", ["qwen", "qwen_coder", "mistral"])
def test_a_marker_inside_the_reasoning_starts_no_call(tok, fmt):
    valid, broken = CALLS[fmt]
    marker = {"mistral": "[TOOL_CALLS]"}.get(fmt, "<tool_call>")
    musing = f"<think>Should I write {marker} now? No.</think>The answer is Paris."
    parser = get_parser(fmt)(TOOLS)
    assert parser.parse(musing)[1] == []                    # the parser reads no call there
    thinking = strict_call_constraint(parser, TOOLS, False, THINKING).spec
    assert accepts(tok, thinking, musing)
    assert accepts(tok, thinking, "<think>Look it up.</think>\n" + valid)
    assert not accepts(tok, thinking, "<think>Look it up.</think>\n" + broken, whole=False)
    # without knowing the model reasons, the marker in its reasoning would force a call
    plain = strict_call_constraint(parser, TOOLS, False, PLAIN_MARKERS).spec
    assert not accepts(tok, plain, musing)


@pytest.mark.parametrize("fmt", list(CALLS))
def test_a_reasoning_model_may_think_before_it_calls(tok, fmt):
    """Qwen3-style models open <think> themselves: required lets them reason first, then
    holds them to a call; strict auto holds a call after the reasoning as one without."""
    valid, broken = CALLS[fmt]
    parser = get_parser(fmt)(TOOLS)
    thought = "<think>The user wants the weather.</think>\n\n"
    required = tool_call_constraint(parser, TOOLS, "required", False, THINKING).spec
    strict = strict_call_constraint(parser, TOOLS, False, THINKING).spec
    for spec in (required, strict):
        assert accepts(tok, spec, thought + valid) and accepts(tok, spec, valid)
        assert not accepts(tok, spec, thought + broken, whole=False)
    assert not accepts(tok, required, thought + PROSE, whole=False)
    assert accepts(tok, strict, thought + PROSE) and accepts(tok, strict, PROSE)
    # a model that does not reason gets no room for it under required
    plain = tool_call_constraint(parser, TOOLS, "required", False, PLAIN_MARKERS).spec
    assert not accepts(tok, plain, thought + valid, whole=False)

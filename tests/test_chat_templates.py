"""The families' real chat templates (tests/data/chat_templates/, with their sources and
licences in its README) render an OpenAI-style multi-turn tool conversation exactly as
transformers' apply_chat_template renders the same conversation written the templates' way.

The conversation: a system message, a user question, an assistant turn with text, reasoning
(Qwen3) and two parallel calls (one for the Llama 3.1 and 3.2 templates, which take one), the tool
results, then (second case) the final answer and a follow-up question. Taper gets it as a client
sends it, through /v1/chat/completions: argument strings, `tool_call_id`s, `reasoning_content`;
transformers gets it as the templates expect it: arguments as objects. The golden renderings
were written by tests/data/chat_templates/make_golden.py with transformers; when transformers is
importable the test renders them again. Each template also picks its tool-call parser (the
model's architecture, then the template's markers), which must be the family's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.app import ServerSettings, create_app
from server_fakes import ROOT, ThreadedServer, post_json

pytestmark = pytest.mark.timeout(300)

DATA = ROOT / "tests" / "data" / "chat_templates"
DATE = "26 Nov 2026"             # Llama templates print today's date unless given one
# template file -> (architecture, the parser it must pick, the calls its assistant turn makes)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("Qwen2ForCausalLM", "qwen", 2),
    "Qwen-Qwen3-0.6B.jinja": ("Qwen3ForCausalLM", "qwen", 2),
    "Qwen3-Coder.jinja": ("Qwen3MoeForCausalLM", "qwen_coder", 2),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("MistralForCausalLM", "mistral", 2),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("LlamaForCausalLM", "llama", 1),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("LlamaForCausalLM", "llama", 1),
}
REASONING = {"Qwen-Qwen3-0.6B.jinja"}
CASES = ("calls", "answer")
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "days": {"type": "integer", "description": "How many days"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {
            "tz": {"type": "string", "description": "An IANA time zone"}},
            "required": ["tz"]}}},
]
# Mistral's templates require ids of exactly 9 alphanumerics; the others take any.
CALLS = [("a1b2c3d4e", "get_weather", {"city": "Paris", "days": 2}, '{"temp": 18, "sky": "sunny"}'),
         ("f5g6h7i8j", "get_time", {"tz": "Europe/Oslo"}, "12:30")]


def conversation(template: str, case: str, client_side: bool) -> list[dict]:
    """The conversation as a client sends it (client_side: argument strings) or as templates
    read it (argument objects)."""
    _, _, num_calls = TEMPLATES[template]
    reasoning = template in REASONING
    calls = CALLS[:num_calls]
    turn = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": i, "type": "function", "function": {
            "name": name, "arguments": json.dumps(args) if client_side else args}}
        for i, name, args, _ in calls]}
    if reasoning:
        turn["reasoning_content"] = "The user asks for two things."
    messages = [{"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "Weather in Paris for 2 days, and the time in Oslo?"},
                turn,
                *[{"role": "tool", "tool_call_id": i, "content": out} for i, _, _, out in calls]]
    if case == "answer":
        answer = {"role": "assistant", "content": "Paris: 18 C and sunny. Oslo: 12:30."}
        if reasoning:
            answer["reasoning_content"] = "Both results are in."
        messages += [answer, {"role": "user", "content": "Thanks!"}]
    return messages


def golden_path(template: str, case: str) -> Path:
    return DATA / "golden" / f"{Path(template).stem}.{case}.txt"


def transformers_rendering(hf_tokenizer, template: str, case: str) -> str:
    return hf_tokenizer.apply_chat_template(
        conversation(template, case, client_side=False), tools=TOOLS,
        chat_template=(DATA / template).read_text(), add_generation_prompt=True, tokenize=False,
        date_string=DATE)


@pytest.fixture(scope="module")
def servers(tokenizer):
    from test_tool_calls_server import ScriptedEngine
    out = {}
    for template, (architecture, _, _) in TEMPLATES.items():
        engine = ScriptedEngine(tokenizer, architecture)
        engine.script = "ok"
        app = create_app(engine, ServerSettings(["m"], chat_template=(DATA / template).read_text()))
        out[template] = (ThreadedServer(app), engine, app)
    yield out
    for server, _, _ in out.values():
        server.close()


from test_tool_calls_server import tokenizer  # noqa: E402,F401 (fixture)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_taper_renders_the_conversation_as_transformers_does(servers, tokenizer, template,
                                                             case):
    golden = golden_path(template, case).read_text()
    assert transformers_rendering(tokenizer.hf, template, case) == golden
    server, engine, _ = servers[template]
    status, body = post_json(server.port, "/v1/chat/completions", {
        "model": "m", "messages": conversation(template, case, client_side=True),
        "tools": TOOLS, "max_tokens": 2, "chat_template_kwargs": {"date_string": DATE}})
    assert status == 200, body
    prompt = engine.requests[body["id"]][0]
    assert tokenizer.decode(prompt, skip_special_tokens=False) == golden


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_each_template_picks_its_familys_parser(servers, template):
    _, _, app = servers[template]
    assert app.taper.tool_parser.name == TEMPLATES[template][1]


def test_the_golden_renderings_can_fail(tokenizer):
    """What the conversion does matters: argument strings left unparsed, or the reasoning
    dropped, render differently from the goldens."""
    template = "Qwen-Qwen3-0.6B.jinja"
    golden = golden_path(template, "calls").read_text()
    text = (DATA / template).read_text()
    as_sent = conversation(template, "calls", client_side=True)
    for i, m in enumerate(as_sent):       # arguments as strings...
        if m.get("tool_calls"):
            as_sent[i] = {**m, "tool_calls": [{**c, "function": {
                **c["function"], "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                         indent=1)}} for c in m["tool_calls"]]}
    assert tokenizer.hf.apply_chat_template(as_sent, tools=TOOLS, chat_template=text,
                                            add_generation_prompt=True, tokenize=False) != golden
    no_reasoning = [{k: v for k, v in m.items() if k != "reasoning_content"}
                    for m in conversation(template, "calls", client_side=False)]
    assert tokenizer.hf.apply_chat_template(no_reasoning, tools=TOOLS, chat_template=text,
                                            add_generation_prompt=True, tokenize=False) != golden


def test_other_clients_call_ids_fit_mistrals_template(servers, tokenizer):  # noqa: F811
    """Mistral's template refuses ids that are not 9 alphanumerics; OpenAI clients send
    `call_...`. Each is mapped to 9 characters of its own, the same in the call and in its
    result: the rendering is the golden one with the ids replaced."""
    import re
    template = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    messages = json.loads(json.dumps(conversation(template, "answer", client_side=True))
                          .replace("a1b2c3d4e", "call_8f2a61c0de").replace("f5g6h7i8j", "call_2"))
    server, engine, _ = servers[template]
    status, body = post_json(server.port, "/v1/chat/completions", {
        "model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert status == 200, body
    text = tokenizer.decode(engine.requests[body["id"]][0], skip_special_tokens=False)
    ids = re.findall(r'"id": "([^"]*)"', text)
    assert ids == re.findall(r'"call_id": "([^"]*)"', text)       # each result answers its call
    assert len(set(ids)) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    golden = golden_path(template, "answer").read_text()
    assert text == golden.replace("a1b2c3d4e", ids[0]).replace("f5g6h7i8j", ids[1])

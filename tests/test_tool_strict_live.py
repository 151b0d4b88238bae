"""`strict: true` tools under tool_choice "auto", on the real engine and the token mask: the
model may still answer in text, but a call it starts must follow its function's schema.

The random-weight demo model never starts a call by itself, so its start is forced with
logit_bias +100 on the format's opening token: the marker (a special token here, as in the real
checkpoints of those families) or, for the formats whose call is the whole answer, `{` / `[`.
Without strict the forced start goes nowhere (no valid call comes back); with strict the rest is
held to the grammar and the arguments validate against the schema (jsonschema)."""
from __future__ import annotations

import json
import os

import jsonschema
import numpy as np
import pytest

from server_fakes import clients_per_tool_parser

pytestmark = pytest.mark.timeout(600)

MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like?"}]
# format -> the token text that opens its call
OPENERS = {"qwen": "<tool_call>", "qwen_coder": "<tool_call>", "mistral": "[TOOL_CALLS]",
           "llama": "<|python_tag|>", "json": "{", "pythonic": "["}


def demo_with_special_markers(path: str) -> str:
    """The demo checkpoint with the formats' markers added to its tokenizer as special tokens
    (and rows for them in the embedding and the LM head)."""
    from safetensors.numpy import load_file, save_file
    from tokenizers import AddedToken, Tokenizer
    from server.demo_model import write_demo_checkpoint
    write_demo_checkpoint(path)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tc = json.load(f)
    for m in MARKERS:
        tc["added_tokens_decoder"][str(tok.token_to_id(m))] = {
            "content": m, "special": True, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    old, new = config["vocab_size"], tok.get_vocab_size()
    config["vocab_size"] = new
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    w = load_file(os.path.join(path, "model.safetensors"))
    rng = np.random.default_rng(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = (rng.standard_normal((new - old, w[name].shape[1])) * 0.04).astype(np.float32)
        w[name] = np.concatenate([w[name], extra])
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    path = demo_with_special_markers(str(tmp_path_factory.mktemp("demo") / "demo"))
    eng = AsyncEngine(EngineConfig(model=path, kv_cache_memory_mb=32))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def clients(engine):
    yield from clients_per_tool_parser(engine, OPENERS)


def ask(client, tool, max_tokens=200, **kwargs):
    # A random model spells a call in short tokens: the XML form takes up to ~150.
    return client.chat.completions.create(model="demo", messages=ASK, tools=[tool], seed=7,
                                          temperature=1.0, max_tokens=max_tokens,
                                          parallel_tool_calls=False, **kwargs).choices[0]


def opener_id(engine, fmt: str) -> int:
    ids = engine.tokenizer.encode(OPENERS[fmt], add_special_tokens=False)
    assert len(ids) == 1, (fmt, ids)
    return ids[0]


def loose(tool: dict) -> dict:
    return {"type": "function", "function": {**tool["function"], "strict": False}}


@pytest.mark.parametrize("fmt", list(OPENERS))
def test_a_started_call_follows_the_strict_schema(engine, clients, fmt):
    bias = {str(opener_id(engine, fmt)): 100}
    free = ask(clients[fmt], loose(WEATHER), max_tokens=40, logit_bias=bias)
    # The forced start alone makes no valid call: the random model goes on with gibberish.
    assert not free.message.tool_calls, free.message
    held = ask(clients[fmt], WEATHER, logit_bias=bias)
    assert held.finish_reason == "tool_calls", held
    [call] = held.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("fmt", ["qwen", "json"])
def test_strict_tools_still_let_the_model_answer_in_text(clients, fmt):
    free = ask(clients[fmt], loose(WEATHER), max_tokens=40)
    held = ask(clients[fmt], WEATHER, max_tokens=40)
    assert free.message.tool_calls is None and held.message.tool_calls is None
    assert held.message.content and held.finish_reason in ("stop", "length")


def test_a_request_constraint_rules_over_strict_tools(clients):
    """response_format constrains the whole answer, so a strict tool adds nothing to it."""
    held = ask(clients["qwen"], WEATHER, max_tokens=80, response_format={"type": "json_object"})
    assert held.message.tool_calls is None
    assert isinstance(json.loads(held.message.content), dict)


def test_responses_function_tools_on_the_real_engine(engine, clients):
    """The Responses API: function tools are strict by default, so a forced start under "auto"
    becomes a valid function_call item, and "required" makes one; streamed and not alike."""
    client = clients["qwen"]
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    args = dict(model="demo", input="What is the weather like?", tools=[tool], temperature=1.0,
                parallel_tool_calls=False, max_output_tokens=200)
    started = {"seed": 7, "logit_bias": {str(opener_id(engine, "qwen")): 100}}
    for kwargs in ({"extra_body": started}, {"tool_choice": "required",
                                             "extra_body": {"seed": 7}}):
        whole = client.responses.create(**args, **kwargs)
        [call] = [item for item in whole.output if item.type == "function_call"]
        assert call.name == "get_weather" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), tool["parameters"])
        with client.responses.stream(**args, **kwargs) as stream:
            final = stream.get_final_response()
        assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == \
            [(call.name, call.arguments)]
    loose = client.responses.create(**{**args, "tools": [{**tool, "strict": False}]},
                                    extra_body={**started})
    assert not [item for item in loose.output if item.type == "function_call"]

"""Structured outputs through the HTTP API: a real `python -m server` on the random-weight demo
checkpoint, driven by the official `openai` client. Outputs are checked by references no one here
wrote: `jsonschema` for JSON schemas, Python's `re` for regexes and grammars. The same requests
without a constraint show the checkpoint's free output is never JSON. Bad constraints are 400s
naming the parameter, and never disturb a concurrent stream."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest

from demo_live import client, demo_dir, live  # noqa: F401 (fixtures)
from server_fakes import assert_error, post_json

pytestmark = pytest.mark.timeout(300)

MSGS = [{"role": "user", "content": "Describe a person as JSON."}]


# Bounded schemas: every string, array and number has a limit, so a random model finishes.
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": [1, 2, 3]}},
             "required": ["color", "size"], "additionalProperties": False},
    "max_length": {"type": "object",
                   "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 6}},
                   "required": ["code"], "additionalProperties": False},
    "max_items": {"type": "object",
                  "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                          "items": {"type": "string", "maxLength": 5}}},
                  "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object",
               "properties": {"owner": PERSON,
                              "pet": {"type": "object",
                                      "properties": {"kind": {"enum": ["cat", "dog"]},
                                                     "owner": PERSON},
                                      "required": ["kind", "owner"],
                                      "additionalProperties": False}},
               "required": ["owner", "pet"], "additionalProperties": False},
    "ref": {"type": "object", "$defs": {"person": PERSON},
            "properties": {"a": {"$ref": "#/$defs/person"}, "b": {"$ref": "#/$defs/person"}},
            "required": ["a", "b"], "additionalProperties": False},
    "any_of": {"type": "object",
               "properties": {"value": {"anyOf": [{"type": "boolean"}, {"enum": ["none", "all"]},
                                                  {"type": "integer", "minimum": 0,
                                                   "maximum": 99}]}},
               "required": ["value"], "additionalProperties": False},
}


def chat(client, seed: int, max_tokens: int = 120, **extra):
    return client.chat.completions.create(model="demo", messages=MSGS, temperature=1.0,
                                          seed=seed, max_tokens=max_tokens, **extra)


def test_free_output_is_never_json(client):
    for seed in range(3):
        text = chat(client, seed, max_tokens=30).choices[0].message.content
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(client, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for seed in range(2):
        choice = chat(client, seed, response_format=fmt).choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_vllm_spellings_reach_the_same_grammar(client):
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    want = chat(client, 0, response_format=fmt).choices[0].message.content
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        assert chat(client, 0, extra_body=extra).choices[0].message.content == want


def test_streamed_json_and_completions(client):
    schema = SCHEMAS["any_of"]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    chunks = [c for c in chat(client, 5, stream=True, response_format=fmt) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)),
                        schema)
    schema = SCHEMAS["enum"]
    resp = client.completions.create(model="demo", prompt="Colors:", max_tokens=60, seed=1,
                                     temperature=1.0, extra_body={"guided_json": schema})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].text), schema)


def test_json_object_finished_outputs_are_objects(client):
    """Any JSON object: unbounded, so an output may run out of tokens (a `length` finish need
    not validate); every one that finishes with `stop` must parse as an object."""
    finished = 0
    for seed in range(4):
        choice = chat(client, seed, max_tokens=40,
                      response_format={"type": "json_object"}).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
        else:
            assert choice.message.content.startswith("{")
    assert finished


@pytest.mark.parametrize("field, value, pattern", [
    ("regex", r"[A-Z][a-z]{1,6} [0-9]{3}", r"[A-Z][a-z]{1,6} [0-9]{3}"),
    ("choice", ["Paris", "New York", "Rome"], r"Paris|New York|Rome"),
    ("grammar", 'start: "SELECT " COL (", " COL)* " FROM t"\nCOL: "a" | "b" | "c"',
     r"SELECT [abc](, [abc])* FROM t"),
    ("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]', r"yes|no|maybe [0-9]"),   # GBNF
])
def test_regex_choice_grammar(client, field, value, pattern):
    for seed in range(2):
        for extra in ({"structured_outputs": {field: value}}, {f"guided_{field}": value}):
            resp = client.completions.create(model="demo", prompt="Answer:", max_tokens=40,
                                             seed=seed, temperature=1.0, extra_body=extra)
            assert resp.choices[0].finish_reason == "stop"
            assert re.fullmatch(pattern, resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "only one"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "look-around"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex", "unclosed"),
    ({"guided_grammar": 'start: foo\nfoo: "a" bar'}, "guided_grammar", "unknown name"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
])
def test_bad_constraints_are_400_naming_the_param(live, extra, param, message):
    body = {"model": "demo", "messages": MSGS, "max_tokens": 5, **extra}
    status, resp = post_json(live.port, "/v1/chat/completions", body)
    assert_error(status, resp, 400, param)
    assert message in resp["error"]["message"], resp


def test_invalid_grammar_leaves_a_concurrent_stream_token_identical(client):
    def stream() -> list[str]:
        chunks = chat(client, 11, max_tokens=40, stream=True,
                      extra_body={"ignore_eos": True})
        return [c.choices[0].delta.content for c in chunks if c.choices]

    solo = stream()
    result: list[list[str]] = []
    t = threading.Thread(target=lambda: result.append(stream()))
    t.start()
    errors = 0
    while t.is_alive() or errors < 3:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, 1, max_tokens=5, extra_body={"guided_grammar": f"start: x{errors}"})
        assert e.value.body["param"] == "guided_grammar"
        errors += 1
    t.join()
    assert errors >= 3
    assert result == [solo]

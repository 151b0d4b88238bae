"""tool_choice "required" and a named function, enforced: a grammar (llguidance's Lark) for the
model's own call format, so the token mask (engine/structured_outputs.py) leaves the model no
answer but a valid call. Each call's arguments follow its function's JSON schema where the format
writes JSON (qwen, mistral, llama, json); qwen_coder and pythonic calls are held to the tool's
name and their format's syntax.

Markers that are special tokens are written by id (`<[id]>`), since no text spells them; plain
markers as literals.
"""
from __future__ import annotations

import json

from engine.structured_outputs import StructuredOutputsParams

OBJECT = {"type": "object"}
# Compact JSON: with free whitespace a weak model pads the call until max_tokens.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def tool_call_constraint(parser, tools: list[dict], choice, parallel: bool,
                         tokenizer) -> StructuredOutputsParams:
    """The grammar for `choice` ("required" or ("function", name)) in `parser`'s format."""
    named = choice[1] if isinstance(choice, tuple) else None
    fns = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    many = "+" if parallel and named is None else ""

    def marker(text: str) -> str:
        if tokenizer.has_special_tokens([text]):
            return f"<[{tokenizer.hf.convert_tokens_to_ids(text)}]>"
        return json.dumps(text)

    kind = parser.name
    if kind in ("qwen", "json", "llama"):
        args_key = "parameters" if kind == "llama" else "arguments"
        obj = f"obj: %json {json.dumps(_calls_schema(fns, args_key))}"
        if kind == "qwen":
            body = f'call{many}\ncall: {marker("<tool_call>")} "\\n" obj "\\n" ' \
                   f'{marker("</tool_call>")} "\\n"?'
        elif kind == "llama":
            body = f'{marker("<|python_tag|>")}? obj'
        else:
            body = "obj"
        return _grammar(f"start: {body}\n{obj}")
    if kind == "mistral":
        schema = {"type": "array", "items": _calls_schema(fns, "arguments"), "minItems": 1,
                  **COMPACT}
        if not many:
            schema["maxItems"] = 1
        return _grammar(f'start: {marker("[TOOL_CALLS]")} " "? arr\narr: %json {json.dumps(schema)}')
    if kind == "qwen_coder":
        rules = [f'start: call{many}',
                 f'call: {marker("<tool_call>")} "\\n" ({" | ".join(_ids(fns))}) '
                 f'{marker("</tool_call>")} "\\n"?']
        for rule, f in zip(_ids(fns), fns):
            params = [f'"<parameter={p}>\\n" {_value(schema, "xml")} "\\n</parameter>\\n"'
                      for p, schema in _properties(f)]
            body = f'({" | ".join(params)})*' if params else ""
            rules.append(f'{rule}: "<function={f["name"]}>\\n" {body} "</function>\\n"')
        return _grammar("\n".join(rules))
    if kind == "pythonic":
        sep = ' ("," " "? call)*' if many else ""
        rules = [f'start: "[" call{sep} "]"', f'call: {" | ".join(_ids(fns))}']
        for rule, f in zip(_ids(fns), fns):
            kws = [f'"{p}=" {_value(schema, "python")}' for p, schema in _properties(f)]
            args = f'(kw_{rule} ("," " "? kw_{rule})*)?' if kws else ""
            rules.append(f'{rule}: "{f["name"]}(" {args} ")"')
            if kws:
                rules.append(f'kw_{rule}: {" | ".join(kws)}')
        return _grammar("\n".join(rules))
    raise ValueError(f"tool_choice cannot be enforced for the {kind!r} format")


def _ids(fns: list[dict]) -> list[str]:
    return [f"fn{i}" for i in range(len(fns))]


def _properties(f: dict) -> list[tuple[str, dict]]:
    props = (f.get("parameters") or {}).get("properties") or {}
    return [(p, schema if isinstance(schema, dict) else {}) for p, schema in props.items()
            if isinstance(p, str) and p.isidentifier()]


def _value(schema: dict, style: str) -> str:
    """A parameter value's rule by its schema: an enum's values, integers, numbers, booleans,
    else a string (quoted in Python, raw text up to the closing tag in XML)."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        values = [json.dumps(v) if style == "python" else str(v) for v in schema["enum"]]
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    kind = schema.get("type")
    if kind == "integer":
        return r"/-?[0-9]{1,9}/"
    if kind == "number":
        return r"/-?[0-9]{1,9}(\.[0-9]{1,9})?/"
    if kind == "boolean":
        return '("True" | "False")' if style == "python" else '("true" | "false")'
    if style == "python":
        return r'/"([^"\\\n]|\\.)*"/'
    return r"/[^<]*/"


def _calls_schema(fns: list[dict], args_key: str) -> dict:
    """One call object: {"name": one of the functions, args_key: that function's arguments}."""
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": f["name"]},
                                      args_key: f.get("parameters") or OBJECT},
                       "required": ["name", args_key], "additionalProperties": False}
                      for f in fns], **COMPACT}


def _grammar(lark: str) -> StructuredOutputsParams:
    return StructuredOutputsParams("grammar", lark)

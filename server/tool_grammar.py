"""Tool calls enforced by the token mask: a grammar (llguidance's Lark) for the model's own call
format, compiled by structured outputs (engine/sampling/structured_outputs.py).

- tool_choice "required" or a named function (`tool_call_constraint`): the whole output is the
  call(s), so the model has no answer but a valid call (a model that reasons in plain-text
  `<think>` tags, as Qwen3 does, may reason first).
- `strict: true` tools under tool_choice "auto" (`strict_call_constraint`): a lazy grammar, as
  llama.cpp's grammar triggers are. The model may answer in text, but once it writes the
  format's start (a marker such as `<tool_call>` anywhere in the text, or for the formats whose
  call is the whole answer, `{` / `[` as its first character) the call must follow its
  function's schema. A marker inside the model's own plain-text `<think>` reasoning starts no
  call, as the parsers read none there.

Each call's arguments follow its function's JSON schema where the format writes JSON (qwen,
mistral, llama, json); qwen_coder and pythonic calls are held to the tool's name, its parameter
names and their value types, in their format's syntax.

Markers that are special tokens are written by id (`<[id]>`), since no text spells them; plain
markers as literals (and, as triggers, as lazy lexemes: free text ends at the marker's first
occurrence).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.sampling.structured_outputs import StructuredOutputsParams

OBJECT = {"type": "object"}
# Compact JSON: with free whitespace a weak model pads the call until max_tokens.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
# Text the model may write before a call, or instead of one.
TEXT = r"TEXT: /(.|\n)*/"
# A reasoning model's <think>...</think> before its call.
THOUGHT = "thought[lazy]: /\\s*<think>(.|\\n)*<\\/think>/"
KW_SEP = '"," " "?'           # between a Python call's keyword arguments
# An XML parameter's text value with its closing tag, as one lazy lexeme: it ends at the first
# closing tag, as the parser reads it. (A value regex followed by the tag as its own lexeme
# could never end: the greedy value would swallow the newline before the tag.)
XML_TEXT = r"xml_text[lazy]: /(.|\n)*\n<\/parameter>\n/"


@dataclass(slots=True)
class CallGrammar:
    """A format's call grammar, in the pieces the two constraints assemble."""
    rules: list[str]          # rules every form shares (the call, its functions, its objects)
    calls: str                # one call, or several when parallel: what "required" asks for
    marker: str | None = None     # a call starts at this marker anywhere in the text ...
    after_marker: str = ""        # ... and goes on with this (the first call's rest, the others)
    openers: str = ""             # else a call is the whole answer, starting with one of these
    opener_marker: str | None = None   # ... or with this marker


def tool_call_constraint(parser, tools: list[dict], choice, parallel: bool,
                         tokenizer) -> StructuredOutputsParams:
    """The grammar for `choice` ("required" or ("function", name)) in `parser`'s format."""
    named = choice[1] if isinstance(choice, tuple) else None
    fns = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    g = call_grammar(parser.name, fns, parallel and named is None, tokenizer, schemas=True)
    if _thinks(tokenizer):       # the model may reason first, then it must call
        return _grammar("\n".join(["%llguidance {}", f"start: thought? WS? {g.calls}",
                                   "WS: /\\s+/", THOUGHT, *g.rules]))
    return _grammar("\n".join([f"start: {g.calls}", *g.rules]))


def strict_call_constraint(parser, tools: list[dict], parallel: bool,
                           tokenizer) -> StructuredOutputsParams | None:
    """tool_choice "auto" with `strict: true` tools: free text, or calls that start at the
    format's trigger and then follow the grammar. Strict functions' arguments follow their
    schemas, the others' are any object. None when no tool is strict."""
    fns = [t["function"] for t in tools]
    if not any(f.get("strict") is True for f in fns):
        return None
    g = call_grammar(parser.name, fns, parallel, tokenizer, schemas=False)
    if g.marker is not None:
        # A marker inside the model's own <think> reasoning starts no call (parsers read none
        # there): the text before a call is not an open <think>.
        thinks = _thinks(tokenizer)
        if tokenizer.has_special_tokens([g.marker]):   # free text cannot hold a special token
            start = [f"start: TEXT | BEFORE {_marker(g.marker, tokenizer)} {g.after_marker}",
                     f"BEFORE: {_text_ending(thinks, '')}"]
        else:
            start = [f"start: TEXT | trigger {g.after_marker}",
                     f"trigger[lazy]: {_text_ending(thinks, re.escape(g.marker))}"]
        return _grammar("\n".join(["%llguidance {}", *start, TEXT, *g.rules]))
    # The call is the whole answer (after the reasoning, if any): any text that does not open
    # with it, or the calls. Plain text never opens with <think>, so the reasoning is
    # `thought`'s alone.
    plain = f"/\\s*([^\\s{re.escape(g.openers)}](.|\\n)*)?/"
    if g.opener_marker and not tokenizer.has_special_tokens([g.opener_marker]):
        plain += f" & ~/\\s*{re.escape(g.opener_marker)}(.|\\n)*/"
    if not _thinks(tokenizer):
        return _grammar("\n".join(["%llguidance {}", f"start: PLAIN | {g.calls}",
                                   f"PLAIN: {plain}", *g.rules]))
    plain += " & ~/\\s*<think>(.|\\n)*/"
    return _grammar("\n".join(["%llguidance {}", f"start: thought? (PLAIN | WS? {g.calls})",
                               f"PLAIN: {plain}", "WS: /\\s+/", THOUGHT, *g.rules]))


def call_grammar(kind: str, fns: list[dict], many: bool, tokenizer,
                 schemas: bool) -> CallGrammar:
    """The call rules of format `kind` for the functions `fns`; `many`: one or more calls.
    `schemas`: every function's arguments follow its schema (else only strict ones')."""
    plus, star = ("+", " call*") if many else ("", "")

    def marker(text: str) -> str:
        return _marker(text, tokenizer)

    if kind in ("qwen", "json", "llama"):
        args_key = "parameters" if kind == "llama" else "arguments"
        obj = f"obj: %json {json.dumps(_calls_schema(fns, args_key, schemas))}"
        if kind == "qwen":
            rest = f'"\\n" obj "\\n" {marker("</tool_call>")} "\\n"?'
            return CallGrammar([obj, f'call: {marker("<tool_call>")} body', f"body: {rest}"],
                               f"call{plus}", "<tool_call>", f"body{star}")
        if kind == "llama":
            return CallGrammar([obj], f'{marker("<|python_tag|>")}? obj', openers="{",
                               opener_marker="<|python_tag|>")
        return CallGrammar([obj], "obj", openers="{[")
    if kind == "mistral":
        schema = {"type": "array", "items": _calls_schema(fns, "arguments", schemas),
                  "minItems": 1, **COMPACT}
        if not many:
            schema["maxItems"] = 1
        return CallGrammar([f"arr: %json {json.dumps(schema)}"],
                           f'{marker("[TOOL_CALLS]")} " "? arr', "[TOOL_CALLS]", '" "? arr')
    if kind == "qwen_coder":
        rules = [f'call: {marker("<tool_call>")} body',
                 f'body: "\\n" ({" | ".join(_ids(fns))}) {marker("</tool_call>")} "\\n"?',
                 XML_TEXT]
        for rule, f in zip(_ids(fns), fns):
            params = [(f'"<parameter={p}>\\n" {_xml_value(schema)}', req)
                      for p, schema, req in _properties(f)]
            rules.append(f'{rule}: "<function={f["name"]}>\\n" {_sequence(params, "")} '
                         '"</function>\\n"')
        return CallGrammar(rules, f"call{plus}", "<tool_call>", f"body{star}")
    if kind == "pythonic":
        sep = ' ("," " "? call)*' if many else ""
        rules = [f'calls: "[" call{sep} "]"', f'call: {" | ".join(_ids(fns))}']
        for rule, f in zip(_ids(fns), fns):
            kws = [(f'"{p}=" {_value(schema, "python")}', req) for p, schema, req in _properties(f)]
            rules.append(f'{rule}: "{f["name"]}(" {_sequence(kws, KW_SEP)} ")"')
        return CallGrammar(rules, "calls", openers="[", opener_marker="<|python_start|>")
    raise ValueError(f"tool calls cannot be enforced for the {kind!r} format")


def _thinks(tokenizer) -> bool:
    """Whether the model reasons in <think> tags that are plain text (Qwen3's)."""
    return tokenizer.has_tokens(("<think>", "</think>")) and \
        not tokenizer.has_special_tokens(["<think>", "</think>"])


def _text_ending(thinks: bool, end: str) -> str:
    """A lexeme: any text that ends with the regex `end`; where the model reasons in plain
    <think> tags, one whose end is not inside an open <think>."""
    if not thinks:
        return f"/(.|\\n)*{end}/"
    return (f"/(.|\\n)*{end}/ & ~/\\s*<think>(.|\\n)*/ | "
            f"/\\s*<think>(.|\\n)*<\\/think>(.|\\n)*{end}/")


def _marker(text: str, tokenizer) -> str:
    if tokenizer.has_special_tokens([text]):
        return f"<[{tokenizer.hf.convert_tokens_to_ids(text)}]>"
    return json.dumps(text)


def _ids(fns: list[dict]) -> list[str]:
    return [f"fn{i}" for i in range(len(fns))]


def _properties(f: dict) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of each parameter, in the schema's order."""
    params = f.get("parameters") or {}
    props = params.get("properties") or {}
    required = params.get("required") if isinstance(params.get("required"), list) else []
    return [(p, schema if isinstance(schema, dict) else {}, p in required)
            for p, schema in props.items() if isinstance(p, str) and p.isidentifier()]


def _sequence(items: list[tuple[str, bool]], sep: str) -> str:
    """Each parameter at most once, in the schema's order, the required ones always: the
    required ones first, then the optional ones, each optional. Without a required one, any
    of them in any order (a repeat is possible there)."""
    if not items:
        return ""
    required = [rule for rule, req in items if req]
    optional = [rule for rule, req in items if not req]
    sep = f"{sep} " if sep else ""
    if not required:
        one = "(" + " | ".join(optional) + ")"
        return f"({one} ({sep}{one})*)?"
    return " ".join([f" {sep}".join(required)] + [f"({sep}{rule})?" for rule in optional])


def _xml_value(schema: dict) -> str:
    """An XML parameter's value and closing tag: typed values by their rule, text lazily."""
    typed = (isinstance(schema.get("enum"), list) and schema["enum"]) or \
        schema.get("type") in ("integer", "number", "boolean")
    return f'{_value(schema, "xml")} "\\n</parameter>\\n"' if typed else "xml_text"


def _value(schema: dict, style: str) -> str:
    """A parameter value's rule by its schema: an enum's values, integers, numbers, booleans,
    else (Python only; XML text is `xml_text`) a quoted string."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        values = [json.dumps(v) if style == "python" else str(v) for v in schema["enum"]]
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    kind = schema.get("type")
    if kind in ("integer", "number"):     # JSON's number text is Python's and the XML value's
        bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum",
                                         "exclusiveMaximum") if k in schema}
        return f"%json {json.dumps({'type': kind, **bounds})}"
    if kind == "boolean":
        return '("True" | "False")' if style == "python" else '("true" | "false")'
    return r'/"([^"\\\n]|\\.)*"/'


def _calls_schema(fns: list[dict], args_key: str, schemas: bool) -> dict:
    """One call object: {"name": one of the functions, args_key: that function's arguments}
    (its schema when `schemas` or the function is strict, else any object)."""
    def args(f: dict) -> dict:
        return (f.get("parameters") or OBJECT) if schemas or f.get("strict") is True else OBJECT
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": f["name"]}, args_key: args(f)},
                       "required": ["name", args_key], "additionalProperties": False}
                      for f in fns], **COMPACT}


def _grammar(lark: str) -> StructuredOutputsParams:
    return StructuredOutputsParams("grammar", lark)

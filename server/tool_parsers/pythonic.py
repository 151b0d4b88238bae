"""Pythonic calls (Llama 3.2 small models, Llama 4): the whole answer is a Python list of calls,
`[get_weather(city="Paris"), add(a=1, b=2)]`, optionally inside `<|python_start|>` ...
`<|python_end|>`. Keyword arguments must be literals; they become a JSON object. A call joins
the result when its closing parenthesis arrives, with its whole arguments at once."""
from __future__ import annotations

import ast
import json
import re

from server.tool_parsers.base import Parsed, ToolCall, ToolParser
from server.tool_parsers.json_scan import skip_ws

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"
CALL_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
# A prefix of text that CALL_START could still match once more text arrives.
CALL_START_PREFIX = re.compile(r"\[\s*([A-Za-z_][\w.]*\s*)?$")


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = (START_TAG, END_TAG)

    def scan(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(START_TAG, i):
            i = skip_ws(text, i + len(START_TAG))
        elif START_TAG.startswith(text[i:]) and i < len(text) and not final:
            return Parsed()
        body = text[i:]
        if not CALL_START.match(body):
            if not final and (not body or CALL_START_PREFIX.match(body)):
                return Parsed()
            return Parsed(content=text)
        calls, closed = _calls(body)
        if final and not calls:
            return Parsed(content=text)
        return Parsed(calls=calls)


def _calls(body: str) -> tuple[list[ToolCall], bool]:
    """The complete calls in the list that opens body[0], and whether the list is closed."""
    calls = []
    i = skip_ws(body, 1)
    while i < len(body):
        end = _call_end(body, i)
        if end is None:
            return calls, False
        call = _to_call(body[i:end])
        if call is None:
            return calls, False
        calls.append(call)
        i = skip_ws(body, end)
        if i < len(body) and body[i] == ",":
            i = skip_ws(body, i + 1)
        elif i < len(body) and body[i] == "]":
            return calls, True
    return calls, False


def _call_end(text: str, i: int) -> int | None:
    """Index after the call starting at text[i] (its name, then balanced parentheses with
    Python strings inside), or None if it has not ended."""
    depth, j, quote = 0, i, None
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif text.startswith(quote, j):
                j += len(quote) - 1
                quote = None
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, j) else c
            j += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
            if depth < 0:
                return None
        j += 1
    return None


def _to_call(source: str) -> ToolCall | None:
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        return None
    if name is None:
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None

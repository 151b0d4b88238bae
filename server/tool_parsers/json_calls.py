"""Bare JSON calls: the whole answer is `{"name": ..., "arguments": {...}}` (or "parameters",
or `{"function": {...}}`), or an array of them. Anything else, including JSON whose first key
is not "name" or "function" and JSON inside a code fence, is content."""
from __future__ import annotations

from server.tool_parsers.base import Parsed, ToolParser, json_calls, starts_call_object
from server.tool_parsers.json_scan import skip_ws


class JsonToolParser(ToolParser):
    name = "json"

    def scan(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        first = i
        if i < len(text) and text[i] == "[":
            i = skip_ws(text, i + 1)
        is_call = starts_call_object(text, i)
        if is_call is None and not final:
            return Parsed()
        if is_call:
            calls = json_calls(text[first:], final)
            if calls or not final:
                return Parsed(calls=calls)
        return Parsed(content=text)

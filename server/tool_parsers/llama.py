"""Llama 3.x: a JSON call `{"name": ..., "parameters": {...}}` as the whole answer (several
separated by `;`), optionally after `<|python_tag|>`; and `<function=name>{...}</function>`
blocks anywhere in the text. A JSON answer whose first key is not "name" (or "function") is
content, as is JSON inside a code fence."""
from __future__ import annotations

import re

from server.tool_parsers.base import (Member, Parsed, ToolCall, ToolParser, arguments_text,
                                      json_calls, scan_blocks, starts_call_object)
from server.tool_parsers.json_scan import skip_ws, value_end

FUNCTION_TAG = re.compile(r"<function=([^>\n]+)>")


class LlamaToolParser(ToolParser):
    name = "llama"
    markers = ("<|python_tag|>",)
    PYTHON_TAG = "<|python_tag|>"
    FUNCTION_START, FUNCTION_END = "<function=", "</function>"

    def scan(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = skip_ws(text, i + len(self.PYTHON_TAG))
        elif self.PYTHON_TAG.startswith(text[i:]) and text[i:] and not final:
            return Parsed()
        is_call = starts_call_object(text, i)
        if is_call is None and not final:
            return Parsed()
        if is_call:
            return Parsed(calls=json_calls(text[i:], final))
        return scan_blocks(text, self.FUNCTION_START, self.FUNCTION_END, final,
                           self._function_block)

    def _function_block(self, body: str, complete: bool) -> list[ToolCall]:
        close = body.find(">")
        if close < 0 or not body[:close].strip():
            return []
        name = body[:close].strip()
        start = skip_ws(body, close + 1)
        if start >= len(body):
            return [ToolCall(name, "")]
        end, done = value_end(body, start)
        return [ToolCall(name, arguments_text(body, Member("", start, end, done)))]

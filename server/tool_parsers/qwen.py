"""Qwen 2.5 / Qwen 3 (Hermes style): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, text around them as content."""
from __future__ import annotations

from server.tool_parsers.base import Parsed, ToolParser, json_calls, scan_blocks


class QwenToolParser(ToolParser):
    name = "qwen"
    markers = ("<tool_call>", "</tool_call>")
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Parsed:
        return scan_blocks(text, self.START, self.END, final, json_calls)

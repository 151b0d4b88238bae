"""Mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects, or (v11+
tokenizers) `[TOOL_CALLS]name[ARGS]{...}` once per call. Text before the first marker is
content. Tool-call ids are 9 alphanumerics, as Mistral's chat templates require."""
from __future__ import annotations

from server.tool_parsers.base import Parsed, ToolCall, ToolParser, json_calls, scan_blocks
from server.tool_parsers.json_scan import Member, skip_ws, value_end
from server.tool_parsers.base import arguments_text


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]")
    id_style = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> Parsed:
        return scan_blocks(text, self.START, None, final, self._body)

    def _body(self, body: str, complete: bool) -> list[ToolCall]:
        k = body.find(self.ARGS)
        if k < 0:
            return json_calls(body, complete)
        name = body[:k].strip()
        if not name:
            return []
        start = skip_ws(body, k + len(self.ARGS))
        if start >= len(body):
            return [ToolCall(name, "")]
        end, done = value_end(body, start)
        return [ToolCall(name, arguments_text(body, Member("", start, end, done)))]

"""Qwen3-Coder: XML-style calls,
    <tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>
Values are text; they become JSON by the tool's schema: integers, numbers, booleans, null,
objects and arrays are parsed, anything else (or a value that does not parse) stays a string.
The arguments object is written `{"p": v, "q": w}`: a parameter joins it when its closing tag
arrives and `}` when the function's does, so streamed prefixes stay prefixes."""
from __future__ import annotations

import json
import re

from server.tool_parsers.base import Parsed, ToolCall, ToolParser, scan_blocks

FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class QwenCoderToolParser(ToolParser):
    name = "qwen_coder"
    markers = ("<tool_call>", "</tool_call>")
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Parsed:
        return scan_blocks(text, self.START, self.END, final, self._body)

    def _body(self, body: str, complete: bool) -> list[ToolCall]:
        calls = []
        for m in FUNCTION.finditer(body):
            name = m.group(1).strip()
            end = body.find("</function>", m.end())
            inner = body[m.end():] if end < 0 else body[m.end():end]
            members = [f"{json.dumps(p.strip())}: {json.dumps(self._value(name, p.strip(), v))}"
                       for p, v in PARAMETER.findall(inner)]
            closed = end >= 0 or complete
            calls.append(ToolCall(name, "{" + ", ".join(members) + ("}" if closed else "")))
            if end < 0:
                break
        return calls

    def _value(self, function: str, param: str, raw: str):
        text = raw.strip("\n")
        schema = (self.tools.get(function, {}).get("parameters") or {}).get("properties", {})
        kind = (schema.get(param) or {}).get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "string" in kinds and len(kinds) == 1:
            return text
        if text == "null" and "null" in kinds:
            return None
        for k in kinds:
            parsed = _coerce(k, text.strip())
            if parsed is not _FAIL:
                return parsed
        return text


_FAIL = object()


def _coerce(kind, text: str):
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            value = float(text)
            return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            value = json.loads(text)
            return value if isinstance(value, dict if kind == "object" else list) else _FAIL
    except ValueError:
        pass
    return _FAIL

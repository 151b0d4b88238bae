"""What every tool-call parser shares: the parse result, the marker-block scan, and the stream.

A parser has one method, `scan(text, final)`: the content and the calls in the text so far. When
`final` is false the text may still grow, so the content leaves out whatever could yet become a
marker (or lies inside an unfinished call), and a call appears once its name is complete, with
the arguments written so far. Each parser keeps one promise: what a scan of a prefix returns is a
prefix of what a scan of the whole returns (content, the list of calls, each call's arguments).
`ToolCallStream` then turns successive scans into OpenAI's deltas by sending only what is new,
and the streamed deltas concatenate to exactly the non-streamed message by construction.

Both modes finish the same way (`finalize`): content without surrounding whitespace (None when
empty), and "{}" for a call that brought no arguments.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

from server.tool_parsers.json_scan import (Member, loads_or_none, object_members, skip_ws,
                                           string_end)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str        # JSON text (while streaming: the part written so far)


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    name = ""
    markers: tuple[str, ...] = ()   # its marker strings (which may be special tokens)
    id_style = "openai"       # "openai": call_ + 24 hex digits; "mistral": 9 alphanumerics

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []
                      if isinstance(t, dict) and isinstance(t.get("function"), dict)
                      and "name" in t["function"]}

    def scan(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output: (content, calls), finished."""
        parsed = self.scan(text, final=True)
        content = parsed.content.strip()
        return content or None, [ToolCall(c.name, c.arguments or "{}") for c in parsed.calls]


# ---- scanning helpers shared by the parsers

def holdback(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest end of `text` that is the start of some marker begins (len(text) when
    none is): text from there on may still become a marker, so it is not content yet."""
    for i in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return i
    return len(text)


def scan_blocks(text: str, start: str, end: str | None, final: bool,
                parse_body: Callable[[str, bool], list[ToolCall]],
                other_markers: tuple[str, ...] = ()) -> Parsed:
    """Calls inside `start`...`end` blocks (end None: a block runs to the next start or to the
    end of the text), content outside them. parse_body(body, body_complete) returns the body's
    calls. A block with no call in it is content, once it is complete (or the text is final)."""
    out = Parsed()
    i = 0
    while True:
        j = text.find(start, i)
        if j < 0:
            tail = text[i:]
            out.content += tail if final else tail[:holdback(tail, (start, *other_markers))]
            return out
        out.content += text[i:j]
        body_start = j + len(start)
        k = text.find(end if end is not None else start, body_start)
        complete = k >= 0 or (end is None and final)
        stop = len(text) if k < 0 else k
        calls = parse_body(text[body_start:stop], complete or final)
        if calls:
            out.calls += calls
        elif complete or final:
            out.content += text[j:stop + (len(end) if end is not None and k >= 0 else 0)]
        else:
            return out               # an unfinished block without a call yet: hold it
        if k < 0:
            return out
        i = k + (len(end) if end is not None else 0)


def json_call(text: str, i: int) -> tuple[ToolCall | None, int | None]:
    """The call object whose `{` is text[i]: {"name", "arguments" | "parameters"}, or
    {"function": {...the same...}} (also with "type": "function"). Returns (the call once its
    name is complete, else None; the index after the object, None while it is open)."""
    members, end = object_members(text, i)
    by_key = {m.key: m for m in members}
    fn = by_key.get("function")
    if fn is not None and fn.start < len(text) and text[fn.start] == "{":
        call, _ = json_call(text, fn.start)
        return call, end
    name = by_key.get("name")
    if name is None or not name.complete:
        return None, end
    name_value = loads_or_none(text[name.start:name.end])
    if not isinstance(name_value, str) or not name_value:
        return None, end
    args = by_key.get("arguments", by_key.get("parameters"))
    args_text = "" if args is None else arguments_text(text, args)
    if end is not None and not args_text:    # the object closed without arguments
        args_text = "{}"
    return ToolCall(name_value, args_text), end


def arguments_text(text: str, m: Member) -> str:
    """The arguments as JSON text: the value's raw text as written (so streamed prefixes stay
    prefixes), or a string's decoded content when the model wrote the JSON as a string (only
    once the string is complete); "" for null (the caller makes it "{}")."""
    raw = text[m.start:m.end]
    if raw.startswith('"'):
        value = loads_or_none(raw) if m.complete else None
        return value if isinstance(value, str) else ""
    if raw[:1] in ("{", "["):
        return raw
    return raw if m.complete and raw != "null" else ""   # a literal waits to be whole


def json_calls(body: str, complete: bool, separators: str = ",;") -> list[ToolCall]:
    """Call objects one after another in `body`, optionally inside one JSON array, separated by
    whitespace or the given separators. Stops at the first thing that is not a call object."""
    calls = []
    i = skip_ws(body, 0)
    in_array = i < len(body) and body[i] == "["
    if in_array:
        i = skip_ws(body, i + 1)
    while i < len(body) and body[i] == "{":
        call, end = json_call(body, i)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        i = skip_ws(body, end)
        while i < len(body) and body[i] in separators:
            i = skip_ws(body, i + 1)
    return calls


def starts_call_object(text: str, i: int) -> bool | None:
    """Whether the object starting at text[i] may be a call: True once its first key reads
    "name", "function" or "type", False as soon as it cannot (another key, not an object), None while the
    text is too short to tell."""
    if i >= len(text):
        return None
    if text[i] != "{":
        return False
    j = skip_ws(text, i + 1)
    if j >= len(text):
        return None
    if text[j] != '"':
        return False
    k = string_end(text, j)
    if k < 0:
        return None if any(key.startswith(text[j + 1:]) for key in CALL_KEYS) else False
    return loads_or_none(text[j:k]) in CALL_KEYS


CALL_KEYS = ("name", "function", "type")   # {"type": "function", "function": {...}}


# ---- ids

def tool_call_id(style: str, request_id: str, index: int) -> str:
    """A call's id, derived from the request's id and the call's index: unique within a
    response, the same in its streamed and folded forms."""
    digest = hashlib.sha256(f"{request_id}:{index}".encode()).digest()
    if style == "mistral":    # Mistral's templates require exactly 9 alphanumerics
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        return "".join(alphabet[b % len(alphabet)] for b in digest[:9])
    return "call_" + digest.hex()[:24]


# ---- streaming

@dataclass(slots=True)
class DeltaMessage:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI's delta.tool_calls items


class ToolCallStream:
    """Feeds text deltas to a parser and returns what is new as OpenAI deltas: per call, a first
    delta with index, id, type and the whole name, then argument text only."""

    def __init__(self, parser: ToolParser, request_id: str):
        self.parser, self.request_id = parser, request_id
        self.text = ""
        self.sent_content = 0
        self.sent_args: list[int] = []      # argument characters sent, per call

    @property
    def num_calls(self) -> int:
        return len(self.sent_args)

    def feed(self, delta: str) -> DeltaMessage:
        self.text += delta
        return self._new(self.parser.scan(self.text, final=False), final=False)

    def finish(self) -> DeltaMessage:
        return self._new(self.parser.scan(self.text, final=True), final=True)

    def _new(self, parsed: Parsed, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        content = parsed.content.lstrip()
        content = content[:len(content.rstrip())]     # trailing whitespace waits for more
        out.content = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        for index, call in enumerate(parsed.calls):
            args = call.arguments or ("{}" if final else "")
            if index == len(self.sent_args):
                self.sent_args.append(0)
                out.tool_calls.append({
                    "index": index, "type": "function",
                    "id": tool_call_id(self.parser.id_style, self.request_id, index),
                    "function": {"name": call.name, "arguments": ""}})
            new_args = args[self.sent_args[index]:]
            if new_args:
                self.sent_args[index] = len(args)
                if out.tool_calls and out.tool_calls[-1]["index"] == index:
                    out.tool_calls[-1]["function"]["arguments"] += new_args
                else:
                    out.tool_calls.append({"index": index, "function": {"arguments": new_args}})
        return out

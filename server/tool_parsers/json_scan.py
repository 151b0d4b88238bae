"""Scanning JSON that may still be arriving: where a value ends, and an object's members so far.

Tool-call parsers read model output a delta at a time. They need to know, for a prefix of the
text, which members of a call object are complete (the function's name) and how far a value has
come (the arguments, streamed as their raw text). The raw text of a value, as the model wrote
it, is what Taper returns as `arguments`: every prefix of it is then a prefix of the final
string, so the streamed argument deltas concatenate to exactly the non-streamed arguments.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> tuple[int, bool]:
    """The JSON value starting at text[i]: (end, complete). Complete: text[i:end] is the whole
    value (a string to its closing quote, an object or array to its closing bracket, a number or
    literal up to a delimiter). Incomplete: end == len(text), the value may go on."""
    if i >= len(text):
        return i, False
    c = text[i]
    if c == '"':
        j = string_end(text, i)
        return (j, True) if j >= 0 else (len(text), False)
    if c in _CLOSE:
        stack = []
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                k = string_end(text, j)
                if k < 0:
                    return len(text), False
                j = k
                continue
            if ch in _CLOSE:
                stack.append(_CLOSE[ch])
            elif ch in "}]":
                if not stack or stack.pop() != ch:   # mismatched: the value ends, malformed
                    return j + 1, True
                if not stack:
                    return j + 1, True
            j += 1
        return len(text), False
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j, j < len(text)


def string_end(text: str, i: int) -> int:
    """text[i] is a quote: the index after the closing quote, or -1 if it has not come yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return -1


@dataclass(slots=True)
class Member:
    key: str
    start: int         # where the value starts in the text
    end: int           # where it ends (the text's end when incomplete)
    complete: bool


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the object whose `{` is text[i], as far as the text goes: every complete
    member and at most one incomplete last one (its key complete, its value started). Returns
    (members, end): end is the index after the closing `}`, or None while the object is open or
    when it is malformed (then the members are those read before the fault)."""
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return members, None
        k = string_end(text, j)
        if k < 0:
            return members, None
        try:
            key = json.loads(text[j:k])
        except ValueError:
            return members, None
        j = skip_ws(text, k)
        if j >= len(text) or text[j] != ":":
            return members, None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        end, complete = value_end(text, j)
        members.append(Member(key, j, end, complete))
        if not complete:
            return members, None
        j = skip_ws(text, end)
    return members, None


def loads_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None

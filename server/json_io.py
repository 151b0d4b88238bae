"""JSON in and out of the server without stalling the event loop on a large body.

The json module's C parser and encoder hold the GIL from start to end: parsing a 12 MB logit_bias
or serializing a 47 MB response on a worker thread still stops the event loop for one to two
seconds (every other stream, /health). So large bodies are parsed and written in pieces on a
worker thread: objects and arrays are walked here, in Python, and only their leaves (strings,
numbers, and flat runs of them) go through the C code, each a short call. Between pieces the
interpreter hands the GIL to the event loop every few milliseconds. The pieces cost about twice
what one C call would, so bodies below SMALL_BYTES (and objects of fewer than SMALL_NODES
values) are parsed and written as before, at once.

`loads` is exactly json.loads (the same values and errors), and `dumps` exactly json.dumps with
ensure_ascii=False (the same text).
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from json.decoder import JSONDecodeError, scanstring

from quart import Response

SMALL_BYTES = 256 * 1024        # a body parsed with one C call
PARSE_THREADS = 2               # large bodies parsed at once
SMALL_NODES = 4096              # values in an object written with one C call
_FLAT_RUN = 4096                # scalars of one array written per C call
_PIECE_NODES = 256              # values in a piece written with one C call

_WS = re.compile(r"[ \t\n\r]*")
_decoder = json.JSONDecoder()
_scan_scalar = json.scanner.make_scanner(_decoder)     # the C scanner where there is one
# (encode, item separator, key separator): json.dumps's default spacing, and compact
_STYLES = {False: (json.JSONEncoder(ensure_ascii=False).encode, ", ", ": "),
           True: (json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode, ",", ":")}
_encode = _STYLES[False][0]
_SCALARS = (str, int, float, bool, type(None))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


# ---- parsing

def loads(raw: bytes | str):
    """json.loads, in pieces when the text is large."""
    if len(raw) <= SMALL_BYTES:
        return json.loads(raw)
    if isinstance(raw, (bytes, bytearray)):
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    else:
        text = raw
        if text.startswith("\ufeff"):
            raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    try:
        value, end = _value(text, _skip(text, 0))
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    end = _skip(text, end)
    if end != len(text):
        raise JSONDecodeError("Extra data", text, end)
    return value


def _skip(s: str, idx: int) -> int:
    return _WS.match(s, idx).end()


def _value(s: str, idx: int):
    try:
        c = s[idx]
    except IndexError:
        raise JSONDecodeError("Expecting value", s, idx) from None
    if c == "{":
        return _object(s, idx + 1)
    if c == "[":
        return _array(s, idx + 1)
    try:
        return _scan_scalar(s, idx)
    except StopIteration as e:
        raise JSONDecodeError("Expecting value", s, e.value) from None


def _object(s: str, idx: int):
    obj = {}
    idx = _skip(s, idx)
    if s[idx:idx + 1] == "}":
        return obj, idx + 1
    while True:
        if s[idx:idx + 1] != '"':
            raise JSONDecodeError("Expecting property name enclosed in double quotes", s, idx)
        key, idx = scanstring(s, idx + 1)
        idx = _skip(s, idx)
        if s[idx:idx + 1] != ":":
            raise JSONDecodeError("Expecting ':' delimiter", s, idx)
        obj[key], idx = _value(s, _skip(s, idx + 1))
        idx = _skip(s, idx)
        c = s[idx:idx + 1]
        if c == "}":
            return obj, idx + 1
        if c != ",":
            raise JSONDecodeError("Expecting ',' delimiter", s, idx)
        idx = _skip(s, idx + 1)


def _array(s: str, idx: int):
    out = []
    idx = _skip(s, idx)
    if s[idx:idx + 1] == "]":
        return out, idx + 1
    while True:
        value, idx = _value(s, idx)
        out.append(value)
        idx = _skip(s, idx)
        c = s[idx:idx + 1]
        if c == "]":
            return out, idx + 1
        if c != ",":
            raise JSONDecodeError("Expecting ',' delimiter", s, idx)
        idx = _skip(s, idx + 1)


async def parse(raw: bytes, fn):
    """fn(raw): parsing and validating a request body; for a large body on one of
    PARSE_THREADS threads (where it should call `loads`: a parsed body takes a few times its
    size, so only that many are parsed at once), at once for a small one."""
    if len(raw) <= SMALL_BYTES:
        return fn(raw)
    return await asyncio.get_running_loop().run_in_executor(_parse_pool(), fn, raw)


def _parse_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="taper-parse")
        return _pool


# ---- writing

def dumps(obj, compact: bool = False) -> str:
    """json.dumps(obj, ensure_ascii=False) (compact: with separators (",", ":")), in pieces
    when the object is large."""
    style = _STYLES[compact]
    if is_small(obj):
        return style[0](obj)
    out: list[str] = []
    _write(obj, out, style)
    return "".join(out)


def is_small(obj, limit: int = SMALL_NODES) -> bool:
    """Fewer than `limit` values in all (counting stops there): written with one C call."""
    left = limit
    stack = [obj]
    while stack:
        item = stack.pop()
        left -= 1
        if left < 0:
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def _write(obj, out: list[str], style) -> None:
    encode, item_sep, key_sep = style
    if is_small(obj, _PIECE_NODES):         # a short C call
        out.append(encode(obj))
    elif isinstance(obj, dict):
        out.append("{")
        first = True
        for key, value in obj.items():
            if not first:
                out.append(item_sep)
            first = False
            if not isinstance(key, str):     # json's own key rules (numbers, bools, None)
                key = encode({key: None})[2:-len(key_sep) - len("null}") - 1]
            out.append(encode(key))
            out.append(key_sep)
            _write(value, out, style)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        i, n = 0, len(obj)
        while i < n:
            if i:
                out.append(item_sep)
            j = i
            while j < n and j - i < _FLAT_RUN and isinstance(obj[j], _SCALARS):
                j += 1
            if j > i:                        # a run of scalars: one C call
                out.append(encode(list(obj[i:j]))[1:-1])
                i = j
            else:
                _write(obj[i], out, style)
                i += 1
        out.append("]")
    else:
        out.append(encode(obj))


async def response(obj, status: int = 200) -> Response:
    """A JSON response, written on a worker thread when the object is large."""
    text = _encode(obj) if is_small(obj) else await asyncio.to_thread(dumps, obj)
    return Response(text, status=status, content_type="application/json")

"""What one request may ask of the server: its limits in one place, each with its flag.

Each bounds work or memory a single request could otherwise make the server spend before the
engine's own checks refuse it: the body's bytes and nesting (read before the JSON is parsed, so a
deep body cannot exhaust the parser's recursion), the length of its lists (checked on the parsed
JSON before validation builds an object per element), and its fan-out in sequences. A request
past one is answered 400 naming the parameter, the limit's value and the flag that raises it
(413 for the body, as HTTP says). server/request_body.py applies them as it reads a request.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from server.protocol import APIError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 2**20
    max_json_depth: int = 64
    max_messages: int = 2048          # chat messages, Responses input items
    max_prompts: int = 2048           # a completions prompt list, an embeddings input list
    max_request_sequences: int = 256  # prompts x (n, or beams) in one request
    max_stop_strings: int = 16
    max_stop_length: int = 256        # characters in one stop string

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(max_body_bytes=int(args.max_request_mb * 2**20),
                   **{name: getattr(args, name) for name in FLAGS})

    def check_lists(self, body: dict, cls) -> None:
        """The lists of the parsed body that request model `cls` names in its limited_fields,
        counted before validation builds an object per element."""
        for name, kind in cls.limited_fields.items():
            self.check_field(body.get(name), name, kind)

    def check_depth(self, raw: bytes) -> None:
        depth = json_too_deep(raw, self.max_json_depth)
        if depth is not None:
            raise APIError(f"The request body is nested {depth} levels deep; this server allows "
                           f"at most {self.max_json_depth} (--max-json-depth)",
                           code="json_too_deep")

    def check_field(self, value, name: str, kind: str) -> None:
        """One list the limits bound, as sent: `kind` is "messages", "prompts" or "stop"."""
        if kind == "messages" and isinstance(value, list):
            self._count(value, name, "messages", self.max_messages, "--max-messages")
        elif kind == "prompts" and isinstance(value, list) and value \
                and not isinstance(value[0], int):           # not one prompt of token ids
            self._count(value, name, "prompts", self.max_prompts, "--max-prompts")
        elif kind == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list):
                return
            self._count(stops, name, "stop strings", self.max_stop_strings,
                        "--max-stop-strings")
            for i, stop in enumerate(stops):
                if isinstance(stop, str) and len(stop) > self.max_stop_length:
                    where = name if isinstance(value, str) else f"{name}[{i}]"
                    raise APIError(f"{where}: a stop string of {len(stop)} characters; this "
                                   f"server allows at most {self.max_stop_length} "
                                   "(--max-stop-length)", param=where,
                                   code="string_above_max_length")

    def check_sequences(self, req) -> None:
        """prompts x (n, or beams): each a sequence the engine runs and the server streams."""
        count, how = req.fan_out()
        if count > self.max_request_sequences:
            raise APIError(f"n: this request asks for {how} = {count} sequences; this server "
                           f"allows at most {self.max_request_sequences} a request "
                           "(--max-request-sequences)", param="n",
                           code="too_many_sequences")

    @staticmethod
    def _count(items: list, param: str, what: str, limit: int, flag: str) -> None:
        if len(items) > limit:
            raise APIError(f"{param}: {len(items)} {what}; this server allows at most {limit} "
                           f"({flag})", param=param, code="array_above_max_length")


# The flags that set the limits (--max-request-mb sets max_body_bytes, in MB), and what each is.
FLAGS = {
    "max_json_depth": "deepest nesting of arrays and objects in a request body",
    "max_messages": "most chat messages (or Responses input items) in a request",
    "max_prompts": "most prompts in a completions prompt list, or inputs in an embeddings list",
    "max_request_sequences": "most sequences one request may run: prompts x n (or x best_of "
                             "beams)",
    "max_stop_strings": "most stop strings in a request",
    "max_stop_length": "most characters in one stop string",
}


def add_flags(group) -> None:
    """The limit flags, on an argparse group; --max-request-mb is the server group's own."""
    for name, what in FLAGS.items():
        default = getattr(Limits, name)
        group.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                           metavar="N", help=f"{what} (default {default})")


def check_flags(args: argparse.Namespace) -> str | None:
    """The first limit flag below 1, as a message, or None."""
    for name in FLAGS:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    return None


# Bytes that are not JSON's structure: dropped before nesting is counted.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_DELTA = np.zeros(256, np.int8)
_DELTA[list(b"[{")], _DELTA[list(b"]}")] = 1, -1
_CHUNK = 1 << 20


def json_too_deep(raw: bytes, limit: int) -> int | None:
    """How deep arrays and objects nest in a JSON text when that is deeper than `limit`, else
    None; read without parsing it, brackets inside strings not counting. Linear in the body, in
    bounded memory: escapes are dropped first (each `\\\\` pair, then each `\\"`, left to right
    as JSON reads them), then every byte but quotes and brackets; what remains is scanned a chunk
    at a time, a bracket after an odd number of quotes being inside a string."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    if text.count(b"[") + text.count(b"{") <= limit:        # cannot be deeper: the common case
        return None
    depth = deepest = 0
    inside = 0            # 1 while the chunk starts inside a string
    for start in range(0, len(text), _CHUNK):
        chunk = np.frombuffer(text, np.uint8, min(_CHUNK, len(text) - start), start)
        in_string = (np.cumsum(chunk == ord('"'), dtype=np.int32) + inside) & 1
        levels = np.cumsum(np.where(in_string == 1, 0, _DELTA[chunk]), dtype=np.int32) + depth
        deepest = max(deepest, int(levels.max()))
        depth, inside = int(levels[-1]), int(in_string[-1])
    return deepest if deepest > limit else None

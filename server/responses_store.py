"""The Responses API's memory: stored responses, for GET and for `previous_response_id`.

In memory and bounded twice: past `capacity` entries, or past `max_bytes` bytes, the oldest stored
response is forgotten first (reading a response does not make it younger). An entry is kept as
its compact JSON, zlib-compressed (`freeze`), so the bytes counted are the bytes held: a response
kept as Python objects took about five times its JSON in memory (the 2026-11-28 abuse probe:
8 MB of echoed tools a request held 350 MB for eight requests). Everything an entry keeps counts,
what the model never read included: `tools` sent with tool_choice "none" are echoed in the
response and so stored, though no context window ever saw them. An entry larger than the whole
store is not kept at all. Freezing and thawing are linear in an entry's size: call them on a
worker thread.

Each entry keeps the response object as returned, its own input items, and the conversation it
ended (earlier turns, this input, this output) that a follow-up request continues.
"""
from __future__ import annotations

import logging
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from server import json_io

log = logging.getLogger("taper.server")


@dataclass(slots=True)
class StoredResponse:
    response: dict
    input_items: list[dict]
    conversation: list[dict]     # template messages, without the instructions


def freeze(entry: StoredResponse) -> bytes:
    """The entry as the store holds it: compact JSON, written in pieces, then compressed."""
    text = json_io.dumps([entry.response, entry.input_items, entry.conversation], compact=True)
    return zlib.compress(text.encode("utf-8", "surrogatepass"), 1)


def thaw(blob: bytes) -> StoredResponse:
    return StoredResponse(*json_io.loads(zlib.decompress(blob).decode("utf-8", "surrogatepass")))


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int):
        if capacity < 0:
            raise ValueError("the response store's capacity must be >= 0")
        if max_bytes < 0:
            raise ValueError("the response store's size in bytes must be >= 0")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()     # id -> frozen entry

    def put(self, response_id: str, blob: bytes) -> bool:
        """Keep a frozen entry, forgetting the oldest ones it leaves no room for; False when it
        alone is larger than the store (then it is not kept)."""
        if self.capacity == 0:
            return False
        if len(blob) > self.max_bytes:
            log.warning("response %s is not stored: %d bytes, the store holds %d "
                        "(--responses-store-mb)", response_id, len(blob), self.max_bytes)
            return False
        self.delete(response_id)
        self._items[response_id] = blob
        self.num_bytes += len(blob)
        while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= len(old)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, thawed (linear in its size: on a worker thread for large ones)."""
        blob = self._items.get(response_id)
        return None if blob is None else thaw(blob)

    def delete(self, response_id: str) -> bool:
        blob = self._items.pop(response_id, None)
        if blob is None:
            return False
        self.num_bytes -= len(blob)
        return True

    def ids(self) -> list[str]:
        """Oldest first."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

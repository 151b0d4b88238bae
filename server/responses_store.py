"""The Responses API's memory: stored responses, for GET and for `previous_response_id`.

In memory and bounded twice: past `capacity` entries, or past `max_bytes` bytes, the oldest stored
response is forgotten first (reading a response does not make it younger). An entry's bytes are
the size of its parts as JSON (`entry_bytes`), everything it keeps counted, what the model never
read included: `tools` sent with tool_choice "none" are echoed in the response and so stored, though
no context window ever saw them. Each turn of a long conversation is counted in every entry that
keeps it (a follow-up's entry holds the whole conversation), so the bound errs towards forgetting.
An entry larger than the whole store is not kept at all.

Each entry keeps the response object as returned, its own input items, and the conversation it
ended (earlier turns, this input, this output) that a follow-up request continues.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from server import json_io

log = logging.getLogger("taper.server")


@dataclass(slots=True)
class StoredResponse:
    response: dict
    input_items: list[dict]
    conversation: list[dict]     # template messages, without the instructions
    num_bytes: int = 0           # entry_bytes of the above; set by whoever stores it


def entry_bytes(response: dict, input_items: list[dict], conversation: list[dict]) -> int:
    """What an entry weighs: its parts as compact JSON, in UTF-8 bytes (proportional to the
    memory they hold, strings dominating). Linear in their size, and written in pieces: call it
    on a worker thread (server/json_io.py)."""
    text = json_io.dumps([response, input_items, conversation], compact=True)
    return len(text.encode("utf-8", "surrogatepass"))


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int):
        if capacity < 0:
            raise ValueError("the response store's capacity must be >= 0")
        if max_bytes < 0:
            raise ValueError("the response store's size in bytes must be >= 0")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> bool:
        """Keep `entry` (its num_bytes set), forgetting the oldest ones it leaves no room for;
        False when it alone is larger than the store (then it is not kept)."""
        if self.capacity == 0:
            return False
        if entry.num_bytes > self.max_bytes:
            log.warning("response %s is not stored: %d bytes, the store holds %d "
                        "(--responses-store-mb)", entry.response["id"], entry.num_bytes,
                        self.max_bytes)
            return False
        self.delete(entry.response["id"])
        self._items[entry.response["id"]] = entry
        self.num_bytes += entry.num_bytes
        while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= old.num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def ids(self) -> list[str]:
        """Oldest first."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

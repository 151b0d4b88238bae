"""The Responses API's memory: stored responses, for GET and for `previous_response_id`.

In memory and bounded: past `capacity` the oldest stored response is forgotten first (reading a
response does not make it younger). Each entry keeps the response object as returned, its own
input items, and the conversation it ended (earlier turns, this input, this output) that a
follow-up request continues.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class StoredResponse:
    response: dict
    input_items: list[dict]
    conversation: list[dict]     # template messages, without the instructions


class ResponseStore:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("the response store's capacity must be >= 0")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._items[entry.response["id"]] = entry
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def ids(self) -> list[str]:
        """Oldest first."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

"""Vision encoder outputs kept by image content hash, least recently used first out, within a
byte budget: a conversation that sends its images again each turn, or a prompt whose image
tokens span several prefill chunks, encodes each image once. Touched only from the forward
thread (engine/vision/runner.py)."""
from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, object] = OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def get(self, key: int):
        out = self.entries.get(key)
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return out

    def put(self, key: int, value, pinned: set[int] = frozenset()):
        """Keep `value` (an array); evict the least recently used entries beyond the budget,
        except those in `pinned` (needed by the step being prepared) and the new one."""
        if key in self.entries:
            return
        self.entries[key] = value
        self.num_bytes += value.nbytes
        for old in list(self.entries):
            if self.num_bytes <= self.max_bytes:
                break
            if old == key or old in pinned:
                continue
            self.num_bytes -= self.entries.pop(old).nbytes

    def __len__(self):
        return len(self.entries)

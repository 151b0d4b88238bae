"""--speculative-config: vLLM's keys and meanings, checked with errors that name the key.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}

`disable_by_batch_size` (vLLM's) turns speculation off for a step that runs more sequences than
that: a large batch is compute-bound, and verifying k extra tokens per sequence costs k times
the compute.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32
# The default batch-size gate: a step speculates while at most this many sequences run. On the
# CPU a decode step of a few sequences is memory-bound (the weights stream once whatever the
# rows), past that the k + 1 rows per sequence are paid in compute.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None     # ngram: the longest suffix looked up
    prompt_lookup_min: int | None = None     # ngram: the shortest
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative config: method must be one of {', '.join(METHODS)} "
                             f"(draft models, EAGLE and MTP heads are not supported yet), got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative config: {name} must be a positive integer, "
                                 f"got {value!r}")
        # vLLM's rule: one given sets the other; neither: Taper's defaults 2 and 5
        if lo is None and hi is None:
            lo, hi = 2, 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"speculative config: prompt_lookup_min ({lo}) is larger than "
                             f"prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        gate = self.disable_by_batch_size
        if gate is not None and (not isinstance(gate, int) or gate < 1):
            raise ValueError(f"speculative config: disable_by_batch_size must be a positive "
                             f"integer or null (never), got {gate!r}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from JSON text, a dict or a SpeculativeConfig (None: no speculation)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return None
            try:
                value = json.loads(text)
            except ValueError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative config: {required!r} is required")
        return cls(**value)

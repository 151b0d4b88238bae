"""--speculative-config: vLLM's keys and meanings, checked with errors that name the key.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4}
    {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}    (an EAGLE-3 head)
    {"method": "mtp", "num_speculative_tokens": 2}     (the target checkpoint's MTP head;
                                                        "deepseek_mtp" is read as "mtp")

`disable_by_batch_size` (vLLM's) turns speculation off for a step that runs more sequences than
that: a large batch is compute-bound, and verifying k extra tokens per sequence costs k times
the compute. `draft_sampling` is Taper's: how a draft model or an EAGLE-3 or MTP head picks its
tokens for a request that samples ("greedy": its argmax, a point mass, so a seeded request gives
the same tokens as without speculation; "probabilistic": a draw from its own distribution, verified by rejection sampling
against it, which accepts more at high temperatures but draws other tokens for the same seed).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# vLLM's older per-model names for the MTP method
METHOD_ALIASES = {"deepseek_mtp": "mtp"}
DRAFT_SAMPLING = ("greedy", "probabilistic")
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
    model: str | None = None                 # draft_model, eagle3: its directory (or hub id)
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_sampling: str = "greedy"

    def __post_init__(self):
        if self.method in METHOD_ALIASES:
            object.__setattr__(self, "method", METHOD_ALIASES[self.method])
        if self.method not in METHODS:
            raise ValueError(f"speculative config: method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method in ("ngram", "mtp") and self.model is not None:
            raise ValueError(f"speculative config: model is for methods draft_model and eagle3, "
                             f"not {self.method}" + (" (the MTP head comes from the target's "
                                                      "checkpoint)" if self.method == "mtp"
                                                      else ""))
        if self.method == "ngram":
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
        else:
            if not self.model and self.method == "draft_model":
                raise ValueError("speculative config: method draft_model needs \"model\" (the "
                                 "draft's directory; --draft-model DIR sets it)")
            if not self.model and self.method == "eagle3":
                raise ValueError("speculative config: method eagle3 needs \"model\" (the "
                                 "EAGLE-3 head's directory)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative config: {name} is for method ngram")
        gate = self.disable_by_batch_size
        if gate is not None and (not isinstance(gate, int) or gate < 1):
            raise ValueError(f"speculative config: disable_by_batch_size must be a positive "
                             f"integer or null (never), got {gate!r}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"speculative config: draft_sampling must be one of "
                             f"{', '.join(DRAFT_SAMPLING)}, got {self.draft_sampling!r}")

    @classmethod
    def parse(cls, value, draft_model: str | None = None) -> "SpeculativeConfig | None":
        """A config from JSON text, a dict or a SpeculativeConfig (None: no speculation).
        draft_model (--draft-model DIR): method draft_model with that model, 4 tokens unless
        the config says otherwise."""
        if isinstance(value, SpeculativeConfig) and draft_model is None:
            return value
        if isinstance(value, SpeculativeConfig):
            value = {f.name: getattr(value, f.name) for f in fields(cls)}
        if isinstance(value, str):
            text = value.strip()
            if not text:
                value = None
            else:
                try:
                    value = json.loads(text)
                except ValueError as e:
                    raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if value is None and draft_model is None:
            return None
        value = dict(value or {})
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        if draft_model is not None:
            if value.get("model") not in (None, draft_model):
                raise ValueError(f"--draft-model {draft_model} and the speculative config's "
                                 f"model {value['model']!r} disagree")
            if value.get("method", "draft_model") != "draft_model":
                raise ValueError(f"--draft-model needs method draft_model, the speculative "
                                 f"config says {value['method']!r}")
            value.update(method="draft_model", model=draft_model)
            value.setdefault("num_speculative_tokens", 4)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative config: {required!r} is required")
        return cls(**value)

"""Per-request sampling parameters, with vLLM's names and meanings (DESIGN.md section 5)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from engine.sampling.logprobs import MAX_LOGPROBS
from engine.sampling.structured_outputs import StructuredOutputsParams

log = logging.getLogger("taper.engine")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0   # OpenAI formula, over generated tokens only
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # prompt and output: positive logits / p, negative * p
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16      # None: up to the model length
    min_tokens: int = 0
    logprobs: int | None = None         # top logprobs per output token (0: the token's own only)
    prompt_logprobs: int | None = None  # the same per prompt token
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    skip_special_tokens: bool = True
    # beam search (vLLM's names): best_of beams (default n), the n best hypotheses returned
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False     # True, False or "never", as transformers
    structured_outputs: StructuredOutputsParams | None = None   # a grammar the output must match
    # reasoning tokens (after <think>) before </think> is forced (sampling/reasoning_budget.py)
    reasoning_budget: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check("n", self.n >= 1, "must be at least 1")
        self._check("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]")
        self._check("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        self._check("top_k", self.top_k >= 0, "must be -1, 0 (off) or positive")
        self._check("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        self._check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]")
        self._check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]")
        self._check("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]")
        self._check("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1")
        self._check("min_tokens", self.min_tokens >= 0, "must be non-negative")
        self._check("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
                    "must not exceed max_tokens")
        self._check("reasoning_budget", self.reasoning_budget is None or self.reasoning_budget >= 0,
                    "must be non-negative")
        self._check("seed", self.seed is None or 0 <= self.seed < 2**64, "must be in [0, 2^64)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._check(name, value is None or 0 <= value <= MAX_LOGPROBS,
                        f"must be in [0, {MAX_LOGPROBS}]")
        if self.use_beam_search:
            self._check("best_of", self.best_of is None or self.best_of >= self.n,
                        "must be at least n with beam search")
            self._check("early_stopping", self.early_stopping in (True, False, "never"),
                        "must be true, false or \"never\"")
            for name in ("logprobs", "prompt_logprobs", "logit_bias", "reasoning_budget"):
                self._check(name, not getattr(self, name), "is not supported with beam search")
            self._check("stop", not self.stop, "strings are not supported with beam search")
            self._check("min_tokens", not self.min_tokens, "is not supported with beam search")
            self._check("repetition_penalty", self.repetition_penalty == 1.0
                        and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0,
                        "and the other penalties are not supported with beam search")
        for tid, bias in (self.logit_bias or {}).items():
            self._check("logit_bias", -100.0 <= bias <= 100.0,
                        f"value {bias} for token {tid} is outside [-100, 100]")

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    @property
    def num_sequences(self) -> int:
        """The sequences the request runs: its n choices, or its beams."""
        return self.beam_width if self.use_beam_search else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @staticmethod
    def _check(param: str, ok: bool, message: str):
        if not ok:
            raise ValueError(f"{param} {message}")


# generation_config.json keys that become default sampling parameters (as vLLM reads them).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config_defaults(model_dir: str) -> dict:
    """The checkpoint's recommended sampling parameters from generation_config.json; requests
    and server flags override them. An unreadable file is logged and ignored."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return {}
    out = {k: cfg[k] for k in _GENERATION_CONFIG_KEYS if isinstance(cfg.get(k), (int, float))}
    try:
        SamplingParams(**out)
    except ValueError as e:
        log.warning("ignoring the sampling parameters of %s: %s", path, e)
        return {}
    if out:
        log.info("default sampling parameters from generation_config.json: %s", out)
    return out

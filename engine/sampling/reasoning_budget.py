"""A reasoning budget: a reasoning model (`<think> ... </think>`) that has written `budget` tokens
of reasoning without closing it is made to close it: the sampler forces the tokens of `</think>`,
one per step, and then samples the answer as usual.

Forcing reuses structured outputs' per-row token bitmask (engine/sampling/sampler.py applies it
first, on every backend): the forced row allows the one token, so greedy, sampled and fused rows
all take it, and raw logprobs are those of that token. A row whose grammar is active is left to
its grammar (the grammar starts after `</think>` when the prompt leaves reasoning open, so the two
meet only when a model opens reasoning inside a grammar of its own).

Where reasoning starts follows server/reasoning.py: at the first generated token when the prompt
ends inside an open `<think>` (a template that opens it), else when the model writes `<think>` at
the start of its output. The budget counts the tokens after `<think>`; a `</think>` the model
writes itself ends the reasoning without forcing.
"""
from __future__ import annotations

import numpy as np

OPEN, CLOSE = "<think>", "</think>"     # as server/reasoning.py
# Tokens a model may write before its <think> (a newline, a space) and still be reasoning.
LEADING_TOKENS = 2
PROMPT_TAIL_TOKENS = 8                  # decoded to see whether the prompt leaves <think> open


def prompt_opens_reasoning(tokenizer, prompt_token_ids: list[int]) -> bool:
    """The prompt ends inside an open <think> (server/reasoning.py's rule, on the same tail)."""
    tail = tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


class ReasoningBudget:
    """One sequence's reasoning: before it (watching for <think>), counting its tokens, forcing
    </think>, or done (closed, or the output began without reasoning)."""
    __slots__ = ("budget", "start_ids", "end_ids", "state", "count", "forced", "_recent",
                 "_seen")

    def __init__(self, budget: int, start_ids: list[int], end_ids: list[int], opened: bool):
        if not end_ids:
            raise ValueError("reasoning_budget: the tokenizer encodes </think> as no tokens")
        self.budget = budget
        self.start_ids, self.end_ids = list(start_ids), list(end_ids)
        self.state = "before"
        self.count = 0              # reasoning tokens so far
        self.forced = 0             # of end_ids, written (by the model or forced)
        self._recent: list[int] = []    # the last tokens, for matching the tags
        self._seen = 0              # tokens seen before reasoning began
        if opened:
            self._begin()

    @classmethod
    def start(cls, tokenizer, budget: int, prompt_token_ids: list[int]) -> "ReasoningBudget":
        if tokenizer is None:
            raise ValueError("reasoning_budget needs the model's tokenizer, and this model has "
                             "none")
        return cls(budget, tokenizer.encode(OPEN, add_special_tokens=False),
                   tokenizer.encode(CLOSE, add_special_tokens=False),
                   prompt_opens_reasoning(tokenizer, prompt_token_ids))

    def _begin(self):
        self.state, self.count, self._recent = "reasoning", 0, []
        if self.budget == 0:
            self.state = "forcing"

    def forced_token(self) -> int | None:
        """The token the next step must sample, or None."""
        return self.end_ids[self.forced] if self.state == "forcing" else None

    def advance(self, token: int):
        """The sequence's next output token (sampled or forced)."""
        if self.state == "done":
            return
        self._recent.append(token)
        del self._recent[:-max(len(self.start_ids), len(self.end_ids))]
        if self.state == "before":
            self._seen += 1
            if self._recent[-len(self.start_ids):] == self.start_ids:
                self._begin()
            elif self._seen >= len(self.start_ids) + LEADING_TOKENS:
                self.state = "done"         # the answer began without reasoning
        elif self.state == "reasoning":
            self.count += 1
            if self._recent[-len(self.end_ids):] == self.end_ids:
                self.state = "done"         # the model closed it itself
            elif self.count >= self.budget:
                self.state = "forcing"
                self.forced = self._closing_prefix()
        else:                               # forcing: the token was the forced one
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.state = "done"

    def _closing_prefix(self) -> int:
        """How many of end_ids the reasoning already ends with (a multi-token </think> the
        model had begun): forcing goes on from there."""
        for k in range(len(self.end_ids) - 1, 0, -1):
            if self._recent[-k:] == self.end_ids[:k]:
                return k
        return 0


def with_forced_tokens(seqs: list, vocab_size: int,
                       token_bitmask: tuple[np.ndarray, np.ndarray] | None
                       ) -> tuple[np.ndarray, np.ndarray] | None:
    """The step's token bitmask (structured outputs' (bitmask (B, ceil(V/32)) int32, rows) or
    None) with a one-token row for each sequence whose budget forces its next token."""
    # getattr: speculative decoding's draft rows carry sampling attributes only
    forced = [(b, token) for b, s in enumerate(seqs)
              if (budget := getattr(s, "reasoning_budget", None)) is not None
              and (token := budget.forced_token()) is not None
              and not (s.grammar is not None and s.grammar.wait_for_token is None)]
    if not forced:
        return token_bitmask
    if token_bitmask is None:
        mask = np.zeros((len(seqs), (vocab_size + 31) // 32), dtype=np.int32)
        rows = np.zeros(0, dtype=np.int32)
    else:
        mask, rows = token_bitmask
    bits = mask.view(np.uint32)
    for b, token in forced:
        if not 0 <= token < vocab_size:
            raise ValueError(f"reasoning_budget: the closing token {token} is outside the "
                             f"vocabulary [0, {vocab_size})")
        bits[b] = 0
        bits[b, token >> 5] = np.uint32(1 << (token & 31))
    rows = np.union1d(rows, np.array([b for b, _ in forced], dtype=np.int32)).astype(np.int32)
    return mask, rows

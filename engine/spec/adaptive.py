"""How many drafts a sequence verifies: fewer as its drafts stop being accepted, or stop paying.

Each sequence keeps a decayed estimate of its per-token acceptance rate a: with drafts accepted
one after another until the first rejection, the number accepted in a step is geometric, and the
estimate is (accepted tokens) / (accepted tokens + rejections), each step's counts weighted
DECAY times the previous one's. The i-th draft of a step is used with probability a^i and costs
a verify row (and, for a draft model, its forward) whether used or not, so a sequence drafts the
largest k <= num_speculative_tokens with a^k >= min_use, the worth threshold: the larger of the
method's floor and what the engine measures a draft to cost against a decoded token
(engine/spec/costs.py). When even one draft is not worth it, the sequence stops speculating for
PAUSE_STEPS steps, then tries a single draft, which updates both estimates.

A lookup that finds nothing (n-gram) is no evidence about acceptance: only verified drafts count.
"""
from __future__ import annotations

import math

DECAY = 0.8
PAUSE_STEPS = 16
# The prior: as if 3 of 4 drafts had been accepted (a = 0.75), so a new sequence drafts a few at
# first, and a couple of rejections turn it down.
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.5, 2.0


class SpecState:
    """A sequence's speculation: its acceptance estimate, its pause, its counters (reported in
    the request's usage), and the proposers' per-sequence caches."""
    __slots__ = ("accepted", "trials", "paused_until", "num_drafts", "num_draft_tokens",
                 "num_accepted_tokens", "tokens", "greedy_params")

    def __init__(self):
        self.accepted, self.trials = PRIOR_ACCEPTED, PRIOR_TRIALS
        self.paused_until = None        # the speculator's step index the pause ends at
        self.num_drafts = 0             # verify steps with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.tokens = None              # ngram: the token ids as a NumPy buffer
        self.greedy_params = None       # draft model: the request's params with temperature 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    def resting(self, step: int) -> bool:
        """Paused through step `step` + 1 too (the engine may schedule that one ahead)."""
        return self.paused_until is not None and step + 1 < self.paused_until

    def num_drafts_wanted(self, k: int, min_use: float, step: int) -> int:
        """Drafts at the speculator's step `step` (0: paused)."""
        if self.paused_until is not None:
            if step < self.paused_until:
                return 0
            self.paused_until = None
            return 1                    # the pause ends with a one-draft probe
        a = self.acceptance
        if a >= 1.0 or min_use <= 0.0:
            n = k
        elif a <= 0.0 or min_use >= 1.0:
            n = 0
        else:
            n = int(math.log(min_use) / math.log(a))
        if n < 1:
            self.paused_until = step + PAUSE_STEPS
            return 0
        return min(k, n)

    def observe(self, proposed: int, accepted: int) -> None:
        """A verify step: `accepted` of `proposed` drafts taken."""
        rejected = 1 if accepted < proposed else 0
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + rejected
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted

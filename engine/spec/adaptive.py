"""How many drafts a sequence verifies: fewer as its drafts stop being accepted.

Each sequence keeps a decayed estimate of its per-token acceptance rate a: with drafts accepted
one after another until the first rejection, the number accepted in a step is geometric, and the
estimate is (accepted tokens) / (accepted tokens + rejections), each step's counts weighted
DECAY times the previous one's. The i-th draft of a step is used with probability a^i, and costs
a verify row (and a draft-model forward, for that method) whether used or not, so a sequence
drafts the largest k <= num_speculative_tokens with a^k >= min_use (the method's worth
threshold). When even one draft is not worth it, the sequence stops speculating for PAUSE_STEPS
decode steps and then tries a single draft again, which updates the estimate.

A lookup that finds nothing (n-gram) is no evidence about acceptance: only verified drafts count.
"""
from __future__ import annotations

import math

DECAY = 0.8
PAUSE_STEPS = 16
# The prior: as if 4 of 5 drafts had been accepted (a = 0.8), so a new sequence drafts its full k
# at first and one bad step does not stop it.
PRIOR_ACCEPTED, PRIOR_TRIALS = 4.0, 5.0


class SpecState:
    """A sequence's speculation: its acceptance estimate, its pause, its counters (reported in
    the request's usage), and the proposers' per-sequence caches."""
    __slots__ = ("accepted", "trials", "paused", "num_drafts", "num_draft_tokens",
                 "num_accepted_tokens", "tokens", "greedy_params")

    def __init__(self):
        self.accepted, self.trials = PRIOR_ACCEPTED, PRIOR_TRIALS
        self.paused = 0
        self.num_drafts = 0             # verify steps with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.tokens = None              # ngram: the token ids as a NumPy buffer
        self.greedy_params = None       # draft model: the request's params with temperature 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    def num_drafts_wanted(self, k: int, min_use: float) -> int:
        """Drafts this step (0: paused), counting down a pause."""
        if self.paused:
            self.paused -= 1
            return 1 if not self.paused else 0    # the pause ends with a one-draft probe
        a = self.acceptance
        if a >= 1.0:
            return k
        n = int(math.log(min_use) / math.log(a)) if a > 0 else 0
        if n < 1:
            self.paused = PAUSE_STEPS
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

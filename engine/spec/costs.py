"""What a verify row costs, measured: the time of a decode step as fixed + per_row * rows.

A decode step streams every weight once whatever its rows (the fixed part, plus the host's work)
and computes each row (the per-row part). Where the fixed part dominates (large float weights,
memory-bound) a draft's verify row is nearly free; where the per-row part does (small or
quantized weights whose decode kernels compute each row apart, or a big batch) a verify row
costs about as much as a decoded token and speculation loses. The two are fitted by least
squares with forgetting (each step's weight decays by FORGET per newer step) over the steps that
run only decodes and verify rows (prefill chunks take other kernels), timed by the engine on its
forward thread.

While every step seen has had the same number of rows only their sum is known; a weak prior on
the ratio, per_row = PRIOR_SHARE * fixed (memory-bound, a verify row nearly free), settles the
split, so the first steps speculate and their verify rows measure what a row costs. The prior is
on the ratio alone, so the machine's load moving both parts does not bias it.
"""
from __future__ import annotations

import numpy as np

FORGET = 0.97          # ~30 steps of memory
PRIOR_SHARE = 0.05     # per_row / fixed before there is evidence
PRIOR_WEIGHT = 1.0     # as much as one step's evidence a row count apart
WARMUP = 3             # first steps ignored (workspaces are allocated on a shape's first use)
CLIP = 2.0             # past the first ten, a step slower than CLIP x the fit counts as CLIP x: a
                       # stall (another process, the GC) must not turn speculation off for long


class StepCost:
    __slots__ = ("S", "r", "prior", "theta", "draft_token_s", "num_seen")

    def __init__(self):
        self.num_seen = 0
        self.S = np.zeros((2, 2))          # sum of decayed x x^T, x = (1, rows)
        self.r = np.zeros(2)               # sum of decayed x * seconds
        self.prior = None
        self.theta = None                  # (fixed seconds, seconds per row)
        self.draft_token_s = 0.0           # a draft model's seconds per draft token

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        self.num_seen += 1
        if self.num_seen <= WARMUP:
            return
        if self.num_seen > WARMUP + 10:     # once the fit has settled
            predicted = self.theta[0] + self.theta[1] * rows
            seconds = min(seconds, predicted * CLIP)
        if self.prior is None:             # (per_row - share * fixed)^2
            v = np.array([-PRIOR_SHARE, 1.0])
            self.prior = PRIOR_WEIGHT * np.outer(v, v)
        x = np.array([1.0, float(rows)])
        self.S = FORGET * self.S + np.outer(x, x)
        self.r = FORGET * self.r + x * seconds
        fixed, per_row = np.linalg.solve(self.S + self.prior, self.r)
        self.theta = (max(fixed, 1e-9), max(per_row, 0.0))

    def observe_draft(self, seconds: float, draft_tokens: int) -> None:
        """A draft model's proposing time for `draft_tokens` drafts (all sequences')."""
        if draft_tokens > 0 and seconds > 0:
            per = seconds / draft_tokens
            self.draft_token_s = (per if not self.draft_token_s
                                  else FORGET * self.draft_token_s + (1 - FORGET) * per)

    def min_use(self, rows: int) -> float:
        """The least probability of being used that makes a draft worth its cost in a step of
        `rows` decoding sequences: its verify row and draft against the time one decoded token
        costs in such a step. 0 before any measurement."""
        if self.theta is None:
            return 0.0
        fixed, per_row = self.theta
        per_token = (fixed + per_row * rows) / rows
        return (per_row + self.draft_token_s) / per_token

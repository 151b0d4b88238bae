"""Speculative decoding in the step pipeline: one proposer plus a verify step in the same scheduler
(DESIGN.md section 8). No second engine loop:

- schedule (main thread): `plan` gives a decoding sequence its drafts for the step, k <= its
  adaptive budget (engine/spec/adaptive.py), the step's token budget, max_tokens and the model
  length; an n-gram lookup returns the tokens at once (cut where a grammar refuses them), a draft
  model, an EAGLE-3 or an MTP head only the count. The scheduler allocates 1 + k slots and the
  runner makes 1 + k rows of them (the last known token, then the drafts), each row's logits
  kept.
- forward thread: `draft` runs the draft model (engine/spec/draft_model.py), the EAGLE-3 head
  (engine/spec/eagle3.py) or the MTP head (engine/spec/mtp.py) into those rows, the target
  scores every row of every sequence in one forward, mixed with plain decodes and prefill
  chunks; `mirror` gives the draft model the step's K/V (a head the target's features too);
  `verify` turns the rows into emitted tokens (engine/spec/rejection_sampler.py).
- commit (main thread): the emitted tokens are appended one by one (each may stop the
  sequence), only the accepted rows count as computed, so a rejected draft's K/V lies past
  num_computed_tokens, is never hashed into the prefix cache and is rewritten before it is read;
  blocks holding nothing but rejected slots are freed (BlockPool.trim). `record` feeds the
  adaptive policy and the counters of /metrics and the usage.

A step speculates only while at most `disable_by_batch_size` sequences run; a bigger batch is
compute-bound, where verifying k extra rows per sequence costs about k times more.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.outputs import SpecDecodeCounts
from engine.spec.adaptive import SpecState
from engine.spec.costs import StepCost
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import TokenBuffer, propose_ngram
from engine.spec.rejection_sampler import RejectionSampler, Verified

# A draft is worth proposing while the chance it is used (acceptance^position) is at least this
# floor, and at least its measured cost against a decoded token's (engine/spec/costs.py).
MIN_USE = {"ngram": 0.1, "draft_model": 0.1, "eagle3": 0.1, "mtp": 0.1}


@dataclass(slots=True)
class SpecStats:
    """Totals over the engine's life, for /metrics."""
    method: str
    num_drafts: int = 0              # verify steps of a sequence with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # drafts accepted at i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step emits per sequence: the accepted drafts plus the drawn one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, sampler, eos_token_ids: set[int],
                 max_model_len: int, logprobs_mode: str = "raw", draft=None):
        self.config = config
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft_model = draft     # a DraftModel (draft_model), Eagle3Proposer or MtpProposer
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.rejection = RejectionSampler(sampler, eos_token_ids, logprobs_mode)
        self.floor = MIN_USE[self.method]
        self.costs = StepCost()
        self.step = 0                       # steps scheduled (pauses are counted in them)
        self.min_use = self.floor           # this step's worth threshold
        self.stats = SpecStats(self.method, accepted_per_position=[0] * self.k)
        # the engine's StructuredOutputs once built (the engine sets the getter)
        self.structured = lambda: None

    # ---- main thread

    def step_active(self, num_running: int) -> bool:
        gate = self.config.disable_by_batch_size
        return gate is None or num_running <= gate

    def begin_step(self, num_running: int) -> bool:
        """A step is being scheduled: whether it may speculate; its worth threshold."""
        self.step += 1
        if not self.step_active(num_running):
            return False
        self.min_use = max(self.floor, self.costs.min_use(max(num_running, 1)))
        return True

    def lets_schedule_ahead(self, running: list) -> bool:
        """Whether the next step may be scheduled ahead of the one in flight: when it will not
        speculate (the batch gate), or every running sequence rests through it."""
        if not self.step_active(len(running)):
            return True
        return all(seq.spec is not None and seq.spec.resting(self.step) for seq in running
                   if seq.pooler is None)

    def observe_step(self, sched, num_rows: int, seconds: float) -> None:
        """Forward thread: a step's forward and sampling time, for the cost model when it ran
        only decodes and verify rows. (The main thread reads the fit between steps: a float
        tuple replaced whole.)"""
        if all(d or dec for d, dec in zip(sched.num_drafts, sched.is_decode)):
            self.costs.observe(num_rows, seconds)

    def plan(self, seq, max_drafts: int) -> tuple[int, list[int]]:
        """(k, drafts) for a decoding sequence this step: k drafts to verify, with their tokens
        (n-gram) or [] for the draft model to fill on the forward thread; (0, []) when it does
        not speculate."""
        if (seq.num_output_placeholders or seq.pooler is not None
                or seq.request is None or seq.request.beam is not None
                or seq.reasoning_budget is not None):   # its forced closer is one row a step
            return 0, []
        params = seq.sampling_params
        limit = min(max_drafts, self.max_model_len - seq.num_tokens)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
        if limit < 1:
            return 0, []
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState()
        k = min(limit, state.num_drafts_wanted(self.k, self.min_use, self.step))
        if k < 1:
            return 0, []
        if self.method != "ngram":       # drafted on the forward thread
            return k, []
        if state.tokens is None:
            state.tokens = TokenBuffer()
        drafts = propose_ngram(state.tokens.sync(seq.token_ids), k,
                               self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        if drafts and seq.grammar is not None:     # cut where the grammar refuses them
            drafts = drafts[:self.structured().valid_draft_prefix(seq, drafts)]
        return len(drafts), drafts

    @staticmethod
    def counts(seq) -> SpecDecodeCounts:
        """A sequence's counters, for its request's usage."""
        st = seq.spec
        if st is None:
            return SpecDecodeCounts()
        return SpecDecodeCounts(st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)

    def record(self, seq, proposed: int, accepted: int) -> None:
        """A verify step's outcome for one sequence."""
        if seq.spec is None:
            seq.spec = SpecState()
        seq.spec.observe(proposed, accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1

    # ---- forward thread

    def draft(self, runner, sched, batch, structured) -> list | None:
        """The draft model's drafts for the step (into the batch's verify rows and
        sched.drafts); returns the draft probabilities per sampled sequence, or None."""
        if self.draft_model is None or not sched.has_drafts:
            return None
        plans = [(b, seq, k) for b, (seq, k) in enumerate(zip(sched.seqs, sched.num_drafts))
                 if k]
        tables = runner.to_device(batch).block_tables
        start = time.perf_counter()
        drafts, probs = self.draft_model.propose(
            batch, tables, plans, self.sampler, self.eos_token_ids, structured,
            self.config.draft_sampling == "probabilistic")
        self.costs.observe_draft(time.perf_counter() - start, sum(len(d) for d in drafts))
        by_seq = {}
        for (b, seq, _), d, p in zip(plans, drafts, probs):
            sched.drafts[b] = d
            by_seq[seq.seq_id] = p
        return by_seq

    def mirror(self, runner, batch) -> None:
        if self.draft_model is not None:
            self.draft_model.mirror(runner.to_device(batch), batch)

    def verify(self, logits, seqs: list, drafts: list[list[int]], structured,
               draft_probs: dict | None) -> Verified:
        probs = None
        if draft_probs:
            probs = [draft_probs.get(seq.seq_id) for seq in seqs]
        return self.rejection.verify(logits, seqs, drafts, structured, probs)

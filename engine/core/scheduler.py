"""Which sequences run this step, and how many tokens each computes.

The single rule: every sequence has `num_computed_tokens` catching up to `num_tokens`. Each step
gives, while budget remains (max_num_batched_tokens per step) and at most max_num_seqs run,
    min(num_tokens - num_computed_tokens, remaining token budget, prefill_chunk_size if > 0)
new tokens to: first the running sequences with one token left (decodes), then the other running
sequences (prefill chunks), oldest first, then the waiting ones (FIFO). A decode is just a
sequence with one uncomputed token, so prefill chunks and decodes share a step; serving decodes
first means a long prompt, even one admitted before them, never stalls sequences that are
generating, and the budget left after the decodes (max_num_batched_tokens >= max_num_seqs) always
moves prefills on.

Memory: a running sequence that cannot get blocks preempts the NEWEST running sequence (it may be
itself, or one already scheduled this step, which is then taken out of the step) by recompute:
its blocks are freed, num_computed_tokens drops to 0 and it goes to the front of the waiting
queue, keeping its output tokens. A waiting sequence is admitted only if its blocks fit (after a
prefix-cache lookup); the first that does not fit stops admission, and no admission happens in a
step that had to preempt.

Paused requests (their reader is behind: engine/async_engine.py) are skipped, running or
waiting, keeping their place and their blocks (a paused sequence can still be preempted).

Speculative decoding (engine/spec/speculator.py): while a step speculates (at most
`disable_by_batch_size` sequences run), a decode asks the speculator for k drafts and computes
1 + k tokens: its last known token, then the drafts, whose rows all sample. Drafts take budget
only beyond one token for each running sequence after it, and never cost a preemption: when
their slots do not fit, the decode runs without them. `update` counts only the accepted rows as
computed and frees the blocks that held nothing but rejected ones.

Scheduling ahead (LLMEngine.step with async scheduling): the next step is scheduled while the
one in flight still runs. `advance(out)` first counts the in-flight step's tokens as computed and,
for each sequence it samples, one output placeholder (`num_output_placeholders`): a token that
exists but is not known yet. A placeholder counts as a token here (its KV slot is allocated and
its decode scheduled; the engine fills its row once the in-flight step has sampled it), except
that a sequence the pending token finishes by length (max_tokens, the maximum model length) is not
scheduled: that finish is known before the token is. `update(out, advanced=True)` then only
registers the computed blocks once the step has really run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool
from engine.config import EngineConfig
from engine.core.max_num_seqs import MAX_NUM_SEQS_CAP
from engine.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # same order as seqs
    # taken at schedule time (update() moves num_computed_tokens on):
    is_decode: list[bool] = field(default_factory=list)  # one token, past the prompt
    sample: list[bool] = field(default_factory=list)     # this step computes the last token
    num_computed: list[int] = field(default_factory=list)  # its num_computed_tokens then
    # speculative decoding: drafts verified per sequence (their rows follow its last known
    # token's) and their tokens (a draft model fills them on the forward thread)
    num_drafts: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def num_decodes(self) -> int:
        return sum(self.is_decode)

    @property
    def num_prefills(self) -> int:
        return len(self.seqs) - sum(self.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def has_drafts(self) -> bool:
        return any(self.num_drafts)

    def _add(self, seq: Sequence, n: int, num_drafts: int = 0, drafts: list[int] | None = None):
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        known = n - num_drafts
        self.is_decode.append(known == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.sample.append(seq.num_computed_tokens + known == seq.num_tokens_scheduled)
        self.num_computed.append(seq.num_computed_tokens)
        self.num_drafts.append(num_drafts)
        self.drafts.append(drafts if drafts is not None else [])

    def _remove(self, seq: Sequence) -> int:
        """Take a preempted sequence out of the step; returns its number of tokens."""
        i = self.seqs.index(seq)
        for column in (self.seqs, self.is_decode, self.sample, self.num_computed,
                       self.num_drafts, self.drafts):
            del column[i]
        return self.num_new_tokens.pop(i)


class Scheduler:

    def __init__(self, config: EngineConfig, block_pool: BlockPool,
                 max_model_len: int | None = None, speculator=None):
        self.max_model_len = max_model_len    # None: no limit (the engine finishes "length")
        self.max_num_seqs = config.max_num_seqs or MAX_NUM_SEQS_CAP   # the engine sizes None
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_chunk_size = config.prefill_chunk_size
        self.block_pool = block_pool
        self.speculator = speculator      # an engine.spec.speculator.Speculator, or None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.encoder_budget = None     # a vision model's engine.vision.budget.EncoderBudget

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Some unfinished sequence is not paused."""
        return any(not _paused(s) for s in self.running) or any(not _paused(s)
                                                                for s in self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        n = min(seq.num_tokens_scheduled - num_computed, budget)
        if self.prefill_chunk_size > 0:
            n = min(n, self.prefill_chunk_size)
        if seq.mm is not None and self.encoder_budget is not None and n > 0:
            n = self.encoder_budget.limit(seq, num_computed, n)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        pool = self.block_pool

        scheduled: set[int] = set()      # seq_ids in `out`
        spec = self.speculator
        if self.encoder_budget is not None:
            self.encoder_budget.begin_step()
        if spec is not None and not spec.begin_step(len(self.running)):
            spec = None
        for decodes in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                left = seq.num_tokens_scheduled - seq.num_computed_tokens
                if (seq.seq_id in scheduled or left <= 0 or (left == 1) != decodes
                        or self._finishes_by_length(seq) or _paused(seq)):
                    i += 1
                    continue
                n = self._num_new_tokens(seq, seq.num_computed_tokens, budget)
                if n <= 0:                  # held back by the step's image work
                    i += 1
                    continue
                k, drafts, allocated = 0, None, False
                if decodes and spec is not None:
                    # budget beyond one token for each running sequence after this one
                    k, drafts = spec.plan(seq, budget - len(self.running) + i)
                    allocated = k > 0 and pool.allocate_slots(seq, n + k)
                    if not allocated:
                        k, drafts = 0, None
                while not allocated and not pool.allocate_slots(seq, n):
                    victim = self.running.pop()     # newest; always at or after index i
                    if victim.seq_id in scheduled:
                        scheduled.discard(victim.seq_id)
                        budget += out._remove(victim)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                else:
                    out._add(seq, n + k, k, drafts)
                    scheduled.add(seq.seq_id)
                    budget -= n + k
                    i += 1

        if out.preempted:
            if self.encoder_budget is not None:
                self.encoder_budget.commit(out)
            return out
        i = 0                            # paused ones wait in place, the others go FIFO
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if _paused(seq):
                i += 1
                continue
            computed_blocks, num_cached = pool.get_computed_blocks(seq)
            n = self._num_new_tokens(seq, seq.num_computed_tokens + num_cached, budget)
            if n <= 0 or not pool.allocate_slots(seq, n, computed_blocks):
                break
            pool.record_lookup(seq, num_cached)
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out._add(seq, n)
            budget -= n
        if self.encoder_budget is not None:
            self.encoder_budget.commit(out)
        return out

    def _finishes_by_length(self, seq: Sequence) -> bool:
        """The pending token (a placeholder) ends the sequence at max_tokens or the maximum model
        length, as the engine's commit will find: nothing to schedule after it."""
        if not seq.num_output_placeholders:
            return False
        max_tokens = seq.sampling_params.max_tokens
        return ((max_tokens is not None
                 and seq.num_output_tokens + seq.num_output_placeholders >= max_tokens)
                or (self.max_model_len is not None
                    and seq.num_tokens_scheduled >= self.max_model_len))

    def _preempt(self, seq: Sequence):
        self.block_pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, advanced: bool = False,
               num_rejected: dict[int, int] | None = None):
        """After the forward (and, for a verify step, the appending of its emitted tokens): the
        scheduled tokens are computed (advanced: advance() counted them already) and full blocks
        are cacheable. num_rejected: per seq_id, the verify rows whose drafts were not taken:
        they are not computed, and blocks holding only such rows are freed. Sequences finished,
        aborted or preempted meanwhile are skipped."""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.status != SequenceStatus.RUNNING:
                continue
            rejected = num_rejected.get(seq.seq_id, 0) if num_rejected else 0
            if not advanced:
                seq.num_computed_tokens += n - rejected
            self.block_pool.cache_full_blocks(seq)
            if rejected:
                self.block_pool.trim(seq, seq.num_tokens)

    def advance(self, out: SchedulerOutput):
        """Before scheduling ahead of the step `out` still in flight: its tokens count as
        computed, and each sequence it samples gets an output placeholder (the engine's commit
        resolves it). Blocks are registered for the prefix cache only by update(), once the
        step has run: a failed step must not leave its blocks findable."""
        for seq, n, sample in zip(out.seqs, out.num_new_tokens, out.sample):
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += n
            if sample and seq.pooler is None:
                seq.num_output_placeholders += 1

    def replace(self, old: list[Sequence], new: list[Sequence]):
        """Beam search: `new` (forked, blocks allocated) run in place of `old`, which finish
        and free their blocks (the blocks `new` shares stay referenced)."""
        at = min((self.running.index(s) for s in old if s in self.running),
                 default=len(self.running))
        for seq in old:
            self.finish(seq, "beam")
        for seq in new:
            seq.status = SequenceStatus.RUNNING
        self.running[at:at] = new

    def finish(self, seq: Sequence, reason: str):
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_pool.free(seq)

    def abort(self, request_id: str) -> bool:
        """Finish (reason "abort") every sequence of the request, waiting or running, freeing its
        blocks. False if the request is unknown or already finished."""
        seqs = [s for s in self.running if s.request_id == request_id]
        seqs += [s for s in self.waiting if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return bool(seqs)


def _paused(seq: Sequence) -> bool:
    """Its request's reader is behind (engine/async_engine.py): not scheduled meanwhile."""
    return seq.request is not None and seq.request.paused

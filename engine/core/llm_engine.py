"""The synchronous engine's step pipeline: add requests, call step() until done. One step =
schedule, one forward call for every scheduled sequence, sample the ones that reached their last
token, commit (tokens appended, token-level stops), then outputs (engine/core/output_processor.py).
What the engine is built from: engine/core/builder.py; a request's state: engine/core/request.py."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from engine.config import EngineConfig
from engine.core.builder import build
from engine.core.output_processor import OutputProcessor
from engine.core.outputs import RequestOutput, TokenLogprobs
from engine.core.placeholders import PlaceholderRows
from engine.core.request import Admission, RequestTable
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.stats import EngineStats
from engine.sampling.beam_search import BeamRequests
from engine.sampling.logprobs import record_prompt_logprobs
from engine.sampling.pooling import PoolingParams
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.structured_outputs import StructuredOutputs
from engine.spec.speculator import Speculator
from engine.vision.budget import EncoderBudget, check_whole_image_room

log = logging.getLogger("taper.engine")


@dataclass(slots=True)
class InflightStep:
    """A step submitted to the forward thread."""
    sched: SchedulerOutput
    future: Future | None = None  # its _run_step result
    prepare_failed: bool = False  # its batch is the exception: it fails at once
    advanced: bool = False        # the next step was scheduled ahead of it (scheduler.advance)
    # Set once step() has committed it (tokens appended): the step queued behind it may sample.
    committed: threading.Event = field(default_factory=threading.Event)


def sampled_seqs(sched: SchedulerOutput) -> list[Sequence]:
    """The sequences a step samples (beams included), in the order of its logits rows."""
    return [seq for seq, last in zip(sched.seqs, sched.sample) if last and seq.pooler is None]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        """loaded: (backend, model, model_config) built by the caller (benchmarks that generate
        weights on the device) instead of loading config.model; there is no tokenizer then. A
        fourth item, (draft model, its config), is method draft_model's draft (core/builder.py)."""
        parts = build(config, loaded)
        self.config = parts.config
        self.backend, self.model, self.model_config = parts.backend, parts.model, parts.model_config
        self.model_dir, self.tokenizer = parts.model_dir, parts.tokenizer
        self.pooling = parts.pooling
        self.eos_token_ids, self.max_model_len = parts.eos_token_ids, parts.max_model_len
        self.block_pool, self.runner = parts.block_pool, parts.runner
        self.lora = parts.lora        # the LoRA adapters' LoraManager (--enable-lora), or None
        self.sampler = Sampler(self.backend)
        self.admission = Admission(self.model_config, self.max_model_len, self.tokenizer,
                                   self.eos_token_ids, self.pooling,
                                   self.config.enable_prefix_caching, self.config.seed,
                                   self.lora)
        self.speculator = None        # speculative decoding (engine/spec/speculator.py)
        if self.config.speculative_config is not None:
            self.speculator = Speculator(self.config.speculative_config, self.sampler,
                                         self.eos_token_ids, self.max_model_len,
                                         self.config.logprobs_mode, parts.draft)
            self.speculator.structured = lambda: self.admission.structured
        self.scheduler = Scheduler(self.config, self.block_pool, self.max_model_len,
                                   self.speculator)
        if self.runner.vision is not None:   # images: the encoder's work per step
            # an image's most tokens where chunks must keep images whole (Gemma 3), else 0
            whole = getattr(self.model, "whole_image_tokens", 0)
            self.scheduler.encoder_budget = EncoderBudget(self.config.max_num_batched_tokens,
                                                          self.model.max_image_rows, bool(whole))
            if whole:
                check_whole_image_room(whole, self.config.max_num_batched_tokens,
                                       self.config.prefill_chunk_size)
        self.outputs = OutputProcessor(self.eos_token_ids, self.max_model_len)
        self.beams = BeamRequests(self)
        self.requests = RequestTable(self.scheduler, self.beams, self.outputs)   # unfinished
        self.num_prompt_tokens = self.num_generation_tokens = 0     # counters for EngineStats
        # Every step's forward and sampling run on this one thread, overlapped or not (OpenMP
        # keeps a thread pool per thread that starts parallel regions, CuPy a current device
        # and stream per thread). Async scheduling: it runs step N+1 while step() finishes N.
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="taper-forward")
        self._inflight: InflightStep | None = None     # that step
        self.async_scheduling = self.config.async_scheduling   # may be switched between steps
        # With async scheduling: schedule step N+1 before step N's tokens are known (output
        # placeholders), not after N's commit. May be switched between steps (benchmarks).
        self.schedule_ahead = self.config.schedule_ahead
        self.num_scheduled_ahead = 0      # steps scheduled ahead, and their placeholder rows
        self.num_placeholder_rows = 0

    # ---- requests

    def structured_outputs(self) -> StructuredOutputs:
        return self.admission.structured_outputs()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, images: list | None = None
                    ) -> Sequence:
        """Queue a generation request (SamplingParams) or an embedding request (PoolingParams);
        returns its (first choice's) sequence (engine/core/request.py: how it is admitted).
        images: a vision-language model's preprocessed images (engine/vision/preprocess.py), in
        the order of the prompt's runs of image tokens."""
        request = self.admission.admit(request_id, prompt_token_ids, params, images)
        self.requests.add(request)
        return request.seqs[0]

    def abort(self, request_id: str) -> list[int]:
        return self.requests.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pause(self, request_id: str, paused: bool = True) -> None:
        """Hold the request's sequences out of the schedule (its reader is behind), or let them
        back in; an unknown or finished request is ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            request.paused = paused

    def has_work(self) -> bool:
        """A step would do something: a step is in flight, or a sequence may be scheduled."""
        return self._inflight is not None or self.scheduler.has_schedulable()

    def stats(self) -> EngineStats:
        return EngineStats.of(self)

    def shutdown(self) -> None:
        """Stops the forward thread and, under tensor parallel, the other ranks."""
        self._forward_thread.shutdown(wait=True)
        if self.runner.peers is not None:
            self.runner.peers.stop()

    # ---- one step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; returns the outputs of the tokens sampled.

        With async scheduling the batch runs on the forward thread and its outputs come from the
        next call. A call with step N in flight first schedules and prepares step N+1 ahead of N
        (each sequence N samples decodes a placeholder in N+1: engine/core/placeholders.py), submits
        it (it queues behind N on the one forward thread, so the forward thread goes from N to
        N+1 without waiting for this one), and only then waits for N and commits it (tokens
        appended, token-level stops applied, KV blocks of finished sequences freed), and
        detokenizes and builds N's outputs while N+1 computes.

        Why that is exact, and when it falls back to scheduling after the commit:
        engine/core/placeholders.py."""
        self.backend.bind_thread()   # CUDA: block copies and pooled rows on this thread too
        outputs = self._step()
        if self._inflight is not None and not self.scheduler.has_unfinished():
            # Every sequence of the step in flight has finished meanwhile: collect it (its rows
            # are dropped), so that nothing runs on once the engine is idle.
            last, self._inflight = self._inflight, None
            more, pending = self._collect(last)
            outputs += more + self._outputs(pending)
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, pending = [], []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            ahead = self._launch(after=prev) if self._can_schedule_ahead(prev) else None
            outputs, pending = self._collect(prev)
            if ahead is not None:
                return outputs + self._keep_or_collect(ahead, pending)
        if not self.scheduler.has_unfinished():    # that commit finished everything
            return outputs + self._outputs(pending)
        # Schedule after the commit: synchronous engine, first step, the fallback above, or
        # nothing was schedulable ahead (say every sequence was finishing).
        launched = self._launch()
        if launched is None:
            return outputs + self._outputs(pending)
        return outputs + self._keep_or_collect(launched, pending)

    def _keep_or_collect(self, step: InflightStep, pending: list) -> list[RequestOutput]:
        """Leave the launched step running (async scheduling), or wait for it and commit it now;
        then the outputs of `pending` (and of the step, when committed)."""
        if self._can_overlap(step.sched) and not step.prepare_failed:
            self._inflight = step
            return self._outputs(pending)
        outputs = self._outputs(pending)   # before their sequences move on
        more, pending = self._collect(step)
        return outputs + more + self._outputs(pending)

    def _can_overlap(self, sched) -> bool:
        return (self.async_scheduling
                and not any(seq.request.beam is not None for seq in sched.seqs))

    def _can_schedule_ahead(self, prev: InflightStep) -> bool:
        """Not after a verify step (how many tokens it emits is unknown until it is verified),
        nor before one: a sequence needs its tokens to draft (n-gram), and drafts are scheduled
        tokens."""
        return (self.async_scheduling and self.schedule_ahead
                and not any(seq.grammar is not None for seq in sampled_seqs(prev.sched))
                and not prev.sched.has_drafts
                and (self.speculator is None
                     or self.speculator.lets_schedule_ahead(self.scheduler.running)))

    def _launch(self, after: InflightStep | None = None) -> InflightStep | None:
        """Schedule, prepare and submit a step to the forward thread; None when nothing is
        schedulable. after: the step in flight that this one is scheduled ahead of."""
        placeholders = None
        if after is not None:
            self.scheduler.advance(after.sched)
            after.advanced = True
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return None
        # The batch arrays are built here, before the outputs may finish sequences (and free
        # their block tables) while the forward thread runs.
        batch = self._prepare(sched)
        failed = isinstance(batch, Exception)
        if after is not None and not failed:
            self.num_scheduled_ahead += 1
            placeholders = PlaceholderRows.find(batch, sched, sampled_seqs(after.sched))
            if placeholders is not None:
                self.num_placeholder_rows += len(placeholders.rows)
        step = InflightStep(sched, prepare_failed=failed)
        step.future = self._forward_thread.submit(self._run_step, sched, batch, placeholders,
                                                  after)
        return step

    def _collect(self, step: InflightStep) -> tuple[list[RequestOutput], list[tuple]]:
        """Wait for the step's result and commit it; the step queued behind it (if any) may
        sample from then on, and must be let go even if the commit raises."""
        try:
            return self._commit(step.sched, step.future.result(), step.advanced)
        finally:
            step.committed.set()

    def _prepare(self, sched):
        try:
            return self.runner.prepare(sched)
        except Exception as e:
            log.exception("preparing a step failed")
            return e

    def _run_step(self, sched, batch, placeholders: PlaceholderRows | None = None,
                  after: InflightStep | None = None):
        """The device part of a step (on the forward thread with async scheduling): the forward,
        beam-search rows, the grammar masks, sampling and prompt logprobs. Returns (sampled
        sequences, tokens, logprobs, beam requests ready, pooled rows), or the exception.
        after: the step this one was scheduled ahead of; it ran just before on this thread, so
        its future is done. Its tokens fill the placeholder rows, and this step samples only
        once it is committed."""
        if isinstance(batch, Exception):
            return batch
        self.backend.bind_thread()   # CUDA: this thread's current device and stream
        try:
            if placeholders is not None:
                placeholders.fill(batch.token_ids, after.future.result())
            spec, draft_probs = self.speculator, None
            # under tensor or pipeline parallel the other ranks take part in these forwards: one
            # that fails on rank 0 ends the group (StepSender.running)
            with self.runner.peers.running() if self.runner.peers else nullcontext():
                if spec is not None and sched.has_drafts:
                    draft_probs = spec.draft(self.runner, sched, batch, self.admission.structured)
                start = time.perf_counter()
                logits, pooled = self.runner.execute(sched, batch)
                if spec is not None:
                    forward_s = time.perf_counter() - start
                    spec.mirror(self.runner, batch)     # the draft model's K/V of this step
            if after is not None:
                self._await_commit(after)
            if sched.has_drafts:
                start = time.perf_counter()
                result = self._verify_step(sched, logits, pooled, draft_probs)
                if batch.state_plan is not None:   # a hybrid model: states of accepted rows
                    self.runner.keep_verified_states(
                        batch.state_plan, {seq.seq_id: len(run) for seq, run in
                                           zip(result[0], result[1])})
                spec.observe_step(sched, batch.num_tokens,
                                  forward_s + time.perf_counter() - start)
                return result
            if spec is not None:
                sampling_start = time.perf_counter()
            sampled = sampled_seqs(sched)
            S = len(sampled)
            beams_ready = self.beams.collect(sampled, logits[:S])
            rows = [i for i, seq in enumerate(sampled) if seq.request.beam is None]
            if len(rows) < S:
                sampled = [sampled[i] for i in rows]
            structured = self.admission.structured
            mask = structured.bitmask(sampled) if structured is not None and sampled else None
            tokens, logprobs = self.sampler.sample_with_logprobs(
                logits[:S] if len(rows) == S else logits[self.backend.asarray(np.array(rows))],
                sampled, self.eos_token_ids, self.config.logprobs_mode,
                token_bitmask=mask) if sampled else ([], [])
            record_prompt_logprobs(self.backend, sched, logits[S:])
            if spec is not None:
                spec.observe_step(sched, batch.num_tokens,
                                  forward_s + time.perf_counter() - sampling_start)
            return sampled, tokens, logprobs, beams_ready, pooled, None
        except Exception as e:  # fail this step's requests, keep serving the others
            log.exception("step failed; finishing its %d requests with an error", len(sched.seqs))
            return e

    def _verify_step(self, sched, logits, pooled, draft_probs):
        """_run_step's sampling for a step with drafts: each sampled sequence owns 1 + k logits
        rows (k = its drafts, 0 for beams and plain decodes), the verifier turns them into the
        tokens it emits. Returns _run_step's tuple with runs of tokens and logprobs per sequence
        and the Verified counts last."""
        be = self.backend
        rows = [(seq, d) for seq, last, d in zip(sched.seqs, sched.sample, sched.drafts)
                if last and seq.pooler is None]
        sizes = np.array([1 + len(d) for _, d in rows], np.int64)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        S = int(sizes.sum())
        beam = [i for i, (seq, _) in enumerate(rows) if seq.request.beam is not None]
        beams_ready = self.beams.collect([rows[i][0] for i in range(len(rows))],
                                         logits[be.asarray(starts)]) if beam else []
        keep = [i for i in range(len(rows)) if rows[i][0].request.beam is None]
        picked = (logits[:S] if len(keep) == len(rows) else logits[be.asarray(np.concatenate(
            [np.arange(starts[i], starts[i] + sizes[i]) for i in keep]))])
        seqs = [rows[i][0] for i in keep]
        verified = self.speculator.verify(picked, seqs, [rows[i][1] for i in keep],
                                          self.admission.structured, draft_probs)
        record_prompt_logprobs(self.backend, sched, logits[S:])
        return seqs, verified.tokens, verified.logprobs, beams_ready, pooled, verified

    @staticmethod
    def _await_commit(step: InflightStep):
        """Until the main thread has committed `step` (normally at once: a commit is short)."""
        step.committed.wait()

    def _commit(self, sched, result, advanced: bool = False
                ) -> tuple[list[RequestOutput], list[tuple]]:
        """Apply a step's results before the next schedule: computed tokens, sampled tokens
        appended (and fed to their grammars), token-level stops freeing their blocks, forks
        released, beams advanced, embeddings pooled; sequences finished or aborted meanwhile are
        dropped. advanced: the next step was scheduled ahead (scheduler.advance counted a
        placeholder for each token sampled here). Returns the outputs ready now, and (seq, token,
        logprobs, finish reason) per sampled token for _append."""
        if isinstance(result, Exception):
            return [out for seq in sched.seqs if not seq.is_finished
                    for out in self.requests.fail(seq, result)], []
        sampled, tokens, logprobs, beams_ready, pooled, verified = result
        if verified is None:     # one token each
            runs = zip(sampled, ([t] for t in tokens), ([lp] for lp in logprobs))
        else:                    # a verify step: accepted drafts, then the drawn token
            runs = zip(sampled, verified.tokens, verified.logprobs)
        outputs, pending, stops, rejected = [], [], [], {}
        for j, (seq, run, lps) in enumerate(runs):
            if advanced:
                seq.num_output_placeholders -= 1
            if seq.is_finished:
                continue
            appended = []
            for token, lp in zip(run, lps):
                token = int(token)
                if not StructuredOutputs.advance(seq, token):
                    # its grammar failed (a limit of the library), or a bug: mask and matcher
                    # differ
                    outputs += self.requests.fail(seq, StructuredOutputs.refusal(seq, token))
                    appended = []
                    break
                seq.append_token(token)
                if seq.reasoning_budget is not None:
                    seq.reasoning_budget.advance(token)
                self.num_generation_tokens += 1
                if seq.num_output_tokens == 1 and seq.index == 0:  # the choices share one prompt
                    self.num_prompt_tokens += seq.num_prompt_tokens
                    self.requests.release_forks(seq.request)
                reason = self.outputs.token_finish_reason(seq, token)
                appended.append((seq, token, lp, reason))
                if reason is not None:     # the rest of a verified run is dropped
                    stops.append((seq, reason))
                    break
            if verified is not None and verified.num_drafts[j]:
                self.speculator.record(seq, verified.num_drafts[j], verified.num_accepted[j])
                if appended:               # rows past the appended tokens are not computed
                    rejected[seq.seq_id] = 1 + verified.num_drafts[j] - len(appended)
            at = seq.num_tokens - len(appended)       # each token's index in token_ids
            pending += [(*item, at + i) for i, item in enumerate(appended)]
        # After the appends (a verify step's accepted drafts are hashed into the prefix cache as
        # tokens), before the stops free their sequences' blocks (which stay cached).
        self.scheduler.update(sched, advanced, rejected)
        for seq, reason in stops:
            self.scheduler.finish(seq, reason)
        return (outputs + self.beams.advance(beams_ready)
                + [out for out in map(self._pool, pooled) if out is not None]), pending

    def _pool(self, pooled: tuple) -> RequestOutput | None:
        """Feed an embedding request its chunk's rows; once its last token is computed, finish
        it with the pooled vector."""
        seq, start, rows = pooled
        if seq.is_finished:          # aborted during the step
            return None
        seq.pooler.add(start, rows)
        if seq.num_computed_tokens < seq.num_tokens:
            return None
        self.requests.finish(seq, "stop")
        self.num_prompt_tokens += seq.num_prompt_tokens
        return self.outputs.pooled_output(seq)

    def _outputs(self, pending: list) -> list[RequestOutput]:
        return [out for out in (self._append(*p) for p in pending) if out is not None]

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None,
                token_reason: str | None, at: int) -> RequestOutput | None:
        """The output of a token _commit appended at index `at` of the sequence's tokens
        (OutputProcessor.token_output); a stop it makes finishes the sequence. A verify step
        appends a run of tokens at once: a stop string in one drops those after it (their
        outputs are None) and the output counts the tokens up to its own."""
        if at >= seq.num_tokens:          # dropped: a stop string ended its run before it
            return None
        out = self.outputs.token_output(seq, token, logprob, token_reason)
        dropped = seq.num_tokens - 1 - at
        if out.finished and dropped:
            del seq.token_ids[at + 1:]
            self.num_generation_tokens -= dropped
            out.token_ids = seq.output_token_ids
        out.num_output_tokens = at + 1 - seq.num_prompt_tokens
        if out.finished:
            if self.speculator is not None:
                out.spec_decode = self.speculator.counts(seq)
            self.requests.finish(seq, out.finish_reason)
        return out

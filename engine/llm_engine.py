"""The synchronous engine: add requests, call step() until done. One step = schedule, one forward
call for every scheduled sequence, sample the ones that reached their last token, check stops."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from engine.beam_search import BeamRequests
from engine.block_pool import BlockPool
from engine import cuda_memory
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.loader.hub import resolve_gguf, resolve_model
from engine.loader.safetensors import mem_available_bytes
from engine.model_runner import ModelRunner
from engine.models.registry import load_gguf_model, load_model
from engine.logprobs import gather_logprobs, to_entries
from engine.max_num_seqs import MAX_NUM_SEQS_CAP, default_max_num_seqs
from engine.outputs import RequestOutput, TokenLogprobs
from engine.placeholders import PlaceholderRows
from engine.pooling import Pooler, PoolingParams, default_pooling_config, read_pooling_config
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.structured_outputs import GrammarCompiler, StructuredOutputs
from engine.tokenizer import Tokenizer

log = logging.getLogger("taper.engine")


CUDA_ACT_DTYPES = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16",
                   "float16": "f16", "f32": "f32", "float32": "f32"}


def make_backend(config: EngineConfig):
    # Our OpenMP kernels use every core; NumPy's BLAS must not start a second pool beside them.
    threadpool_limits(limits=1, user_api="blas")
    if config.backend == "cpu":
        from pyx import cpu_threads
        from pyx.cpu_backend import CpuBackend
        backend = CpuBackend(batch_invariant=config.batch_invariant)
        log.info("CPU backend: %s", cpu_threads.describe(backend.num_threads,
                                                           backend.governor is not None))
        return backend
    if config.backend == "cuda":
        try:
            from pyx.cuda_backend import CudaBackend
        except ImportError as e:
            raise ValueError("this build of Taper has no CUDA backend (it was installed without "
                             "nvcc, or with TAPER_CUDA=0); reinstall where nvcc is on PATH") from e
        return CudaBackend(dtype=CUDA_ACT_DTYPES[config.dtype], device=config.device)
    raise ValueError(f"unknown backend {config.backend!r}: cpu or cuda")


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
        weights on the device) instead of loading config.model; there is no tokenizer then."""
        self.config = config
        if loaded is not None:
            self.backend, self.model, self.model_config = loaded
            self.model_dir, self.tokenizer = None, None
            self.pooling_config = None
        else:
            self._load()
        # How /v1/embeddings pools: the sentence-transformers config, else the last token.
        self.pooling = self.pooling_config or default_pooling_config(self.model_dir)
        if config.tokenizer:        # an explicit tokenizer wins (a GGUF's own may be missing)
            self.tokenizer = Tokenizer.try_from_pretrained(config.tokenizer)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= self.tokenizer.eos_token_ids

        kv_dtype = self.backend.kv_cache_dtype(config.kv_cache_dtype)
        if config.kv_cache_dtype == "fp8":
            log.info("FP8 (e4m3) KV cache with %s", "the checkpoint's k/v scales"
                     if getattr(self.model, "kv_scales_from_checkpoint", False)
                     else "scale 1.0 (the checkpoint has no k_scale/v_scale)")
        on_gpu = config.backend == "cuda"
        if on_gpu:
            # CuPy's current device and stream are per thread: this one profiles and captures.
            self.backend.bind_thread()
            cuda_memory.profile_forward(self.model, self.backend, config.max_num_batched_tokens,
                                        config.max_num_seqs or MAX_NUM_SEQS_CAP, config.block_size)
        num_blocks = config.num_kv_blocks or self._num_kv_blocks(kv_dtype)
        max_cached = (None if config.prefix_cache_max_tokens is None
                      else config.prefix_cache_max_tokens // config.block_size)
        self.block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                                    max_cached_blocks=max_cached)
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        if config.max_num_seqs is None:
            config.max_num_seqs, why = default_max_num_seqs(
                num_blocks * config.block_size, self.max_model_len, config.max_num_batched_tokens)
            log.info("max_num_seqs %d: %s; --max-num-seqs sets it", config.max_num_seqs, why)
        self.scheduler = Scheduler(config, self.block_pool, self.max_model_len)
        self.runner = ModelRunner(self.model, self.model_config, self.backend, config.block_size,
                                  num_blocks, config.kv_cache_dtype)
        self.sampler = Sampler(self.backend)
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}   # by seq_id
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests' choices by id
        self.forks: dict[str, list[Sequence]] = {}     # choices 1..n-1 waiting for choice 0
        self.beams = BeamRequests(self)                # beam-search requests
        self.rng = random.Random(config.seed)        # seeds for requests that bring none
        self.num_prompt_tokens = 0                   # counters for EngineStats
        self.num_generation_tokens = 0
        self._structured: StructuredOutputs | None = None    # built on first use
        self._structured_lock = threading.Lock()
        # Every step's forward and sampling run on this one thread, overlapped or not (OpenMP
        # keeps a thread pool per thread that starts parallel regions, CuPy a current device
        # and stream per thread). Async scheduling: it runs step N+1 while step() finishes N.
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="taper-forward")
        self._inflight: InflightStep | None = None     # that step
        self.async_scheduling = config.async_scheduling   # may be switched between steps
        # With async scheduling: schedule step N+1 before step N's tokens are known (output
        # placeholders), not after N's commit. May be switched between steps (benchmarks).
        self.schedule_ahead = config.schedule_ahead
        self.num_scheduled_ahead = 0      # steps scheduled ahead, and their placeholder rows
        self.num_placeholder_rows = 0
        log.info("KV cache: %d blocks of %d tokens; max model length %d", num_blocks,
                 config.block_size, self.max_model_len)
        if on_gpu:
            cuda_memory.log_pool(num_blocks, config.block_size,
                                 ModelRunner.kv_bytes_per_block(self.model_config,
                                                                config.block_size, kv_dtype),
                                 self.max_model_len, config.max_num_seqs)
            self.backend.max_context = self.max_model_len
            if config.cuda_graph:
                self._capture_cuda_graphs()

    def _load(self):
        config = self.config
        self.backend = make_backend(config)
        load_args = dict(dtype=config.dtype, yarn_scaling_factor=config.yarn_scaling_factor,
                         isq=config.isq)
        if config.weight_file:
            path = resolve_gguf(config.model, config.weight_file)
            self.model_dir = os.path.dirname(os.path.abspath(path))
            self.pooling_config = None
            self.model, self.model_config, self.tokenizer = load_gguf_model(
                path, self.backend, **load_args)
        else:
            self.model_dir = resolve_model(config.model)
            self.pooling_config = read_pooling_config(self.model_dir)
            # old sentence-transformers saves keep the transformer in a subfolder
            transformer_dir = os.path.join(self.model_dir, self.pooling_config.transformer_path
                                           if self.pooling_config else "")
            self.model, self.model_config = load_model(transformer_dir, self.backend, **load_args)
            self.tokenizer = Tokenizer.try_from_pretrained(transformer_dir)

    def _capture_cuda_graphs(self):
        from engine.cuda_graph import CudaGraphRunner
        bs = self.config.block_size
        runner = CudaGraphRunner(self.model, self.backend, self.runner.kv_caches,
                                 self.config.max_num_seqs, -(-self.max_model_len // bs),
                                 self.runner.device_block_tables)
        start = time.monotonic()
        runner.capture()
        self.runner.graph_runner = runner
        log.info("CUDA graphs: captured decode for batch sizes %s in %.1f s, %.0f MiB",
                 runner.sizes, time.monotonic() - start, runner.graph_memory_bytes / 2**20)

    def _num_kv_blocks(self, kv_dtype) -> int:
        """Blocks in the KV budget: --mem MB, else --kv-fraction of the memory left after loading
        the weights (on a GPU: after activations and CUDA graphs too), else 1 GiB on the CPU."""
        config = self.config
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, config.block_size, kv_dtype)
        if config.backend == "cuda":
            self.backend.xp.get_default_memory_pool().free_all_blocks()
            free, _ = self.backend.memory_info()
            reserved = 0
            if config.cuda_graph:
                from engine.cuda_graph import estimate_graph_memory_bytes
                reserved = estimate_graph_memory_bytes(   # max_num_seqs unknown yet: the cap
                    config.max_num_seqs or MAX_NUM_SEQS_CAP,
                    -(-self.model_config.max_model_len // config.block_size), self.model_config)
            budget, what = cuda_memory.kv_budget_bytes(free, reserved, config.kv_fraction,
                                                       config.kv_cache_memory_mb)
        elif config.kv_cache_memory_mb is not None:
            budget, what = config.kv_cache_memory_mb * 2**20, f"{config.kv_cache_memory_mb} MB"
        elif config.kv_fraction is not None:
            available = mem_available_bytes()
            if available is None:
                raise ValueError("--kv-fraction needs to know the free memory, which this system "
                                 "does not report; give --mem in MB instead")
            budget = int(available * config.kv_fraction)
            what = f"{config.kv_fraction:g} of {available / 2**30:.1f} GiB free"
        else:
            budget, what = 1024 * 2**20, "the default 1024 MB"
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({what}) holds no block")
        return num_blocks

    def _max_model_len(self, pool_tokens: int) -> int:
        model_max = self.model_config.max_model_len
        if self.config.max_model_len is not None:
            if self.config.max_model_len > model_max:
                raise ValueError(
                    f"--max-model-len {self.config.max_model_len} is larger than the model's "
                    f"context ({model_max} positions, RoPE scaling included)")
            if self.config.max_model_len > pool_tokens:
                raise ValueError(
                    f"--max-model-len {self.config.max_model_len} is larger than the KV cache can "
                    f"ever hold ({pool_tokens} tokens); raise the KV cache memory or lower it")
            return self.config.max_model_len
        if model_max > pool_tokens:
            log.warning("max model length limited to %d tokens by the KV cache (model allows %d)",
                        pool_tokens, model_max)
        return min(model_max, pool_tokens)

    # ---- requests

    def structured_outputs(self) -> StructuredOutputs:
        """Grammar compiler and matchers for structured outputs, built on first use (wrapping
        the tokenizer for llguidance takes up to a second on a 150k vocabulary). Thread-safe: the
        server compiles grammars from its worker threads."""
        with self._structured_lock:
            if self._structured is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer, and this "
                                     "model has none")
                compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                           self.eos_token_ids)
                self._structured = StructuredOutputs(compiler, self.tokenizer)
            return self._structured

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams) -> Sequence:
        """Queue a generation request (SamplingParams) or an embedding request (PoolingParams);
        returns its (first choice's) sequence. With n > 1, choice i samples with seed + i (a
        seed of its own when the request has none), and choices 1..n-1 join once choice 0 has
        computed the prompt, so their prefill finds its full blocks in the prefix cache (only
        choice 0 reports prompt logprobs)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt_token_ids, params)
        if not self.model_config.has_lm_head:
            raise ValueError("this model has no lm_head (a headless embedding checkpoint): it "
                             "serves embeddings only")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the maximum model "
                             f"length is {self.max_model_len}, which leaves no room to generate")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        bad = next((t for t in params.logit_bias or {} if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is not in the vocabulary [0, {vocab})")
        if params.use_beam_search:
            seq = Sequence(prompt_token_ids, params, request_id, arrival_time=time.monotonic())
            self.requests[request_id] = [seq]
            self.beams.add(seq, self.eos_token_ids)
            self.scheduler.add(seq)
            return seq
        seqs = [self._new_sequence(request_id, prompt_token_ids, params, 0)]
        for i in range(1, params.n):
            sibling = dataclasses.replace(
                params, prompt_logprobs=None,
                seed=None if params.seed is None else (params.seed + i) % 2**64)
            seqs.append(self._new_sequence(request_id, prompt_token_ids, sibling, i))
        self.requests[request_id] = list(seqs)
        if params.n > 1 and self.config.enable_prefix_caching:
            self.forks[request_id] = seqs[1:]
            seqs = seqs[:1]
        for seq in seqs:
            self.scheduler.add(seq)
        return self.requests[request_id][0]

    def _new_sequence(self, request_id, prompt_token_ids, params, index) -> Sequence:
        seq = Sequence(prompt_token_ids, params, request_id, arrival_time=time.monotonic(),
                       default_seed=self.rng.getrandbits(64), index=index)
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs().start(params.structured_outputs,
                                                          prompt_token_ids)
        if self.tokenizer is not None:
            self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output, params.min_tokens)
        return seq

    def _release_forks(self, request_id: str):
        for seq in self.forks.pop(request_id, []):
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[int]:
        """Finish every choice of the request; returns the indexes of those that were still
        running or waiting (empty: unknown or already finished)."""
        seqs = self.requests.pop(request_id, [])
        self.forks.pop(request_id, None)
        self.scheduler.abort(request_id)
        if request_id in self.beams:
            self.beams.searches.pop(request_id)
            return list(range(seqs[0].sampling_params.n))
        for seq in seqs:
            self.detokenizers.pop(seq.seq_id, None)
        return [seq.index for seq in seqs]

    def _add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                             params: PoolingParams) -> Sequence:
        """An embedding: the prompt is computed (in chunks, batched with everything else) and
        pooled; nothing is sampled."""
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the input has {len(prompt_token_ids)} tokens; the maximum model "
                             f"length is {self.max_model_len}")
        if params.dimensions is not None:
            problem = self.pooling.check_dimensions(params.dimensions,
                                                    self.model_config.hidden_size)
            if problem:
                raise ValueError(problem)
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        seq = Sequence(prompt_token_ids, None, request_id, arrival_time=time.monotonic(),
                       default_seed=0)
        seq.pooler = Pooler(self.pooling, params, len(prompt_token_ids))
        self.scheduler.add(seq)
        self.requests[request_id] = [seq]
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        pool, sched = self.block_pool, self.scheduler
        return EngineStats(
            num_requests_running=sched.num_running, num_requests_waiting=sched.num_waiting,
            num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free_blocks,
            prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            prompt_tokens=self.num_prompt_tokens, generation_tokens=self.num_generation_tokens)

    # ---- one step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; returns the outputs of the tokens sampled.

        With async scheduling the batch runs on the forward thread and its outputs come from the
        next call. A call with step N in flight first schedules and prepares step N+1 ahead of N
        (each sequence N samples decodes a placeholder in N+1: engine/placeholders.py), submits
        it (it queues behind N on the one forward thread, so the forward thread goes from N to
        N+1 without waiting for this one), and only then waits for N and commits it (tokens
        appended, token-level stops applied, KV blocks of finished sequences freed), and
        detokenizes and builds N's outputs while N+1 computes.

        Why that is exact:
        - N+1's sampling waits until N is committed (InflightStep.committed), so it sees N's
          tokens in the output history as the synchronous engine does: penalties count them,
          and the Philox draw and min_tokens use the same output position. Only the forward
          (which needs N's tokens as input ids and nothing else of the host's) runs earlier.
        - A sequence that N's token finishes (EOS, stop token, stop string, abort) was already
          in N+1: its row is computed and dropped when N+1 commits. One that N's token ends by
          length is not scheduled (the scheduler knows that in advance).
        - Freed blocks are never written by their next owner's steps out of order: a block freed
          on this thread (a finish, an abort, a preemption while N was in flight) goes to a
          sequence only in a later schedule, whose step runs after every step already submitted
          (one forward thread, in order; on CUDA one stream). A stale write by such an earlier
          step lands before the new owner writes, and the new owner reads only positions it has
          written, or prefix-cache blocks: those are registered only once their step has run,
          and never hold a position an in-flight step writes.
        - A sequence preempted while N was in flight keeps N's token (N's commit appends it to
          the waiting sequence), as the synchronous engine keeps output tokens across a recompute
          preemption; N+1 admits nobody (no admission in a step that preempts), so it cannot run
          again before that commit.

        The fallback (schedule after the commit, today's order) is taken when a sequence N
        samples has a grammar (its matcher must take N's token before N+1's mask is computed),
        and a beam-search step runs synchronously (a beam's fork copies KV blocks, which must
        not happen under a running forward)."""
        self.backend.bind_thread()   # CUDA: block copies and pooled rows on this thread too
        outputs = self._step()
        if self._inflight is not None and not self.scheduler.has_unfinished():
            # Every sequence of the step in flight has finished meanwhile: collect it (its rows
            # are dropped), so that nothing runs on once the engine is idle.
            last, self._inflight = self._inflight, None
            more, pending = self._collect(last)
            outputs += more + [self._append(*p) for p in pending]
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
            return outputs + [self._append(*p) for p in pending]
        # Schedule after the commit: synchronous engine, first step, the fallback above, or
        # nothing was schedulable ahead (say every sequence was finishing).
        launched = self._launch()
        if launched is None:
            return outputs + [self._append(*p) for p in pending]
        return outputs + self._keep_or_collect(launched, pending)

    def _keep_or_collect(self, step: InflightStep, pending: list) -> list[RequestOutput]:
        """Leave the launched step running (async scheduling), or wait for it and commit it now;
        then the outputs of `pending` (and of the step, when committed)."""
        if self._can_overlap(step.sched) and not step.prepare_failed:
            self._inflight = step
            return [self._append(*p) for p in pending]
        outputs = [self._append(*p) for p in pending]   # before their sequences move on
        more, pending = self._collect(step)
        return outputs + more + [self._append(*p) for p in pending]

    def _can_overlap(self, sched) -> bool:
        return (self.async_scheduling
                and not any(seq.request_id in self.beams for seq in sched.seqs))

    def _can_schedule_ahead(self, prev: InflightStep) -> bool:
        return (self.async_scheduling and self.schedule_ahead
                and not any(seq.grammar is not None for seq in sampled_seqs(prev.sched)))

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
            logits, pooled = self.runner.execute(sched, batch)
            if after is not None:
                self._await_commit(after)
            sampled = sampled_seqs(sched)
            S = len(sampled)
            beams_ready = self.beams.collect(sampled, logits[:S])
            rows = [i for i, seq in enumerate(sampled) if seq.request_id not in self.beams]
            if len(rows) < S:
                sampled = [sampled[i] for i in rows]
            mask = (self._structured.bitmask(sampled)
                    if self._structured is not None and sampled else None)
            tokens, logprobs = self.sampler.sample_with_logprobs(
                logits[:S] if len(rows) == S else logits[self.backend.asarray(np.array(rows))],
                sampled, self.eos_token_ids, self.config.logprobs_mode,
                token_bitmask=mask) if sampled else ([], [])
            self._record_prompt_logprobs(sched, logits[S:])
            return sampled, tokens, logprobs, beams_ready, pooled
        except Exception as e:  # fail this step's requests, keep serving the others
            log.exception("step failed; finishing its %d requests with an error", len(sched.seqs))
            return e

    @staticmethod
    def _await_commit(step: InflightStep):
        """Until the main thread has committed `step` (normally at once: a commit is short)."""
        step.committed.wait()

    def _commit(self, sched, result, advanced: bool = False
                ) -> tuple[list[RequestOutput], list[tuple]]:
        """Apply a step's results to the engine's state before the next schedule: computed
        tokens, sampled tokens appended (and fed to their grammars), token-level stops (stop
        token ids, EOS, length) finishing their sequences so their blocks are free, forks
        released, beams advanced, embeddings pooled. Sequences finished or aborted while the
        step ran are dropped. advanced: the next step was scheduled ahead of this one
        (scheduler.advance counted its tokens, and a placeholder for each it samples, which the
        appended token now replaces). Returns the outputs ready now, and (seq, token, logprobs,
        finish reason) per sampled token for _append."""
        if isinstance(result, Exception):
            return [out for seq in sched.seqs if not seq.is_finished
                    for out in self._finish_with_error(seq, result)], []
        sampled, tokens, logprobs, beams_ready, pooled = result
        self.scheduler.update(sched, advanced)
        outputs, pending = [], []
        for seq, token, lp in zip(sampled, tokens, logprobs):
            token = int(token)
            if advanced:
                seq.num_output_placeholders -= 1
            if seq.is_finished:
                continue
            if not StructuredOutputs.advance(seq, token):
                # the mask allowed it: a matcher and mask that disagree are a bug
                outputs += self._finish_with_error(seq, RuntimeError(
                    f"token {token} is outside the request's grammar"))
                continue
            seq.append_token(token)
            self.num_generation_tokens += 1
            if seq.num_output_tokens == 1 and seq.index == 0:  # the choices share one prompt
                self.num_prompt_tokens += seq.num_prompt_tokens
                self._release_forks(seq.request_id)
            reason = self._token_finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            pending.append((seq, token, lp, reason))
        return (outputs + self.beams.advance(beams_ready)
                + [out for out in map(self._pool, pooled) if out is not None]), pending

    def _token_finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling_params
        if token in params.stop_token_ids:
            return "stop"
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if seq.num_output_tokens == params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _record_prompt_logprobs(self, sched, logits):
        """Prompt logprobs of this step's rows (runner.execute put them after the sampled rows),
        appended to each sequence's list; positions from the schedule-time num_computed (the
        main thread may move num_computed_tokens on meanwhile)."""
        spans = [(seq, seq.prompt_logprob_positions(a, n))
                 for seq, a, n in zip(sched.seqs, sched.num_computed, sched.num_new_tokens)]
        spans = [(seq, r) for seq, r in spans if r]
        if not spans:
            return
        targets = [t for seq, r in spans for t in seq.token_ids[r.start + 1:r.stop + 1]]
        ks = [seq.sampling_params.prompt_logprobs for seq, r in spans for _ in r]
        entries = iter(to_entries(targets, *gather_logprobs(self.backend, logits, targets,
                                                            max(ks)), ks))
        for seq, r in spans:
            seq.prompt_logprobs.extend(next(entries) for _ in r)

    def _pool(self, pooled: tuple) -> RequestOutput | None:
        """Feed an embedding request its chunk's rows; once its last token is computed, finish
        it with the pooled vector."""
        seq, start, rows = pooled
        if seq.is_finished:          # aborted during the step
            return None
        seq.pooler.add(start, rows)
        if seq.num_computed_tokens < seq.num_tokens:
            return None
        self._finish(seq, "stop")
        self.num_prompt_tokens += seq.num_prompt_tokens
        return RequestOutput(seq.request_id, finished=True, finish_reason="stop",
                             num_prompt_tokens=seq.num_prompt_tokens,
                             embedding=seq.pooler.result())

    def _finish(self, seq: Sequence, reason: str):
        self.scheduler.finish(seq, reason)
        self.detokenizers.pop(seq.seq_id, None)
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and seq in seqs:
            seqs.remove(seq)
            if not seqs:
                del self.requests[seq.request_id]

    def _finish_with_error(self, seq: Sequence, error: Exception) -> list[RequestOutput]:
        """Fail the sequence, and the choices still waiting to fork from it (a beam search:
        all its beams)."""
        if seq.request_id in self.beams:
            return self.beams.finish(seq.request_id, error)
        if seq.is_finished:       # a beam already failed with its search
            return []
        failed = [seq] + (self.forks.pop(seq.request_id, []) if seq.index == 0 else [])
        for s in failed:
            self._finish(s, "error")
        return [RequestOutput(s.request_id, finished=True, finish_reason="error",
                              error=f"{type(error).__name__}: {error}",
                              num_prompt_tokens=s.num_prompt_tokens,
                              num_output_tokens=s.num_output_tokens, index=s.index)
                for s in failed]

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None = None,
                token_reason: str | None = None) -> RequestOutput:
        """The output of a token _commit appended: its text (a stop string in it finishes the
        sequence, and wins over token_reason, the stop _commit found), logprobs, finish."""
        first = seq.num_output_tokens == 1
        params = seq.sampling_params
        text_delta, stop_string = "", None
        detok = self.detokenizers.get(seq.seq_id)
        if detok is not None:
            start, waited = detok.num_decoded_chars, detok.num_waiting_tokens
            text_delta, stopped = detok.add_token(token)
            if stopped:
                stop_string = detok.stop_reason
            if logprob is not None:
                end = detok.num_decoded_chars
                if waited and end > start:  # the text of earlier tokens came out with this one
                    own = detok.decode_one(token)
                    start = max(start, end - len(own))
                logprob.text_offset = start
                seq.pending_logprobs.append((logprob, end))
        elif logprob is not None:
            seq.pending_logprobs.append((logprob, 0))
        reason, stop_reason = token_reason, None
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
        elif token_reason == "stop" and token in params.stop_token_ids:
            stop_reason = token
        finished = reason is not None
        if finished:
            self._finish(seq, reason)
            seq.finish_reason = reason
            if detok is not None:
                text_delta += detok.flush() if stop_string is None else ""
        # The whole output is filled in once, at the end (copying it every token is quadratic).
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=[token], text_delta=text_delta,
            token_ids=seq.output_token_ids if finished else [],
            text=detok.text if finished and detok else "",
            finished=finished, finish_reason=reason, stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, index=seq.index,
            logprobs=(_released_logprobs(seq, detok, finished, stop_string is not None)
                      if params.logprobs is not None else None),
            prompt_logprobs=seq.prompt_logprobs if first else None)


def _released_logprobs(seq: Sequence, detok, finished: bool, stopped_by_string: bool
                       ) -> list[TokenLogprobs]:
    """The pending logprobs whose token's text has been released: all of it, or at the end any
    of it. A token whose text a stop string cut away entirely gets none."""
    pending = seq.pending_logprobs
    if detok is None or (finished and not stopped_by_string):
        seq.pending_logprobs = []
        return [lp for lp, _ in pending]
    emitted = detok.num_emitted_chars
    n = 0
    while n < len(pending) and pending[n][1] <= emitted:
        n += 1
    out = [lp for lp, _ in pending[:n]]
    if finished:      # stopped by a stop string: the tokens whose text starts before its cut
        out += [lp for lp, _ in pending[n:] if lp.text_offset < emitted]
        n = len(pending)
    seq.pending_logprobs = pending[n:]
    return out

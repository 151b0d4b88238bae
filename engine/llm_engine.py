"""The synchronous engine: add requests, call step() until done. One step = schedule, one forward
call for every scheduled sequence, sample the ones that reached their last token, check stops."""
from __future__ import annotations

import logging
import os
import random
import time

from threadpoolctl import threadpool_limits

from engine.block_pool import BlockPool
from engine import cuda_memory
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.loader.hub import resolve_gguf, resolve_model
from engine.loader.safetensors import mem_available_bytes
from engine.model_runner import ModelRunner
from engine.models.registry import load_gguf_model, load_model
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer

log = logging.getLogger("taper.engine")


CUDA_ACT_DTYPES = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16",
                   "float16": "f16", "f32": "f32", "float32": "f32"}


def make_backend(config: EngineConfig):
    # Our OpenMP kernels use every core; NumPy's BLAS must not start a second pool beside them.
    threadpool_limits(limits=1, user_api="blas")
    if config.backend == "cpu":
        from pyx.cpu_backend import CpuBackend
        return CpuBackend(batch_invariant=config.batch_invariant)
    if config.backend == "cuda":
        try:
            from pyx.cuda_backend import CudaBackend
        except ImportError as e:
            raise ValueError("this build of Taper has no CUDA backend (it was installed without "
                             "nvcc, or with TAPER_CUDA=0); reinstall where nvcc is on PATH") from e
        return CudaBackend(dtype=CUDA_ACT_DTYPES[config.dtype], device=config.device)
    raise ValueError(f"unknown backend {config.backend!r}: cpu or cuda")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        """loaded: (backend, model, model_config) built by the caller (benchmarks that generate
        weights on the device) instead of loading config.model; there is no tokenizer then."""
        self.config = config
        if loaded is not None:
            self.backend, self.model, self.model_config = loaded
            self.model_dir, self.tokenizer = None, None
        else:
            self._load()
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
                                        config.max_num_seqs, config.block_size)
        num_blocks = config.num_kv_blocks or self._num_kv_blocks(kv_dtype)
        max_cached = (None if config.prefix_cache_max_tokens is None
                      else config.prefix_cache_max_tokens // config.block_size)
        self.block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                                    max_cached_blocks=max_cached)
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        self.scheduler = Scheduler(config, self.block_pool)
        self.runner = ModelRunner(self.model, self.model_config, self.backend, config.block_size,
                                  num_blocks, config.kv_cache_dtype)
        self.sampler = Sampler(self.backend)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.requests: dict[str, Sequence] = {}      # unfinished requests by id
        self.rng = random.Random(config.seed)        # seeds for requests that bring none
        self.num_prompt_tokens = 0                   # counters for EngineStats
        self.num_generation_tokens = 0
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
            self.model, self.model_config, self.tokenizer = load_gguf_model(
                path, self.backend, **load_args)
        else:
            self.model_dir = resolve_model(config.model)
            self.model, self.model_config = load_model(self.model_dir, self.backend, **load_args)
            self.tokenizer = Tokenizer.try_from_pretrained(self.model_dir)

    def _capture_cuda_graphs(self):
        from engine.cuda_graph import CudaGraphRunner
        bs = self.config.block_size
        runner = CudaGraphRunner(self.model, self.backend, self.runner.kv_caches,
                                 self.config.max_num_seqs, -(-self.max_model_len // bs))
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
                reserved = estimate_graph_memory_bytes(
                    config.max_num_seqs, -(-self.model_config.max_model_len // config.block_size),
                    self.model_config)
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

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Sequence:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if params.n != 1 or params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("n > 1, logprobs and prompt_logprobs are not yet supported")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the maximum model "
                             f"length is {self.max_model_len}, which leaves no room to generate")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(prompt_token_ids, params, request_id, arrival_time=time.monotonic(),
                       default_seed=self.rng.getrandbits(64))
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output, params.min_tokens)
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        self.detokenizers.pop(request_id, None)
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id)

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
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        self.backend.bind_thread()   # CUDA: this thread's current device and stream
        try:
            logits = self.runner.execute(sched)
            sampled = [seq for seq, last in zip(sched.seqs, sched.sample) if last]
            tokens = self.sampler.sample(logits, sampled, self.eos_token_ids) if sampled else []
        except Exception as e:  # fail this step's requests, keep serving the others
            log.exception("step failed; finishing its %d requests with an error", len(sched.seqs))
            return [self._finish_with_error(seq, e) for seq in sched.seqs]
        self.scheduler.update(sched)
        return [self._append(seq, int(token)) for seq, token in zip(sampled, tokens)]

    def _finish(self, seq: Sequence, reason: str):
        self.scheduler.finish(seq, reason)
        self.detokenizers.pop(seq.request_id, None)
        self.requests.pop(seq.request_id, None)

    def _finish_with_error(self, seq: Sequence, error: Exception) -> RequestOutput:
        self._finish(seq, "error")
        return RequestOutput(seq.request_id, finished=True, finish_reason="error",
                             error=f"{type(error).__name__}: {error}",
                             num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens)

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.append_token(token)
        self.num_generation_tokens += 1
        if seq.num_output_tokens == 1:
            self.num_prompt_tokens += seq.num_prompt_tokens
        params = seq.sampling_params
        text_delta, stop_string = "", None
        detok = self.detokenizers.get(seq.request_id)
        if detok is not None:
            text_delta, stopped = detok.add_token(token)
            if stopped:
                stop_string = detok.stop_reason
        reason = stop_reason = None
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif seq.num_output_tokens == params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        finished = reason is not None
        if finished:
            self._finish(seq, reason)
            if detok is not None:
                text_delta += detok.flush() if stop_string is None else ""
        # The whole output is filled in once, at the end (copying it every token is quadratic).
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=[token], text_delta=text_delta,
            token_ids=seq.output_token_ids if finished else [],
            text=detok.text if finished and detok else "",
            finished=finished, finish_reason=reason, stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens)

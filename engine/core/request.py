"""One request's state, in one object the engine adds and removes whole, and its admission.

A Request owns what belongs to the request rather than to one row of a batch: its live sequences
(the n choices, or the beams of a beam search), the choices waiting to fork from choice 0, the beam
search, each choice's detokenizer and logprobs waiting for their text, and the prompt logprobs.
Sequences keep what a step computes with (tokens, blocks, seed, penalty counts, grammar, pooler)
and point back to their request.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.models.model_config import ModelConfig
from engine.sampling.beam_search import BeamSearch
from engine.sampling.pooling import Pooler, PoolingConfig, PoolingParams
from engine.sampling.reasoning_budget import ReasoningBudget
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.structured_outputs import GrammarCompiler, StructuredOutputs
from engine.text.detokenizer import IncrementalDetokenizer
from engine.vision.families import place_images
from engine.vision.inputs import MultimodalPrompt


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    params: SamplingParams | PoolingParams
    num_prompt_tokens: int
    seqs: list[Sequence] = field(default_factory=list)   # live: the choices, or the beams
    forks: list[Sequence] = field(default_factory=list)  # choices 1..n-1 awaiting choice 0's prompt
    beam: BeamSearch | None = None
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)  # by choice
    # By choice: output logprobs waiting for their token's text to be released, (entry, text end).
    pending_logprobs: dict[int, list] = field(default_factory=dict)
    # Entry j for prompt token j (None for token 0), filled chunk by chunk as the prefill computes
    # the rows; None when the request asked for none (only choice 0 computes them).
    prompt_logprobs: list | None = None
    paused: bool = False      # its reader is behind (AsyncEngine): the scheduler skips it
    mm: MultimodalPrompt | None = None   # the prompt's images (engine/vision/inputs.py)
    lora: object = None       # the engine.lora.adapter.LoraAdapter it runs; None: the base model

    def prompt_logprob_positions(self, num_computed: int, num_new_tokens: int) -> range:
        """Positions, among the num_new_tokens a step computes from num_computed (choice 0's
        num_computed_tokens when scheduled), whose logits give a prompt token's logprob not yet
        known: position p predicts prompt token p + 1."""
        if self.prompt_logprobs is None:
            return range(0)
        start = max(num_computed, len(self.prompt_logprobs) - 1)
        end = min(num_computed + num_new_tokens, self.num_prompt_tokens - 1)
        return range(start, max(start, end))

    def remove(self, seq: Sequence):
        """A finished sequence leaves the live ones."""
        if seq in self.seqs:
            self.seqs.remove(seq)
        self.detokenizers.pop(seq.index, None)

    @property
    def is_done(self) -> bool:
        return not self.seqs and not self.forks and self.beam is None


class RequestTable(dict):
    """The unfinished requests by id, and how their sequences leave the scheduler: finished (a
    request with nothing left goes), failed (with the choices waiting to fork from them), or the
    whole request aborted. Beam searches end through BeamRequests.finish."""

    def __init__(self, scheduler, beams, outputs):
        super().__init__()
        self.scheduler = scheduler
        self.beams = beams            # sampling.beam_search.BeamRequests
        self.outputs = outputs        # core.output_processor.OutputProcessor

    def add(self, request: Request):
        if request.request_id in self:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[int]:
        """Finish every choice of the request; returns the indexes of those that were still
        running or waiting (empty: unknown or already finished)."""
        request = self.pop(request_id, None)
        self.scheduler.abort(request_id)
        if request is None:
            return []
        if request.beam is not None:
            return list(range(request.params.n))
        return [seq.index for seq in request.seqs + request.forks]

    def release_forks(self, request: Request):
        """Choice 0 has computed the prompt: the other choices start, on its cached blocks."""
        forks, request.forks = request.forks, []
        request.seqs += forks
        for seq in forks:
            self.scheduler.add(seq)

    def finish(self, seq: Sequence, reason: str):
        self.scheduler.finish(seq, reason)
        request = seq.request
        request.remove(seq)
        if request.is_done and self.get(request.request_id) is request:
            del self[request.request_id]

    def fail(self, seq: Sequence, error: Exception) -> list:
        """Fail the sequence, and the choices still waiting to fork from it (a beam search:
        all its beams); their outputs."""
        request = seq.request
        if request.beam is not None:
            return self.beams.finish(request, error)
        if seq.is_finished:       # a beam already failed with its search
            return []
        failed = [seq]
        if seq.index == 0:
            failed, request.forks = failed + request.forks, []
        for s in failed:
            self.finish(s, "error")
        return [self.outputs.error_output(s, error) for s in failed]


class Admission:
    """Validates a request against the model and builds its Request and sequences."""

    def __init__(self, model_config: ModelConfig, max_model_len: int, tokenizer,
                 eos_token_ids: set[int], pooling: PoolingConfig, enable_prefix_caching: bool,
                 seed: int, lora=None):
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.pooling = pooling
        self.enable_prefix_caching = enable_prefix_caching
        self.lora = lora          # an engine.lora.manager.LoraManager (--enable-lora), or None
        self.rng = random.Random(seed)        # seeds for requests that bring none
        self.structured: StructuredOutputs | None = None    # built on first use
        self._structured_lock = threading.Lock()

    def structured_outputs(self) -> StructuredOutputs:
        """Grammar compiler and matchers for structured outputs, built on first use (wrapping
        the tokenizer for llguidance takes up to a second on a 150k vocabulary). Thread-safe: the
        server compiles grammars from its worker threads."""
        with self._structured_lock:
            if self.structured is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer, and this "
                                     "model has none")
                compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                           self.eos_token_ids)
                self.structured = StructuredOutputs(compiler, self.tokenizer)
            return self.structured

    def admit(self, request_id: str, prompt_token_ids: list[int],
              params: SamplingParams | PoolingParams, images: list | None = None) -> Request:
        """The request, its sequences to schedule in `seqs`. With n > 1, choice i samples with
        seed + i (a seed of its own when the request has none), and choices 1..n-1 wait in
        `forks` until choice 0 has computed the prompt, so their prefill finds its full blocks in
        the prefix cache (only choice 0 reports prompt logprobs)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if isinstance(params, PoolingParams):
            return self._admit_pooling(request_id, prompt_token_ids, params)
        if not self.model_config.has_lm_head:
            raise ValueError("this model has no lm_head (a headless embedding checkpoint): it "
                             "serves embeddings only")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the maximum model "
                             f"length is {self.max_model_len}, which leaves no room to generate")
        self._check_token_ids(prompt_token_ids, "prompt token ids")
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias or {} if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is not in the vocabulary [0, {vocab})")
        request = Request(request_id, params, len(prompt_token_ids),
                          prompt_logprobs=None if params.prompt_logprobs is None else [None],
                          mm=self._place_images(prompt_token_ids, images),
                          lora=self._lora(params.lora_name))
        if params.use_beam_search:
            if self.model_config.linear_attention is not None:
                raise ValueError("beam search is not supported for hybrid linear-attention "
                                 "models: a beam's recurrent state cannot be forked yet")
            request.seqs = [self._sequence(request, prompt_token_ids, params, 0, seed=0)]
            limit = (params.max_tokens if params.max_tokens is not None
                     else self.max_model_len - len(prompt_token_ids))
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                 else set(self.eos_token_ids))
            request.beam = BeamSearch(params.beam_width, len(prompt_token_ids), limit, ends,
                                      params.length_penalty, params.early_stopping)
            return request
        choices = [self._sequence(request, prompt_token_ids, params, 0)]
        for i in range(1, params.n):
            sibling = dataclasses.replace(
                params, prompt_logprobs=None,
                seed=None if params.seed is None else (params.seed + i) % 2**64)
            choices.append(self._sequence(request, prompt_token_ids, sibling, i))
        if params.n > 1 and self.enable_prefix_caching:
            request.seqs, request.forks = choices[:1], choices[1:]
        else:
            request.seqs = choices
        return request

    def _place_images(self, prompt_token_ids: list[int], images: list | None):
        """The prompt's images (engine/vision/preprocess.py ProcessedImage) placed at its image
        tokens; a ValueError for images sent to a text-only model, or runs that do not match."""
        vision = self.model_config.vision
        if not images:
            if vision is not None and vision.image_token_id in prompt_token_ids:
                raise ValueError("the prompt has image tokens but no images")
            return None
        if vision is None:
            raise ValueError(f"this model ({self.model_config.architecture}) is text-only: it "
                             "takes no images")
        return place_images(prompt_token_ids, images, vision)

    def _lora(self, name: str | None):
        """The loaded adapter called `name` (None: the base model); ValueError naming it when
        there is none."""
        if name is None:
            return None
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r}: LoRA adapters are not enabled on this "
                             "engine (--enable-lora)")
        return self.lora.get(name)

    def _sequence(self, request: Request, prompt_token_ids: list[int], params: SamplingParams,
                  index: int, seed: int | None = None) -> Sequence:
        seq = Sequence(prompt_token_ids, params, request.request_id,
                       arrival_time=time.monotonic(), index=index,
                       default_seed=self.rng.getrandbits(64) if seed is None else seed)
        seq.request = request
        seq.mm = request.mm
        if params.use_beam_search:
            return seq
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs().start(params.structured_outputs,
                                                          prompt_token_ids)
        if params.reasoning_budget is not None:
            seq.reasoning_budget = ReasoningBudget.start(self.tokenizer, params.reasoning_budget,
                                                         prompt_token_ids)
        if self.tokenizer is not None:
            request.detokenizers[index] = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output, params.min_tokens)
        return seq

    def _admit_pooling(self, request_id: str, prompt_token_ids: list[int],
                       params: PoolingParams) -> Request:
        """An embedding (or token logits at the last position): the prompt is computed (in
        chunks, batched with everything else) and pooled; nothing is sampled."""
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the input has {len(prompt_token_ids)} tokens; the maximum model "
                             f"length is {self.max_model_len}")
        if params.dimensions is not None:
            problem = self.pooling.check_dimensions(params.dimensions,
                                                    self.model_config.hidden_size)
            if problem:
                raise ValueError(problem)
        if params.token_ids is not None:
            if not self.model_config.has_lm_head:
                raise ValueError("this model has no lm_head (a headless embedding checkpoint): "
                                 "it has no token logits to score with")
            self._check_token_ids(list(params.token_ids), "token_ids")
        self._check_token_ids(prompt_token_ids, "token ids")
        request = Request(request_id, params, len(prompt_token_ids))
        seq = Sequence(prompt_token_ids, None, request_id, arrival_time=time.monotonic(),
                       default_seed=0)
        seq.request = request
        seq.pooler = Pooler(self.pooling, params, len(prompt_token_ids))
        request.seqs = [seq]
        return request

    def _check_token_ids(self, token_ids: list[int], what: str):
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"{what} must be in [0, {vocab})")

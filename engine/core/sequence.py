"""One request's token stream and its place in the paged KV cache."""
from __future__ import annotations

import enum
import itertools
import random

from engine.sampling.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_ids = itertools.count()


class Sequence:
    """Tokens so far (prompt + output) and how many of them have K/V in the cache.

    The engine's single rule: `num_computed_tokens` catches up to `num_tokens`. A prompt, a
    prefill chunk and a decode step are all "compute the next few uncomputed tokens"; when a step
    computes the last token, its logits sample the next one.
    """

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, arrival_time: float = 0.0,
                 default_seed: int | None = None, index: int = 0):
        self.seq_id = next(_ids)
        self.index = index              # the request's choice this sequence produces (n > 1)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled by a step still in flight, not appended yet (the scheduler ran ahead of
        # that step: engine/core/scheduler.py); 0 or 1.
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0      # prompt tokens served from the prefix cache (first hit)
        self.block_table: list[int] = []
        self.trimmed_to: int | None = None   # BlockPool.trim cut the table to this many blocks
        self.block_hashes: list[int] = []  # hash chain of this sequence's full blocks
        self.finish_reason: str | None = None
        self.arrival_time = arrival_time
        self.num_preemptions = 0
        self.request = None             # the engine.core.request.Request it belongs to
        self.pooler = None              # an embedding request's Pooler: pool, never sample
        self.grammar = None             # structured outputs: a structured_outputs.GrammarState
        self.reasoning_budget = None    # a reasoning_budget.ReasoningBudget
        self.token_counts = None        # the sampler's penalty counts (engine/sampling/sampler.py)
        self.spec = None                # speculative decoding's SpecState (engine/spec/adaptive.py)
        self.mm = None                  # the prompt's images (engine/vision/inputs.py)
        # The request's seed, else the engine's draw for it, else a random one.
        seed = self.sampling_params.seed
        if seed is None:
            seed = default_seed if default_seed is not None else random.getrandbits(64)
        self.seed = seed

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_scheduled(self) -> int:
        """num_tokens with the placeholders: what the scheduler schedules towards."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_every_prompt_token(self) -> bool:
        """Prompt logprobs and mean/CLS pooling read rows a prefix-cache hit would skip."""
        return (self.sampling_params.prompt_logprobs is not None
                or (self.pooler is not None and self.pooler.needs_every_token))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Choice 0 of a request that asked for prompt logprobs (its Request keeps them)."""
        return self.sampling_params.prompt_logprobs is not None and self.request is not None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")

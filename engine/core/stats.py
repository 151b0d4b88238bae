"""A snapshot of the engine's state and counters, read by the server's /metrics at scrape time."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int          # never-used blocks and unreferenced prefix-cache blocks
    prefix_cache_queries: int        # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int           # of those, tokens found
    num_preemptions: int
    prompt_tokens: int               # prompt tokens of requests that produced their first token
    generation_tokens: int           # tokens generated
    # speculative decoding (engine/spec/speculator.py SpecStats); method None: off
    spec_method: str | None = None
    spec_num_drafts: int = 0         # verify steps of a sequence with at least one draft
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        return (self.spec_num_accepted_tokens / self.spec_num_draft_tokens
                if self.spec_num_draft_tokens else 0.0)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify step emits per sequence: its accepted drafts plus the drawn one."""
        return (1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts
                if self.spec_num_drafts else 0.0)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by some request, in [0, 1] (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    @classmethod
    def of(cls, engine) -> "EngineStats":
        """The snapshot of an LLMEngine now."""
        pool, sched = engine.block_pool, engine.scheduler
        spec = {}
        if engine.speculator is not None:
            st = engine.speculator.stats
            spec = dict(spec_method=st.method, spec_num_drafts=st.num_drafts,
                        spec_num_draft_tokens=st.num_draft_tokens,
                        spec_num_accepted_tokens=st.num_accepted_tokens,
                        spec_accepted_per_position=tuple(st.accepted_per_position))
        return cls(
            num_requests_running=sched.num_running, num_requests_waiting=sched.num_waiting,
            num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free_blocks,
            prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            prompt_tokens=engine.num_prompt_tokens,
            generation_tokens=engine.num_generation_tokens, **spec)

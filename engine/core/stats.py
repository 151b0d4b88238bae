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

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by some request, in [0, 1] (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    @classmethod
    def of(cls, engine) -> "EngineStats":
        """The snapshot of an LLMEngine now."""
        pool, sched = engine.block_pool, engine.scheduler
        return cls(
            num_requests_running=sched.num_running, num_requests_waiting=sched.num_waiting,
            num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free_blocks,
            prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            prompt_tokens=engine.num_prompt_tokens,
            generation_tokens=engine.num_generation_tokens)

"""Offline generation: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.sampling.pooling import PoolingParams
from engine.sampling.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **config):
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._request_ids = itertools.count()

    def embed(self, prompts, dimensions: int | None = None) -> list[RequestOutput]:
        """Embeddings (each output's `.embedding`) of strings or lists of token ids, in order,
        pooled as the checkpoint says (engine/sampling/pooling.py)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.generate(prompts, [PoolingParams(dimensions)] * len(prompts))

    def generate(self, prompts,
                 sampling_params: SamplingParams | PoolingParams | list | None = None
                 ) -> list[RequestOutput]:
        """prompts: strings or lists of token ids. Returns each request's final output, in order;
        for a request with n > 1, the list of its n choices' final outputs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        tokenizer = self.engine.tokenizer
        if tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("this model has no tokenizer: pass token ids")
        order = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                request_id = f"offline-{next(self._request_ids)}"
                self.engine.add_request(request_id, ids, params)
                order[request_id] = i
        except Exception:  # one bad prompt: leave nothing of this call in the engine
            for request_id in order:
                self.engine.abort(request_id)
            raise
        results: list = [[None] * p.n for p in sampling_params]
        logprobs: dict[tuple[str, int], list] = {}    # outputs carry theirs step by step
        prompt_logprobs: dict[str, list] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                key = (out.request_id, out.index)
                if out.logprobs is not None:
                    logprobs.setdefault(key, []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    out.logprobs = logprobs.pop(key, out.logprobs)
                    out.prompt_logprobs = prompt_logprobs.get(out.request_id)
                    results[order[out.request_id]][out.index] = out
        return [r[0] if len(r) == 1 else r for r in results]

"""POST /v1/embeddings: OpenAI's embeddings API over the engine's pooling (engine/sampling/pooling.py).

Each input becomes one engine request that computes its prompt (chunked and batched with
everything else) and pools it instead of sampling; the inputs of one call run concurrently. An
embedding checkpoint (sentence-transformers' modules.json) pools as it says; any other model
pools its last token and L2-normalizes, as vLLM does for decoder-only models.
"""
from __future__ import annotations

import asyncio
import base64
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator
from quart import request

from engine.sampling.pooling import PoolingParams
from engine.text.tokenizer import TextTooLong
from server import json_io, request_body, streaming, tokenizing
from server.protocol import APIError, _Request


class EmbeddingRequest(_Request):
    # inputs: --max-prompts, 2048 by default as OpenAI's (a token-id input's length is bounded
    # by the model's context instead)
    limited_fields: ClassVar[dict[str, str]] = {"input": "prompts"}
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None     # None (or null): float
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v):
        if v == "":
            raise ValueError("must not be an empty string")
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be an empty array")
            if any(x == "" or x == [] for x in v):
                raise ValueError("must not hold empty strings or empty token arrays")
            flat = [t for x in v for t in x] if isinstance(v[0], list) else v
            if isinstance(flat[0], int) and min(flat) < 0:
                raise ValueError("token ids must be non-negative")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The batch: each element a text or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


def encode(vector: np.ndarray, encoding_format: str):
    """float: a list of numbers; base64: the little-endian float32 bytes, as OpenAI's SDK
    decodes them (np.frombuffer(..., dtype="float32"))."""
    vector = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


async def pool_batch(state, engine, request_id: str, batch_ids: list[list[int]],
                     params: PoolingParams, param: str) -> list[np.ndarray]:
    """Each prompt's pooled vector (an embedding, or token logits), in order: one engine request
    per prompt, all submitted at once so the engine computes them together. `state` is
    server/app.py's ServerState (its metrics time each request); `param` names the input in the
    engine's refusals."""
    async def pool_one(request_id: str, ids: list[int]):
        timing = state.metrics.request()
        async for out in streaming.engine_outputs(engine, request_id, ids, params, timing, param):
            if out.finish_reason == "error":
                raise APIError(f"The engine failed on this request: {out.error}", status=500,
                               type="server_error", code="engine_error")
            if out.finish_reason == "abort":
                raise APIError("The request was aborted by the engine (is the server shutting "
                               "down?)", status=503, type="server_error", code="aborted")
            if out.finished:
                return out.embedding
        raise APIError("The engine ended the request without an embedding", status=500,
                       type="server_error", code="engine_error")

    tasks = [asyncio.ensure_future(pool_one(f"{request_id}-{i}", ids))
             for i, ids in enumerate(batch_ids)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:   # a failed input (or a client gone) cancels the others, whose
        for task in tasks:  # streams then abort them in the engine
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def register_embeddings(app, state, check_queue) -> None:
    """Adds POST /v1/embeddings to `app`, served from `state` (server/app.py's ServerState);
    `check_queue` is create_app's, each input counting one sequence."""
    settings = state.settings

    async def tokenize(engine, inputs: list) -> list[list[int]]:
        if any(isinstance(x, str) for x in inputs) and engine.tokenizer is None:
            raise APIError("This model has no tokenizer: send token ids", param="input",
                           code="no_tokenizer")
        limit = None
        if engine.tokenizer is not None:
            tokenizing.check_lengths(engine, inputs, "input")
            limit = tokenizing.max_text_chars(engine)
        try:   # off the event loop, a few at a time, never a text that cannot fit
            return await tokenizing.run(
                lambda: [engine.tokenizer.encode(x, max_chars=limit) if isinstance(x, str) else x
                         for x in inputs])
        except TextTooLong as e:
            raise tokenizing.too_long(engine, e, "input") from None
        except (TypeError, ValueError, UnicodeError) as e:
            raise APIError(f"input could not be tokenized: {e}", param="input",
                           code="invalid_value") from None

    def check_request(engine, req: EmbeddingRequest, batch_ids: list[list[int]]):
        max_len = engine.max_model_len
        for i, ids in enumerate(batch_ids):
            if len(ids) > max_len:
                where = "input" if len(batch_ids) == 1 else f"input[{i}]"
                raise APIError(f"This model's maximum context length is {max_len} tokens, and "
                               f"the {where} has {len(ids)} tokens. Please shorten it.",
                               param="input", code="context_length_exceeded")
        if req.dimensions is not None:
            problem = engine.pooling.check_dimensions(req.dimensions,
                                                      engine.model_config.hidden_size)
            if problem:
                raise APIError(problem, param="dimensions", code="invalid_value")
        check_queue(engine, len(batch_ids), param="input")

    @app.post("/v1/embeddings")
    async def create_embeddings():
        req = await request_body.read(await request.get_data(), EmbeddingRequest, state.engine,
                                      settings.limits)
        engine = state.ready_engine()
        model = state.resolve_model(req.model)
        batch_ids = await tokenize(engine, req.inputs())
        check_request(engine, req, batch_ids)
        vectors = await pool_batch(state, engine, streaming.random_id("embd"), batch_ids,
                                   PoolingParams(req.dimensions), "input")
        num_tokens = sum(len(ids) for ids in batch_ids)
        body = {"object": "list", "model": model,
                "data": [{"object": "embedding", "index": i,
                          "embedding": encode(vector, req.encoding_format)}
                         for i, vector in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
        return await json_io.response(body)

"""From engine outputs to OpenAI chunks, SSE frames, and (folded) whole responses.

One code path: a request always becomes an async stream of *chunk* dicts, exactly the objects a
streaming client receives, ending with a usage chunk (`choices: []`). Streaming sends them as
server-sent events (dropping the usage chunk unless `stream_options.include_usage`); a
non-streaming response is the fold of the same chunks.

Whoever stops reading a request's outputs early (client gone, task cancelled, error) aborts it in
the engine: `engine_outputs` does that in its `finally`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.outputs import RequestOutput
from server.metrics import RequestTiming
from server.protocol import APIError

log = logging.getLogger("taper.server")

_FINISH_REASONS = {"stop": "stop", "length": "length"}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponseInfo:
    """What every chunk of one response repeats."""
    id: str
    model: str
    object: str                       # the chunk's object: chat.completion.chunk | text_completion
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


async def engine_outputs(engine, request_id: str, prompt_ids: list[int], params,
                         timing: RequestTiming, param: str) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, timed by `timing`. Closing this closes the engine's
    stream, which aborts the request unless it ran to its end. A refusal names `param`, the
    request field the prompt came from."""
    try:
        async with contextlib.aclosing(engine.add_request(request_id, prompt_ids, params)) as outs:
            async for out in outs:
                timing.on_output(out)
                yield out
                if out.finished:
                    return
    except ValueError as e:          # the engine refused the request: the client's fault
        timing.discard()
        raise APIError(f"{param}: {e}", param=param, code="invalid_value") from None
    except RuntimeError as e:        # the engine is stopped or its loop died
        raise APIError(f"The engine failed: {e}", status=503, type="server_error",
                       code="engine_error") from None
    finally:
        timing.close()


def _check_output(out: RequestOutput):
    if out.finish_reason == "error":
        raise APIError(f"The engine failed on this request: {out.error or 'unknown error'}",
                       status=500, type="server_error", code="engine_error")
    if out.finish_reason == "abort":
        raise APIError("The request was aborted by the engine (is the server shutting down?)",
                       status=503, type="server_error", code="aborted")


@dataclass(slots=True)
class _Usage:
    """Token counts summed over a response's requests, and candle-vllm's time costs (ms): for a
    batch, the slowest request's."""
    timings: list[RequestTiming]
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def add(self, out: RequestOutput, num_prompt_tokens: int):
        self.prompt += out.num_prompt_tokens or num_prompt_tokens
        self.completion += out.num_output_tokens or len(out.token_ids)
        self.cached += out.num_cached_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "prompt_time_costs": round(max(t.prompt_time_ms for t in self.timings)),
                "completion_time_costs": round(max(t.completion_time_ms for t in self.timings))}


# ---- chat

async def chat_chunks(info: ResponseInfo, outputs: AsyncIterator[RequestOutput],
                      num_prompt_tokens: int, timing: RequestTiming) -> AsyncIterator[dict]:
    """Chunks of one chat completion: role, content deltas, finish, usage.

    The role chunk waits for the engine's first output, so a request the engine refuses fails
    before anything is sent (and can still get a proper HTTP status).
    """
    def choice(delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    usage = _Usage([timing])
    role_sent = False
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            _check_output(out)
            if not role_sent:
                yield info.chunk([choice({"role": "assistant", "content": ""})])
                role_sent = True
            if out.text_delta:
                yield info.chunk([choice({"content": out.text_delta})])
            if out.finished:
                yield info.chunk([choice({}, _FINISH_REASONS[out.finish_reason])])
                usage.add(out, num_prompt_tokens)
                break
        else:
            raise APIError("The engine ended the request without finishing it",
                           status=500, type="server_error", code="engine_error")
    yield info.chunk([], usage.as_dict())


async def fold_chat(info: ResponseInfo, chunks: AsyncIterator[dict]) -> dict:
    content: list[str] = []
    finish_reason, usage = None, None
    async for c in chunks:
        if c.get("usage") is not None:
            usage = c["usage"]
        for ch in c["choices"]:
            content.append(ch["delta"].get("content") or "")
            finish_reason = ch["finish_reason"] or finish_reason
    message = {"role": "assistant", "content": "".join(content), "refusal": None}
    return {"id": info.id, "object": "chat.completion", "created": info.created,
            "model": info.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage}


# ---- completions

async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((i, item, None))
        except Exception as e:              # handed to the consumer, which re-raises it
            await queue.put((i, None, e))
        await queue.put((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def completion_chunks(info: ResponseInfo, streams: list[AsyncIterator[RequestOutput]],
                            num_prompt_tokens: list[int], timings: list[RequestTiming],
                            echo: list[str] | None = None) -> AsyncIterator[dict]:
    """Chunks of a (batched) completion: choice i is prompt i; text deltas, finish, usage."""
    def choice(i: int, text: str, finish_reason: str | None = None) -> dict:
        return {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason}

    usage = _Usage(timings)
    pending_echo = list(echo) if echo else [""] * len(streams)
    finished = [False] * len(streams)
    async with contextlib.aclosing(_merge(streams)) as merged:
        async for i, out in merged:
            _check_output(out)
            text = pending_echo[i] + out.text_delta
            pending_echo[i] = ""
            if text:
                yield info.chunk([choice(i, text)])
            if out.finished:
                finished[i] = True
                yield info.chunk([choice(i, "", _FINISH_REASONS[out.finish_reason])])
                usage.add(out, num_prompt_tokens[i])
    if not all(finished):
        raise APIError("The engine ended a request without finishing it",
                       status=500, type="server_error", code="engine_error")
    yield info.chunk([], usage.as_dict())


async def fold_completion(info: ResponseInfo, chunks: AsyncIterator[dict], n: int) -> dict:
    texts: list[list[str]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    usage = None
    async for c in chunks:
        if c.get("usage") is not None:
            usage = c["usage"]
        for ch in c["choices"]:
            texts[ch["index"]].append(ch["text"])
            reasons[ch["index"]] = ch["finish_reason"] or reasons[ch["index"]]
    choices = [{"index": i, "text": "".join(texts[i]), "logprobs": None,
                "finish_reason": reasons[i]} for i in range(n)]
    return {"id": info.id, "object": "text_completion", "created": info.created,
            "model": info.model, "choices": choices, "usage": usage}


# ---- server-sent events

def sse_event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(info: ResponseInfo, first: dict | None,
                     chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE frames for `first` then the rest of `chunks`, then [DONE].

    An error after the response has started goes out as an `{"error": ...}` event (the OpenAI SDK
    raises it). Leaving early (client gone) closes `chunks`, which aborts the engine request.
    """
    def frame(c: dict) -> str | None:
        is_usage = not c["choices"] and c.get("usage") is not None
        if is_usage and not info.include_usage:
            return None
        if info.include_usage and not is_usage:
            c = {**c, "usage": None}
        return sse_event(c)

    async with contextlib.aclosing(chunks):
        try:
            if first is not None and (f := frame(first)):
                yield f
            async for c in chunks:
                if f := frame(c):
                    yield f
        except APIError as e:
            yield sse_event(e.body())
        except Exception as e:
            log.exception("stream %s failed", info.id)
            yield sse_event(APIError(f"Internal server error: {type(e).__name__}: {e}",
                                     status=500, type="server_error").body())
    yield SSE_DONE

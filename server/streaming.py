"""From engine outputs to OpenAI chunks, SSE frames, and (folded) whole responses.

One code path: a request always becomes an async stream of *chunk* dicts, exactly the objects a
streaming client receives, ending with a usage chunk (`choices: []`). Streaming sends them as
server-sent events (dropping the usage chunk unless `stream_options.include_usage`; with vLLM's
`continuous_usage_stats`, every chunk carries the usage so far: `RunningUsage`); a
non-streaming response is the fold of the same chunks.

Whoever stops reading a request's outputs early (client gone, task cancelled, error) aborts it in
the engine: `engine_outputs` does that in its `finally`. A client that stays connected but stops
reading holds its stream up (Hypercorn waits for the socket to drain), and the engine pauses the
request, then aborts it (engine/async_engine.py): nothing here buffers without bound.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from quart import Response

from engine.async_engine import StreamStalled
from engine.core.outputs import RequestOutput
from server.logprobs import (LogprobsOptions, chat_entries, completion_logprobs,
                             join_completion_logprobs, vllm_prompt_logprobs)
from server.message_stream import MessageStream
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
    running_usage: RunningUsage | None = None    # continuous_usage_stats: usage on every chunk

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


class RunningUsage:
    """vLLM's stream_options.continuous_usage_stats: the usage so far, which every streamed
    chunk carries. It counts the outputs of the engine streams it watches as they pass, so a
    chunk framed after them reports the tokens generated up to it."""

    def __init__(self, num_prompt_tokens: int):
        self.prompt = num_prompt_tokens
        self._generated: dict[tuple[int, int], int] = {}   # (stream, choice): tokens so far

    async def watch(self, outputs: AsyncIterator[RequestOutput],
                    stream: int = 0) -> AsyncIterator[RequestOutput]:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                self._generated[(stream, out.index)] = out.num_output_tokens
                yield out

    def as_dict(self) -> dict:
        completion = sum(self._generated.values())
        return {"prompt_tokens": self.prompt, "completion_tokens": completion,
                "total_tokens": self.prompt + completion}


async def engine_outputs(engine, request_id: str, prompt_ids: list[int], params,
                         timing: RequestTiming, param: str) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, timed by `timing`. Closing this closes the engine's
    stream, which aborts the request unless it ran to its end. A refusal names `param`, the
    request field the prompt came from."""
    unfinished = params.n        # the choices still running
    try:
        images = getattr(prompt_ids, "images", None)      # a vision model's (server/media.py)
        add = (engine.add_request(request_id, prompt_ids, params, images=images) if images
               else engine.add_request(request_id, prompt_ids, params))
        async with contextlib.aclosing(add) as outs:
            async for out in outs:
                unfinished -= out.finished
                # the request's clock ends with its last choice
                timing.on_output(out if not out.finished or not unfinished
                                 else dataclasses.replace(out, finished=False))
                yield out
                if not unfinished:
                    return
    except StreamStalled as e:       # the client stopped reading: its request was aborted
        raise APIError(str(e), status=408, type="timeout_error", code="stream_stalled") from None
    except ValueError as e:          # the engine refused the request: the client's fault
        timing.discard()
        raise APIError(f"{param}: {e}", param=param, code="invalid_value") from None
    except RuntimeError as e:        # the engine is stopped or its loop died
        raise APIError(f"The engine failed: {e}", status=503, type="server_error",
                       code="engine_error") from None
    finally:
        timing.close()


def _check_output(out: RequestOutput):
    if out.finish_reason == "error" and out.error_param is not None:   # the request's fault
        raise APIError(out.error or "invalid request", param=out.error_param,
                       code="invalid_value")
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
    reasoning: int = 0
    spec: list | None = None        # speculative decoding's drafts, draft tokens, accepted

    def add(self, out: RequestOutput, num_prompt_tokens: int, num_reasoning_tokens: int = 0):
        """A finished choice: its completion tokens (and how many of them reasoned); the
        prompt once per request (choice 0), as the choices share it."""
        self.completion += out.num_output_tokens or len(out.token_ids)
        self.reasoning += num_reasoning_tokens
        if out.index == 0:
            self.prompt += out.num_prompt_tokens or num_prompt_tokens
            self.cached += out.num_cached_tokens
        if out.spec_decode is not None:
            c = out.spec_decode
            self.spec = [a + b for a, b in zip(self.spec or [0, 0, 0], (
                c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens))]

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "completion_tokens_details": {"reasoning_tokens": min(self.reasoning,
                                                                      self.completion)},
                "prompt_time_costs": round(max(t.prompt_time_ms for t in self.timings)),
                "completion_time_costs": round(max(t.completion_time_ms for t in self.timings)),
                **({} if self.spec is None else {"speculative_decoding": spec_usage(*self.spec)})}


def spec_usage(num_drafts: int, num_draft_tokens: int, num_accepted: int) -> dict:
    """The usage's speculative decoding extras: its verify steps with drafts, drafts, accepted
    drafts, their ratio and the tokens a verify step emitted on average."""
    return {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted,
            "acceptance_rate": round(num_accepted / num_draft_tokens, 4) if num_draft_tokens
            else 0.0,
            "mean_accepted_length": round(1 + num_accepted / num_drafts, 4) if num_drafts
            else 0.0}


# ---- chat

async def chat_chunks(info: ResponseInfo, outputs: AsyncIterator[RequestOutput],
                      num_prompt_tokens: int, timing: RequestTiming, n: int = 1,
                      logprobs: LogprobsOptions | None = None,
                      message: Callable[[int], MessageStream] | None = None
                      ) -> AsyncIterator[dict]:
    """Chunks of one chat completion: per choice a role chunk, message deltas (content, or
    through `message(index)`'s MessageStream reasoning, content and tool calls; with their
    tokens' logprobs when asked), a finish chunk; then usage.

    A choice's role chunk waits for its first output, so a request the engine refuses fails
    before anything is sent (and can still get a proper HTTP status). vLLM's prompt_logprobs
    ride on choice 0's role chunk, at the top level.
    """
    def choice(i: int, delta: dict, finish_reason: str | None = None, lp=None) -> dict:
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}

    lp_opts = logprobs or LogprobsOptions(None)
    usage = _Usage([timing])
    streams: dict[int, MessageStream | None] = {}
    unfinished = n
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            _check_output(out)
            i = out.index
            if i not in streams:
                streams[i] = ms = message(i) if message is not None else None
                # A choice that may answer with tool calls or reasoning alone starts with null
                # content, as OpenAI's do, so a stream accumulator rebuilds the whole message.
                first = info.chunk([choice(i, {"role": "assistant",
                                               "content": None if ms else ""})])
                if out.prompt_logprobs is not None and lp_opts.prompt_logprobs is not None:
                    first["prompt_logprobs"] = vllm_prompt_logprobs(
                        out.prompt_logprobs, lp_opts.tt, lp_opts.prompt_logprobs)
                yield first
            entries = out.logprobs if lp_opts.logprobs is not None else None
            ms = streams[i]
            if ms is None:
                delta = {"content": out.text_delta} if out.text_delta else {}
            else:
                delta = ms.feed(out.text_delta, len(out.new_token_ids), out.finished)
            if delta or entries:
                lp = None if entries is None else {
                    "content": chat_entries(entries, lp_opts.tt), "refusal": None}
                yield info.chunk([choice(i, delta or {"content": ""}, lp=lp)])
            if out.finished:
                reason = _FINISH_REASONS[out.finish_reason]
                if ms is not None and ms.called_tools and reason == "stop":
                    reason = "tool_calls"
                yield info.chunk([choice(i, {}, reason)])
                usage.add(out, num_prompt_tokens, ms.num_reasoning_tokens if ms else 0)
                unfinished -= 1
                if not unfinished:
                    break
        else:
            raise APIError("The engine ended the request without finishing it",
                           status=500, type="server_error", code="engine_error")
    yield info.chunk([], usage.as_dict())


async def fold_chat(info: ResponseInfo, chunks: AsyncIterator[dict]) -> dict:
    """The whole response from the chunks, as the OpenAI SDK's stream accumulator builds it:
    content and reasoning concatenated, each tool call's argument text concatenated."""
    choices: dict[int, dict] = {}
    usage, prompt_logprobs = None, None
    async for c in chunks:
        if c.get("usage") is not None:
            usage = c["usage"]
        prompt_logprobs = c.get("prompt_logprobs", prompt_logprobs)
        for ch in c["choices"]:
            acc = choices.setdefault(ch["index"], {"content": [], "reasoning": [], "calls": {},
                                                   "logprobs": None, "finish_reason": None})
            delta = ch["delta"]
            acc["content"].append(delta.get("content") or "")
            acc["reasoning"].append(delta.get("reasoning_content") or "")
            for tc in delta.get("tool_calls") or []:
                call = acc["calls"].setdefault(tc["index"], {
                    "id": tc.get("id"), "type": "function",
                    "function": {"name": tc["function"].get("name"), "arguments": ""}})
                call["function"]["arguments"] += tc["function"].get("arguments") or ""
            acc["finish_reason"] = ch["finish_reason"] or acc["finish_reason"]
            if ch["logprobs"] is not None:
                acc["logprobs"] = acc["logprobs"] or {"content": [], "refusal": None}
                acc["logprobs"]["content"] += ch["logprobs"]["content"]
    out = {"id": info.id, "object": "chat.completion", "created": info.created,
           "model": info.model,
           "choices": [{"index": i, "message": _message(acc),
                        "logprobs": acc["logprobs"], "finish_reason": acc["finish_reason"]}
                       for i, acc in sorted(choices.items())],
           "usage": usage}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def _message(acc: dict) -> dict:
    content = "".join(acc["content"])
    reasoning = "".join(acc["reasoning"])
    # No answer text beside calls or reasoning (say, cut off while reasoning) is null content.
    message = {"role": "assistant",
               "content": content or (None if acc["calls"] or reasoning else ""),
               "refusal": None}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if acc["calls"]:
        message["tool_calls"] = [acc["calls"][k] for k in sorted(acc["calls"])]
    return message


# ---- completions

async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield 0, item
        return
    # Bounded: a reader that stops stops the pumps, so each stream's back-pressure reaches the
    # engine (engine/async_engine.py) instead of this queue taking everything.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
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
                            echo: list[str] | None = None, n: int = 1,
                            logprobs: LogprobsOptions | None = None,
                            echo_tokens: list[tuple[list[int], list[int]]] | None = None
                            ) -> AsyncIterator[dict]:
    """Chunks of a (batched) completion: choice i * n + j is prompt i's choice j; text deltas
    (with the legacy logprobs when asked), finish, usage. With echo, a choice's first chunk
    starts with its prompt's text, and with logprobs too, its prompt tokens' logprobs
    (echo_tokens: each prompt's ids and their text offsets)."""
    def choice(i: int, text: str, finish_reason: str | None = None, lp=None) -> dict:
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    lp_opts = logprobs or LogprobsOptions(None)
    usage = _Usage(timings)
    started: set[int] = set()
    prompt_lps: dict[int, list] = {}          # by prompt: the engine sends them with choice 0
    unfinished = [n] * len(streams)
    async with contextlib.aclosing(_merge(streams)) as merged:
        async for p, out in merged:
            _check_output(out)
            i = p * n + out.index
            if out.prompt_logprobs is not None:
                prompt_lps[p] = out.prompt_logprobs
            text, lp, extra = out.text_delta, None, {}
            base = len(echo[p]) if echo else 0
            if lp_opts.logprobs is not None and out.logprobs:
                ids = [e.token_id for e in out.logprobs]
                lp = completion_logprobs(ids, out.logprobs,
                                         [base + e.text_offset for e in out.logprobs], lp_opts.tt)
            if i not in started:
                started.add(i)
                if echo:
                    text = echo[p] + text
                    if lp_opts.logprobs is not None and echo_tokens:
                        ids, offsets = echo_tokens[p]
                        lp = join_completion_logprobs(completion_logprobs(
                            ids, prompt_lps.get(p, [None] * len(ids)), offsets, lp_opts.tt,
                            lp_opts.logprobs), lp)
                if lp_opts.prompt_logprobs is not None and p in prompt_lps:
                    extra["prompt_logprobs"] = vllm_prompt_logprobs(
                        prompt_lps[p], lp_opts.tt, lp_opts.prompt_logprobs)
            if text or lp or extra:
                yield info.chunk([{**choice(i, text, lp=lp), **extra}])
            if out.finished:
                unfinished[p] -= 1
                yield info.chunk([choice(i, "", _FINISH_REASONS[out.finish_reason])])
                usage.add(out, num_prompt_tokens[p])
    if any(unfinished):
        raise APIError("The engine ended a request without finishing it",
                       status=500, type="server_error", code="engine_error")
    yield info.chunk([], usage.as_dict())


async def fold_completion(info: ResponseInfo, chunks: AsyncIterator[dict], n: int) -> dict:
    texts: list[list[str]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    logprobs: list[dict | None] = [None] * n
    prompt_logprobs: dict[int, list] = {}
    usage = None
    async for c in chunks:
        if c.get("usage") is not None:
            usage = c["usage"]
        for ch in c["choices"]:
            i = ch["index"]
            texts[i].append(ch["text"])
            reasons[i] = ch["finish_reason"] or reasons[i]
            logprobs[i] = join_completion_logprobs(logprobs[i], ch["logprobs"])
            if "prompt_logprobs" in ch:
                prompt_logprobs[i] = ch["prompt_logprobs"]
    choices = [{"index": i, "text": "".join(texts[i]), "logprobs": logprobs[i],
                "finish_reason": reasons[i]} for i in range(n)]
    for i, pl in prompt_logprobs.items():
        choices[i]["prompt_logprobs"] = pl
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
            running = info.running_usage
            c = {**c, "usage": None if running is None else running.as_dict()}
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


async def first_of(events):
    """The first item of an async generator, closing the generator if getting it fails: a
    request the engine refuses raises here, before any status is sent."""
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()
        raise


def sse_response(body) -> Response:
    """A text/event-stream response: not cached, not buffered by proxies, no timeout."""
    resp = Response(body, status=200, content_type="text/event-stream")
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    resp.timeout = None
    return resp

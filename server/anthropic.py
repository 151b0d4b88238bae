"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request is translated into the chat route's request (server/anthropic_protocol.py) and runs
as a chat completion does: the same template rendering, tool checks, tool-call parser, tool
grammars and engine. The chat chunks that come out are translated back into Anthropic's stream
events: message_start, ping, per content block (thinking, text, tool_use) content_block_start,
its deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop, then
message_delta (stop_reason, stop_sequence, usage) and message_stop. Streaming sends them as
server-sent events (`event:` the type); a non-streamed message is the one those events build,
as the SDK's accumulator builds it. An error after the stream has started is an `error` event.

`max_tokens` is required, as Anthropic requires it; one larger than the room the prompt leaves
in the context is cut to that room (clients such as Claude Code send their model's output limit
whatever the context), and a message that fills it ends with stop_reason
"model_context_window_exceeded", as Anthropic's does.

Usage follows Anthropic's split: `input_tokens` are the prompt tokens computed for this request,
`cache_read_input_tokens` those the prefix cache supplied (their sum is the prompt's length).

Errors on these paths have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`
(create_app's error responses ask `is_anthropic_path`); the API key may come as `x-api-key`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import uuid
from typing import AsyncIterator

from pydantic import TypeAdapter
from quart import Quart, Response, request

from server import streaming, structured_outputs
from server.anthropic_protocol import CountTokensRequest, MessagesRequest
from server import request_body
from server.protocol import APIError, ChatCompletionRequest, parse_request
from server.tool_calls import chat_tools

log = logging.getLogger("taper.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
                529: "overloaded_error"}
# The chat route's names for what Anthropic's requests call otherwise, as they appear in the
# messages of errors raised after the translation.
_CHAT_NAMES = {"response_format.json_schema.schema": "output_config.format.schema",
               "tool_choice 'required'": "tool_choice 'any'"}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(e: APIError) -> dict:
    """The error in Anthropic's shape, its message naming the parameter at fault; its type
    follows the HTTP status, as Anthropic's do."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    message = e.message
    if e.param and not message.startswith(e.param):    # the shape has no field for it
        message = f"{e.param}: {message}"
    for chat_name, name in _CHAT_NAMES.items():
        message = message.replace(chat_name, name)
    return {"type": "error", "error": {"type": kind, "message": message}}


def register_anthropic(app: Quart, *, limits, check_queue, fit_context, chat_prompt_ids,
                       tool_constraint, message_streams):
    """The routes, on `app`; the helpers are create_app's, shared with the chat route, and
    `limits` the server's request limits (server/limits.py)."""
    state = app.taper

    async def read(cls):
        """The request, its chat translation, model, engine, tools and prompt ids."""
        req = await request_body.read(await request.get_data(), cls, state.engine, limits)
        engine = state.ready_engine()
        model = state.resolve_model(req.model)
        chat = parse_request(ChatCompletionRequest, req.chat_body())
        tools = chat_tools(chat, state.tool_parser)
        prompt_ids = await chat_prompt_ids(engine, chat, tools=tools.rendered)
        return req, chat, model, engine, tools, prompt_ids

    @app.post("/v1/messages/count_tokens")
    async def count_tokens():
        *_, prompt_ids = await read(CountTokensRequest)
        return _json({"input_tokens": len(prompt_ids)})

    @app.post("/v1/messages")
    async def create_message():
        req, chat, model, engine, tools, prompt_ids = await read(MessagesRequest)
        room = engine.max_model_len - len(prompt_ids)
        window_limited = 0 < room < chat.max_tokens
        if window_limited:
            chat.max_tokens = room
        params = fit_context(engine, chat, len(prompt_ids), "messages")
        await structured_outputs.prepare(engine, chat, [params], state.settings,
                                         tool_constraint(engine, chat, tools),
                                         "tools" if tools.choice == "auto" else "tool_choice")
        check_queue(engine)
        info = streaming.ResponseInfo(f"msg_{uuid.uuid4().hex}", model, "chat.completion.chunk",
                                      stream=req.stream)
        message = message_streams(engine, info.id, prompt_ids, params, tools)
        timing = state.metrics.request()
        end = EngineEnd()
        outputs = end.watch(streaming.engine_outputs(engine, info.id, prompt_ids, params,
                                                     timing, "messages"))
        chunks = streaming.chat_chunks(info, outputs, len(prompt_ids), timing, 1, None, message)
        omit = (req.thinking or {}).get("display") == "omitted"
        builder = MessageBuilder(info.id, model, omit_thinking=omit)
        events = message_events(builder, chunks, end, len(prompt_ids), window_limited)
        first = await streaming.first_of(events)   # a refused request gets an error status
        if req.stream:
            return streaming.sse_response(sse_events(builder, first, events))
        async with contextlib.aclosing(events):
            async for _ in events:
                pass
        return _json(builder.message)


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status,
                    content_type="application/json")


class EngineEnd:
    """What the chat chunks leave out and a message reports: the prompt tokens the prefix cache
    supplied, and the stop string that ended the output."""

    def __init__(self):
        self.cached_tokens = 0
        self.stop_string: str | None = None

    async def watch(self, outputs: AsyncIterator) -> AsyncIterator:
        """`outputs`, passed on as they come (closing this closes them)."""
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                self.cached_tokens = out.num_cached_tokens
                if out.finished and isinstance(out.stop_reason, str):
                    self.stop_string = out.stop_reason
                yield out


# ---- the message and its events

class MessageBuilder:
    """One message: the object the events build (the non-streamed response), and the events."""

    def __init__(self, message_id: str, model: str, omit_thinking: bool = False):
        self.message = {"id": message_id, "type": "message", "role": "assistant",
                        "model": model, "content": [], "stop_reason": None,
                        "stop_sequence": None, "usage": None}
        self.omit_thinking = omit_thinking
        self.open: tuple | None = None       # the streaming block: ("text",), ("tool_use", i)
        self.json_texts: dict[int, str] = {}  # a tool_use block's input text so far

    def start(self, usage: dict) -> dict:
        self.message["usage"] = usage
        return {"type": "message_start", "message": json.loads(json.dumps(self.message))}

    def delta(self, delta: dict) -> list[dict]:
        """The events of one chat delta: reasoning, content, then tool calls."""
        events = []
        if thought := delta.get("reasoning_content"):
            events += self._block(("thinking",), {"type": "thinking", "thinking": "",
                                                  "signature": ""})
            if not self.omit_thinking:
                events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if text := delta.get("content"):
            events += self._block(("text",), {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            fn = call["function"]
            # a call's first delta has its id and name; the parser ends a call before the next
            # call or more text begins, so its block is the open one until then
            events += self._block(("tool_use", call["index"]),
                                  {"type": "tool_use", "id": call.get("id"),
                                   "name": fn.get("name"), "input": {}})
            if fn.get("arguments"):
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": fn["arguments"]}))
        return events

    def finish(self, stop_reason: str, stop_sequence: str | None, usage: dict) -> list[dict]:
        self.message.update(stop_reason=stop_reason, stop_sequence=stop_sequence, usage=usage)
        return self._close() + [
            {"type": "message_delta",
             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": usage},
            {"type": "message_stop"}]

    def _block(self, key: tuple, block: dict) -> list[dict]:
        """Open a block for `key` unless it is the open one (closing that first)."""
        if self.open == key:
            return []
        events = self._close()
        self.open = key
        self.message["content"].append(block)
        return events + [{"type": "content_block_start", "index": self._index(),
                          "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        block = self.message["content"][-1]
        if delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif delta["type"] == "text_delta":
            block["text"] += delta["text"]
        else:
            i = self._index()
            self.json_texts[i] = self.json_texts.get(i, "") + delta["partial_json"]
            block["input"] = _json_object(self.json_texts[i])
        return {"type": "content_block_delta", "index": self._index(), "delta": delta}

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self._index()}]

    def _index(self) -> int:
        return len(self.message["content"]) - 1


_OBJECT = TypeAdapter(dict)


def _json_object(text: str) -> dict:
    """A tool call's input from its argument text, read as the SDK's stream accumulator reads
    it (partial JSON allowed: a call cut by max_tokens keeps what it had); {} for no object."""
    try:
        return _OBJECT.validate_json(text, experimental_allow_partial=True)
    except ValueError:
        return {}


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


async def message_events(builder: MessageBuilder, chunks: AsyncIterator[dict], end: EngineEnd,
                         num_prompt_tokens: int, window_limited: bool) -> AsyncIterator[dict]:
    """The stream events of one message from its chat chunks (one choice). The first event
    waits for the engine's first output (the chat chunks' role chunk), so a request the engine
    refuses fails before anything is sent. `window_limited`: max_tokens was cut to the room
    left in the context."""
    reason = None
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if builder.message["usage"] is None:
                yield builder.start(_usage(num_prompt_tokens, end.cached_tokens, 0))
                yield {"type": "ping"}
                continue
            if chunk["choices"]:
                choice = chunk["choices"][0]
                for ev in builder.delta(choice["delta"]):
                    yield ev
                reason = choice["finish_reason"] or reason
                continue
            chat_usage = chunk["usage"]        # the last chunk
            usage = _usage(chat_usage["prompt_tokens"], end.cached_tokens,
                           chat_usage["completion_tokens"])
            usage["output_tokens_details"] = {
                "thinking_tokens": chat_usage["completion_tokens_details"]["reasoning_tokens"]}
            stop_sequence = None
            if reason == "tool_calls":
                stop_reason = "tool_use"
            elif reason == "length":
                stop_reason = "model_context_window_exceeded" if window_limited else "max_tokens"
            elif end.stop_string is not None:
                stop_reason, stop_sequence = "stop_sequence", end.stop_string
            else:
                stop_reason = "end_turn"
            for ev in builder.finish(stop_reason, stop_sequence, usage):
                yield ev


# ---- server-sent events

def sse_event(ev: dict) -> str:
    data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
    return f"event: {ev['type']}\ndata: {data}\n\n"


async def sse_events(builder: MessageBuilder, first: dict,
                     events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE frames, as Anthropic sends them (no [DONE]). An error after the stream started ends
    it with an `error` event (the SDK raises it). Leaving early (client gone) closes `events`,
    which aborts the engine request."""
    async with contextlib.aclosing(events):
        try:
            yield sse_event(first)
            async for ev in events:
                yield sse_event(ev)
        except APIError as e:
            yield sse_event(error_body(e))
        except Exception as e:
            log.exception("message %s failed", builder.message["id"])
            yield sse_event(error_body(APIError(f"Internal server error: {type(e).__name__}: "
                                                f"{e}", status=500)))

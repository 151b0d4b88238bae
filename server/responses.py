"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

One code path, as for chat: a request becomes an async stream of the Responses stream events
(response.created, response.in_progress, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done, then
response.completed or response.incomplete), each with its sequence_number. Streaming sends them
as server-sent events; a non-streamed response is the last event's `response`. The text is read
as chat's is (server/message_stream.py): a reasoning model's <think> text becomes a `reasoning`
output item, and with function tools (server/responses_tools.py) each call the model makes
becomes a `function_call` item (output_item.added, function_call_arguments.delta...,
function_call_arguments.done, output_item.done).

Responses with `store` (the default) are kept in a bounded in-memory store
(server/responses_store.py, `--responses-store-size` entries and `--responses-store-mb`) for GET
and `previous_response_id`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import AsyncIterator

from quart import Quart, Response, request

from server import json_io, streaming, structured_outputs
from server.message_stream import MessageStream
from server.protocol import APIError, _template_tool_call, not_supported
from server.responses_protocol import CreateResponseRequest, input_messages, random_item_id
from server.responses_store import ResponseStore, StoredResponse, freeze
from server.responses_tools import call_ids, echoed_tools, response_tools
from server.responses_truncation import longest_fitting_tail

log = logging.getLogger("taper.server")


def register_responses(app: Quart, *, read_request, check_queue, fit_context, chat_prompt_ids,
                       tool_constraint, message_streams):
    """The routes, on `app`; the helpers are create_app's, shared with the chat route."""
    state = app.taper
    store = ResponseStore(state.settings.responses_store_size,
                          state.settings.responses_store_bytes)
    app.taper_responses = store

    def not_found(response_id: str, param: str | None = None) -> APIError:
        return APIError(f"Response with id '{response_id}' not found.", status=404,
                        param=param, code="response_not_found")

    async def stored(response_id: str, param: str | None = None) -> StoredResponse:
        entry = await asyncio.to_thread(store.get, response_id)
        if entry is None:
            raise not_found(response_id, param)
        return entry

    @app.post("/v1/responses")
    async def create_response():
        req, model, engine = await read_request(CreateResponseRequest)
        tools = response_tools(req, state.tool_parser)
        earlier = []
        if req.previous_response_id is not None:
            entry = await stored(req.previous_response_id, "previous_response_id")
            earlier = entry.conversation
        turn, items = input_messages(req.input, call_ids(earlier))
        req.set_turns(earlier, turn)
        prompt_ids = await conversation_prompt(engine, req, tools.rendered)
        params = fit_context(engine, req, len(prompt_ids), "input")
        await structured_outputs.prepare(engine, req, [params], state.settings,
                                         tool_constraint(engine, req, tools),
                                         "tools" if tools.choice == "auto" else "tool_choice")
        check_queue(engine)
        builder = ResponseBuilder(req, model, params)
        message = message_streams(engine, builder.id, prompt_ids, params, tools,
                                  reasoning=True)(0)
        timing = state.metrics.request()
        outputs = streaming.engine_outputs(engine, builder.id, prompt_ids, params, timing,
                                           "input")
        events = response_events(builder, outputs, len(prompt_ids), message)
        if req.store:
            events = _store_when_done(events, store, items, req.turns())
        first = await streaming.first_of(events)   # a refused request gets an error status
        if req.stream:
            return streaming.sse_response(sse_events(builder, first, events))
        last = first
        async with contextlib.aclosing(events):
            async for last in events:
                pass
        return await json_io.response(last["response"])

    async def conversation_prompt(engine, req, tools) -> list[int]:
        """The prompt of the request's conversation; under truncation "auto", of its longest
        tail that fits (server/responses_truncation.py). The context errors name the Responses
        API's fields."""
        turns = req.turns()
        too_long: APIError | None = None

        async def render(k: int) -> list[int] | None:
            nonlocal too_long
            req.set_turns([], turns[k:])
            try:
                return await chat_prompt_ids(engine, req, "input", tools)
            except APIError as e:
                if e.code != "context_length_exceeded":
                    raise
                too_long = e      # too many characters to tokenize
                return None

        ids = await render(0)
        if ids is not None and fits(engine, req, len(ids)):
            return ids
        if req.truncation == "auto" and len(turns) >= 2:
            budget = engine.max_model_len - max(req.max_output_tokens or 0, 1)
            k, ids = await longest_fitting_tail(engine, turns, budget, render)
            req.set_turns([], turns[k:])
        if ids is None:
            raise too_long
        check_context(engine, req, len(ids))
        return ids

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str):
        if request.args.get("stream", "false").lower() not in ("false", "0"):
            raise not_supported("stream")           # replaying a stored response's events
        return await json_io.response((await stored(response_id)).response)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/<response_id>/input_items")
    async def list_input_items(response_id: str):
        items = (await stored(response_id)).input_items
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError("order must be 'asc' or 'desc'", param="order", code="invalid_value")
        try:
            limit = int(request.args.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise APIError("limit must be an integer from 1 to 100", param="limit",
                           code="invalid_value")
        items = items[::-1] if order == "desc" else list(items)
        after = request.args.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(f"no input item '{after}' in this response", param="after",
                               code="invalid_value")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return _json({"object": "list", "data": page, "has_more": len(items) > limit,
                      "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None})


def fits(engine, req: CreateResponseRequest, prompt_len: int) -> bool:
    return prompt_len + max(req.max_output_tokens or 0, 1) <= engine.max_model_len


def check_context(engine, req: CreateResponseRequest, prompt_len: int):
    """The context checks with the Responses API's names (fit_context names chat's)."""
    if fits(engine, req, prompt_len):
        return
    max_len, asked = engine.max_model_len, req.max_output_tokens
    if prompt_len >= max_len or asked is None:
        raise APIError(f"This model's maximum context length is {max_len} tokens, and the "
                       f"input has {prompt_len} tokens (at least one more is needed for the "
                       "output). Please shorten it.", param="input",
                       code="context_length_exceeded")
    raise APIError(f"This model's maximum context length is {max_len} tokens. However, you "
                   f"requested {prompt_len + asked} tokens ({prompt_len} in the input, {asked} "
                   "for the output). Please reduce the input or max_output_tokens.",
                   param="max_output_tokens", code="context_length_exceeded")


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status,
                    content_type="application/json")


# ---- the response object and its events

class ResponseBuilder:
    """One response: the object every lifecycle event carries, and the numbered events."""

    def __init__(self, req: CreateResponseRequest, model: str, params):
        self.id = random_item_id("resp")
        self.sequence_number = 0
        self.response = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "completed_at": None, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": (True if req.parallel_tool_calls is None
                                    else req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": echoed_tools(req), "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {},
        }
        # `usage` comes once the response has ended; the schema's `user` is never null
        if req.user is not None:
            self.response["user"] = req.user

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return ev

    def lifecycle(self, kind: str) -> dict:
        # The response as it is now. Only its top-level fields and its output list change later
        # (closed output items are never edited), so a shallow copy freezes it; a deep copy
        # would copy the echoed tools, which may be megabytes, for each lifecycle event.
        return self.event(kind, response={**self.response, "output": list(self.response["output"])})

    def failed(self, error: APIError) -> dict:
        self.response.update(status="failed", error={"code": "server_error",
                                                     "message": error.message})
        return self.lifecycle("response.failed")


class _Item:
    """An output item being streamed: a reasoning item (reasoning_text) or the assistant
    message (output_text)."""

    def __init__(self, builder: ResponseBuilder, kind: str, output_index: int):
        self.builder, self.kind, self.output_index = builder, kind, output_index
        self.id = random_item_id("rs" if kind == "reasoning" else "msg")
        self.text = ""
        self.part_type = "reasoning_text" if kind == "reasoning" else "output_text"

    def part(self) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def item(self, status: str) -> dict:
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [],
                    "content": [self.part()] if status != "in_progress" else [],
                    "encrypted_content": None, "status": status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                "content": [self.part()] if status != "in_progress" else []}

    def _at(self) -> dict:
        return {"item_id": self.id, "output_index": self.output_index, "content_index": 0}

    def open(self) -> list[dict]:
        b = self.builder
        return [b.event("response.output_item.added", output_index=self.output_index,
                        item=self.item("in_progress")),
                b.event("response.content_part.added", **self._at(), part=self.part())]

    def delta(self, text: str) -> dict:
        self.text += text
        extra = {"logprobs": []} if self.kind == "message" else {}
        return self.builder.event(f"response.{self.part_type}.delta", **self._at(), delta=text,
                                  **extra)

    def close(self, status: str) -> list[dict]:
        b = self.builder
        extra = {"logprobs": []} if self.kind == "message" else {}
        done = self.item(status)
        b.response["output"].append(done)
        return [b.event(f"response.{self.part_type}.done", **self._at(), text=self.text,
                        **extra),
                b.event("response.content_part.done", **self._at(), part=self.part()),
                b.event("response.output_item.done", output_index=self.output_index,
                        item=done)]


class _FunctionCall:
    """A function_call output item being streamed: its arguments arrive as deltas."""
    kind = "function_call"

    def __init__(self, builder: ResponseBuilder, output_index: int, call_id: str, name: str):
        self.builder, self.output_index = builder, output_index
        self.id = random_item_id("fc")
        self.call_id, self.name, self.arguments = call_id, name, ""

    def item(self, status: str) -> dict:
        return {"id": self.id, "type": "function_call", "status": status,
                "arguments": self.arguments, "call_id": self.call_id, "name": self.name}

    def open(self) -> list[dict]:
        return [self.builder.event("response.output_item.added", output_index=self.output_index,
                                   item=self.item("in_progress"))]

    def delta(self, text: str) -> dict:
        self.arguments += text
        return self.builder.event("response.function_call_arguments.delta", item_id=self.id,
                                  output_index=self.output_index, delta=text)

    def close(self, status: str) -> list[dict]:
        b = self.builder
        done = self.item(status)
        b.response["output"].append(done)
        return [b.event("response.function_call_arguments.done", item_id=self.id,
                        output_index=self.output_index, name=self.name,
                        arguments=self.arguments),
                b.event("response.output_item.done", output_index=self.output_index, item=done)]


async def response_events(builder: ResponseBuilder, outputs: AsyncIterator,
                          num_prompt_tokens: int, message: MessageStream) -> AsyncIterator[dict]:
    """The stream events of one response: its text read by `message` (reasoning, answer text,
    function calls), each part an output item of its own, in the order they come. The first
    event waits for the engine's first output, so a request the engine refuses fails before
    anything is sent."""
    current = None                      # the output item being streamed
    calls: dict[int, _FunctionCall] = {}
    started = False

    def switch(kind: str, make) -> list[dict]:
        """Close the current item unless it is of `kind`; open a new one made by `make`."""
        nonlocal current
        events = []
        if current is not None and current.kind == kind != "function_call":
            return events
        if current is not None:
            events += current.close("completed")
        current = make(len(builder.response["output"]))
        return events + current.open()

    async with contextlib.aclosing(outputs):
        async for out in outputs:
            streaming._check_output(out)
            if not started:
                yield builder.lifecycle("response.created")
                yield builder.lifecycle("response.in_progress")
                started = True
            delta = message.feed(out.text_delta, len(out.new_token_ids), out.finished)
            if thought := delta.get("reasoning_content"):
                for ev in switch("reasoning", lambda i: _Item(builder, "reasoning", i)):
                    yield ev
                yield current.delta(thought)
            answer = delta.get("content")
            if answer or (out.finished and current is None and not delta.get("tool_calls")
                          and not builder.response["output"]):
                for ev in switch("message", lambda i: _Item(builder, "message", i)):
                    yield ev
                if answer:
                    yield current.delta(answer)
            for c in delta.get("tool_calls") or []:
                if c["index"] not in calls:
                    fn = c["function"]
                    for ev in switch("function_call", lambda i: _FunctionCall(
                            builder, i, c["id"], fn["name"])):
                        yield ev
                    calls[c["index"]] = current
                if c["function"]["arguments"]:
                    yield calls[c["index"]].delta(c["function"]["arguments"])
            status = "incomplete" if out.finish_reason == "length" else "completed"
            if out.finished:
                if current is not None:
                    for ev in current.close(status):
                        yield ev
                builder.response["usage"] = _usage(out, num_prompt_tokens,
                                                   message.num_reasoning_tokens)
                break
        else:
            raise APIError("The engine ended the request without finishing it",
                           status=500, type="server_error", code="engine_error")
    r = builder.response
    if status == "incomplete":
        r.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        yield builder.lifecycle("response.incomplete")
    else:
        r.update(status="completed", completed_at=int(time.time()))
        yield builder.lifecycle("response.completed")


def _usage(out, num_prompt_tokens: int, num_reasoning_tokens: int) -> dict:
    inp = out.num_prompt_tokens or num_prompt_tokens
    output = out.num_output_tokens or len(out.token_ids)
    return {"input_tokens": inp,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(num_reasoning_tokens, output)},
            "total_tokens": inp + output}


async def _store_when_done(events: AsyncIterator[dict], store: ResponseStore,
                           input_items: list[dict], turns: list[dict]) -> AsyncIterator[dict]:
    """Pass the events on; once the response has ended, store it with the conversation it
    ends (the earlier turns, this input, this answer and its function calls)."""
    async with contextlib.aclosing(events):
        async for ev in events:
            if ev["type"] in ("response.completed", "response.incomplete"):
                response = ev["response"]
                entry = StoredResponse(response, input_items,
                                       turns + [_assistant_turn(response["output"])])
                # linear in its size (the echoed tools may be megabytes)
                store.put(response["id"], await asyncio.to_thread(freeze, entry))
            yield ev


def _assistant_turn(output: list[dict]) -> dict:
    """The response's output as the assistant message a chat template renders."""
    answer = "".join(item["content"][0]["text"] for item in output
                     if item["type"] == "message")
    turn = {"role": "assistant", "content": answer}
    calls = [_template_tool_call({"id": item["call_id"], "type": "function", "function": {
        "name": item["name"], "arguments": item["arguments"]}}, "output")
        for item in output if item["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


def sse_event(ev: dict) -> str:
    data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
    return f"event: {ev['type']}\ndata: {data}\n\n"


async def sse_event_off_loop(ev: dict) -> str:
    """sse_event; a lifecycle event carries the whole response (its echoed tools may be
    megabytes): written in pieces on a worker thread (server/json_io.py) when large."""
    if "response" not in ev or json_io.is_small(ev):
        return sse_event(ev)
    data = await asyncio.to_thread(json_io.dumps, ev, compact=True)
    return f"event: {ev['type']}\ndata: {data}\n\n"


async def sse_events(builder: ResponseBuilder, first: dict,
                     events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE frames (`event:` the type, `data:` the event), as OpenAI sends them (no [DONE]). An
    error after the stream started ends it with response.failed. Leaving early (client gone)
    closes `events`, which aborts the engine request."""
    async with contextlib.aclosing(events):
        try:
            yield await sse_event_off_loop(first)
            async for ev in events:
                yield await sse_event_off_loop(ev)
        except APIError as e:
            yield sse_event(builder.failed(e))
        except Exception as e:
            log.exception("response %s failed", builder.id)
            yield sse_event(builder.failed(APIError(f"Internal server error: "
                                                    f"{type(e).__name__}: {e}", status=500)))

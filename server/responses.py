"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel, and GET /v1/responses/{id}/input_items.

One code path, as for chat: a request becomes an async stream of the Responses stream events
(response.created, response.in_progress, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done, then
response.completed or response.incomplete), each with its sequence_number. Streaming sends them
as server-sent events; a non-streamed response is the last event's `response`. The text is read
as chat's is (server/message_stream.py): a reasoning model's <think> text becomes a `reasoning`
output item, and with function tools (server/responses_tools.py) each call the model makes
becomes a `function_call` item (output_item.added, function_call_arguments.delta...,
function_call_arguments.done, output_item.done). `text.format` constrains the answer as chat's
response_format does (server/structured_outputs.py).

With `mcp` tools (server/responses_mcp.py) a response is a loop (ResponseRun): the servers'
tools are listed (mcp_list_tools items), the model runs, its calls to them run here (mcp_call
items) and the model runs again on their results, until it answers without one, calls a
function tool (the client's to run), needs an approval (an mcp_approval_request item), or has
run its calls (max_tool_calls, and --mcp-max-calls: the model then answers without the MCP
tools). max_output_tokens and usage count every model turn of the response.

Responses with `store` (the default) are kept in a bounded in-memory store
(server/responses_store.py, `--responses-store-size` entries and `--responses-store-mb`) for GET
and `previous_response_id`. `background: true` answers at once with the response `queued`; it
runs on (at most `--responses-max-background` at once), GET shows it `in_progress` and then
ended, and POST .../cancel stops it (`cancelled`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import AsyncIterator

from quart import Quart, Response, request

from server import json_io, streaming, structured_outputs
from server.message_stream import MessageStream
from server.protocol import APIError, _template_tool_call, not_supported
from server.responses_mcp import (McpCall, McpInput, McpSession, approval_request, declined,
                                  mcp_tool_specs, model_text, whole_item_events)
from server.responses_protocol import (CreateResponseRequest, encode_reasoning, input_messages,
                                       random_item_id)
from server.responses_store import ResponseStore, StoredResponse, freeze
from server.responses_tools import (call_ids, check_function_tools, echoed_tools,
                                    function_names, response_tools)
from server.responses_truncation import longest_fitting_tail

log = logging.getLogger("taper.server")


def register_responses(app: Quart, *, read_request, check_queue, fit_context, chat_prompt_ids,
                       tool_constraint, message_streams):
    """The routes, on `app`; the helpers are create_app's, shared with the chat route."""
    state = app.taper
    settings = state.settings
    store = ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
    app.taper_responses = store
    background = BackgroundRuns(settings.responses_max_background)
    app.taper_background = background

    def not_found(response_id: str, param: str | None = None) -> APIError:
        return APIError(f"Response with id '{response_id}' not found.", status=404,
                        param=param, code="response_not_found")

    async def stored(response_id: str, param: str | None = None) -> StoredResponse:
        # The running ones first: a run is stored before it leaves `runs`, so one that is not
        # running now is in the store (unless evicted); looking in the store first would miss a
        # run that ends, is stored and leaves `runs` while the store lookup waits on its thread.
        running = background.runs.get(response_id)
        if running is not None:
            if param == "previous_response_id":
                raise APIError(f"Response '{response_id}' is still "
                               f"{running.response['status']}: continue it once it has ended",
                               param=param, code="response_in_progress")
            return StoredResponse(running.snapshot(), running.input_items, [])
        entry = await asyncio.to_thread(store.get, response_id)
        if entry is None:
            raise not_found(response_id, param)
        return entry

    @app.post("/v1/responses")
    async def create_response():
        req, model, engine = await read_request(CreateResponseRequest)
        check_function_tools(req)
        specs = mcp_tool_specs(req.tools, settings.mcp_allowed_urls, state.mcp)
        if req.background:
            background.check_room()
        earlier, earlier_output = [], []
        if req.previous_response_id is not None:
            entry = await stored(req.previous_response_id, "previous_response_id")
            earlier, earlier_output = entry.conversation, entry.response["output"]
        mcp_input = McpInput(earlier_output)
        turn, items = input_messages(req.input, call_ids(earlier), mcp_input)
        builder = ResponseBuilder(req, model)
        mcp = None
        if specs:
            mcp = await McpSession.open(specs, state.mcp, function_names(req),
                                        settings.mcp_call_timeout)
        ctx = SimpleNamespace(state=state, fit_context=fit_context, check_queue=check_queue,
                              tool_constraint=tool_constraint, message_streams=message_streams,
                              conversation_prompt=conversation_prompt)
        run = ResponseRun(ctx, req, engine, builder, mcp, earlier + turn)
        try:
            await run.answer_approvals(mcp_input.approvals)
            await run.start_turn()
        except BaseException:
            await run.close()
            raise
        events = run.events()
        if req.store:
            events = _store_when_done(events, store, items, run.conversation)
        if req.background:
            async def keep(response: dict):        # a background response that failed or was
                entry = StoredResponse(response, items, run.conversation())     # cancelled
                store.put(response["id"], await asyncio.to_thread(freeze, entry))
            try:
                background.check_room()     # again: others may have started while this waited
            except APIError:
                await run.close()           # `events` never started: the engine has nothing
                raise
            background.start(builder, events, items, keep)
            return await json_io.response(builder.snapshot())
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
            budget = engine.max_model_len - max(req.requested_max_tokens() or 0, 1)
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
        running = response_id in background.runs
        if running:
            await background.cancel(response_id)
        if not store.delete(response_id) and not running:
            raise not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses/<response_id>/cancel")
    async def cancel_response(response_id: str):
        """A running background response stops (`cancelled`); one that has ended is answered
        as it is (cancelling is idempotent, as OpenAI's)."""
        if response_id in background.runs:
            return await json_io.response(await background.cancel(response_id))
        response = (await stored(response_id)).response
        if not response.get("background"):
            raise APIError("Only responses created with background: true can be cancelled",
                           code="invalid_value")
        return await json_io.response(response)

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
    return prompt_len + max(req.requested_max_tokens() or 0, 1) <= engine.max_model_len


def check_context(engine, req: CreateResponseRequest, prompt_len: int):
    """The context checks with the Responses API's names (fit_context names chat's)."""
    if fits(engine, req, prompt_len):
        return
    max_len, asked = engine.max_model_len, req.requested_max_tokens()
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


# ---- background responses

@dataclass(slots=True)
class _Background:
    builder: ResponseBuilder
    task: asyncio.Task
    input_items: list[dict]

    @property
    def response(self) -> dict:
        return self.builder.response

    def snapshot(self) -> dict:
        return self.builder.snapshot()


class BackgroundRuns:
    """The background responses running now, by id: each a task that drives its events to the
    end (where the store keeps it, as any stored response). One that fails, or is cancelled,
    is stored as it stands (status failed or cancelled)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.runs: dict[str, _Background] = {}

    def check_room(self) -> None:
        if len(self.runs) >= self.limit:
            raise APIError(f"Too many background responses are running ({self.limit}, "
                           "--responses-max-background); retry shortly", status=429,
                           type="rate_limit_error", code="too_many_background_responses",
                           headers={"Retry-After": "1"})

    def start(self, builder: ResponseBuilder, events: AsyncIterator[dict],
              input_items: list[dict], keep) -> None:
        task = asyncio.create_task(self._drive(builder, events, keep),
                                   name=f"background-{builder.id}")
        self.runs[builder.id] = _Background(builder, task, input_items)

    async def cancel(self, response_id: str) -> dict:
        run = self.runs.get(response_id)
        if run is not None:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
        return run.builder.snapshot()

    async def _drive(self, builder: ResponseBuilder, events: AsyncIterator[dict], keep) -> None:
        try:
            async with contextlib.aclosing(events):
                async for _ in events:
                    pass
        except asyncio.CancelledError:
            builder.response.update(status="cancelled")
            await keep(builder.snapshot())
        except APIError as e:
            builder.failed(e)
            await keep(builder.snapshot())
        except Exception as e:   # noqa: BLE001 - the response fails, the server goes on
            log.exception("background response %s failed", builder.id)
            builder.failed(APIError(f"Internal server error: {type(e).__name__}: {e}",
                                    status=500))
            await keep(builder.snapshot())
        finally:
            self.runs.pop(builder.id, None)


# ---- the response object and its events

class ResponseBuilder:
    """One response: the object every lifecycle event carries, and the numbered events."""

    def __init__(self, req: CreateResponseRequest, model: str):
        self.id = random_item_id("resp")
        self.sequence_number = 0
        self.include_encrypted = req.include_encrypted_reasoning()
        fmt = req.text_format()
        self.response = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "queued" if req.background else "in_progress", "completed_at": None,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": (True if req.parallel_tool_calls is None
                                    else req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning_echo(), "store": req.store,
            "background": bool(req.background), "max_tool_calls": req.max_tool_calls,
            "temperature": None, "top_p": None,
            "text": {"format": fmt if fmt is not None else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": echoed_tools(req), "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {},
        }
        # `usage` comes once the response has ended; the schema's `user` is never null
        if req.user is not None:
            self.response["user"] = req.user

    def sampled_with(self, params) -> None:
        self.response.update(temperature=params.temperature, top_p=params.top_p)

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return ev

    def snapshot(self) -> dict:
        # The response as it is now. Only its top-level fields and its output list change later
        # (closed output items are never edited), so a shallow copy freezes it; a deep copy
        # would copy the echoed tools, which may be megabytes, for each lifecycle event.
        return {**self.response, "output": list(self.response["output"])}

    def lifecycle(self, kind: str) -> dict:
        return self.event(kind, response=self.snapshot())

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
            done = status != "in_progress"
            encoded = (encode_reasoning(self.text) if done and self.builder.include_encrypted
                       else None)
            return {"id": self.id, "type": "reasoning", "summary": [],
                    "content": [self.part()] if done else [],
                    "encrypted_content": encoded, "status": status}
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


# ---- one response: its model turns and the MCP calls between them

_STARTED = object()        # turn_events' mark: the engine has given its first output


@dataclass(slots=True)
class _Turn:
    """A model turn started: its engine outputs and how its text is read."""
    outputs: AsyncIterator
    message: MessageStream
    num_prompt_tokens: int
    offers_mcp: bool                    # the MCP tools were offered (calls remain)


@dataclass(slots=True)
class _Draft:
    """A call to an MCP tool the model is writing: it runs once the turn has ended."""
    name: str
    arguments: str = ""


@dataclass(slots=True)
class _TurnResult:
    start: int = 0                      # the turn's first output item
    status: str = "completed"
    drafts: list[_Draft] = field(default_factory=list)
    function_calls: int = 0
    out: object = None                  # the engine's last output


class ResponseRun:
    """One response being made: its model turns (more than one when MCP calls run between
    them), the conversation they extend, and their events."""

    def __init__(self, ctx, req: CreateResponseRequest, engine, builder: ResponseBuilder,
                 mcp: McpSession | None, turns: list[dict]):
        self.ctx, self.req, self.engine, self.builder, self.mcp = ctx, req, engine, builder, mcp
        self.turns = turns                       # the conversation (template messages)
        settings = ctx.state.settings
        self.max_calls = min(req.max_tool_calls or math.inf, settings.mcp_max_calls)
        self.calls_made = 0
        # output items made before the model runs: the tool lists and approved calls
        self.premade: list[dict] = mcp.listing_items() if mcp else []
        self.premade_calls: list[tuple[McpCall, str | None, dict | None]] = []
        self.turn: _Turn | None = None
        self.turn_count = 0
        self.usage = {"input": 0, "cached": 0, "output": 0, "reasoning": 0}

    def conversation(self) -> list[dict]:
        return self.turns

    async def close(self) -> None:
        if self.mcp is not None:
            await self.mcp.close()

    async def answer_approvals(self, approvals) -> None:
        """Run the calls the input approves (each an mcp_call item, its result the answer's
        `tool` message); a declined one is answered as such."""
        for i, a in enumerate(approvals):
            label = a.request["server_label"]
            if self.mcp is None or not self.mcp.has_label(label):
                raise APIError(f"an mcp_approval_response answers a call to MCP server "
                               f"{label!r}, which is not among this request's mcp tools",
                               param="tools", code="invalid_value")
            if not a.approve:
                a.message["content"] = declined(a.reason)
                continue
            call = McpCall(self.builder, label, a.request["name"], a.request["arguments"],
                           approval_request_id=a.request["id"])
            output, error = await self._run_call(call)
            a.message["content"] = model_text(output, error)
            self.premade_calls.append((call, output, error))

    async def _run_call(self, call: McpCall) -> tuple[str | None, dict | None]:
        if self.calls_made >= self.max_calls:
            return None, {"type": "mcp_protocol_error", "code": -32000,
                          "message": f"not run: this response has made its {self.calls_made} "
                                     "MCP calls (max_tool_calls, --mcp-max-calls)"}
        self.calls_made += 1
        return await self.mcp.run(call.label, call.name, call.arguments)

    async def start_turn(self) -> None:
        """Render the conversation, check it fits, compile its constraint and start the model
        on it. The first turn's errors are the request's (an error status)."""
        ctx, req, engine = self.ctx, self.req, self.engine
        first = self.turn_count == 0
        offers_mcp = self.mcp is not None and self.calls_made < self.max_calls
        tools = response_tools(req, ctx.state.tool_parser, self.mcp, first_turn=first,
                               offer_mcp=offers_mcp)
        req.set_turns([], self.turns)
        prompt_ids = await ctx.conversation_prompt(engine, req, tools.rendered)
        self.turns = req.turns()               # truncation may have dropped the oldest turns
        params = ctx.fit_context(engine, req, len(prompt_ids), "input")
        await structured_outputs.prepare(engine, req, [params], ctx.state.settings,
                                         ctx.tool_constraint(engine, req, tools),
                                         "tools" if tools.choice == "auto" else "tool_choice")
        if first:
            ctx.check_queue(engine)
            self.builder.sampled_with(params)
        request_id = self.builder.id if first else f"{self.builder.id}-{self.turn_count}"
        message = ctx.message_streams(engine, request_id, prompt_ids, params, tools,
                                      reasoning=True)(0)
        timing = ctx.state.metrics.request()
        outputs = streaming.engine_outputs(engine, request_id, prompt_ids, params, timing,
                                           "input")
        self.turn = _Turn(outputs, message, len(prompt_ids), offers_mcp and tools.parser
                          is not None)
        self.turn_count += 1

    async def events(self) -> AsyncIterator[dict]:
        """The response's events, its model turns' and its MCP calls' in order. The first waits
        for the engine's first output, so a request the engine refuses fails before anything
        is sent."""
        b = self.builder
        started = False
        try:
            while True:
                result = _TurnResult()
                names = self.mcp.names() if self.mcp is not None else set()
                async for ev in turn_events(b, self.turn, names, result):
                    if ev is _STARTED:
                        if not started:
                            started = True
                            for e in self._opening():
                                yield e
                        result.start = len(b.response["output"])
                        continue
                    yield ev
                self._count(result)
                tool_messages: list[dict] = []
                pending = False
                for draft in result.drafts:
                    async for ev in self._mcp_call(draft, result, tool_messages):
                        yield ev
                    pending |= b.response["output"][-1]["type"] == "mcp_approval_request"
                self.turns = self.turns + [assistant_turn(b.response["output"][result.start:])]
                self.turns += tool_messages
                if result.status == "incomplete" or not result.drafts or pending \
                        or result.function_calls or not self.turn.offers_mcp:
                    status = result.status
                    break
                left = self._output_left()
                if left is not None and left < 1:
                    status = "incomplete"
                    break
                if left is not None:
                    self.req.limit_output_now(left)
                await self.start_turn()
        finally:
            await self.close()
        r = b.response
        r["usage"] = self._usage()
        if status == "incomplete":
            r.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            yield b.lifecycle("response.incomplete")
        else:
            r.update(status="completed", completed_at=int(time.time()))
            yield b.lifecycle("response.completed")

    def _opening(self) -> list[dict]:
        """created and in_progress, then the items made before the model ran."""
        b = self.builder
        b.response["status"] = "in_progress"
        events = [b.lifecycle("response.created"), b.lifecycle("response.in_progress")]
        for item in self.premade:
            events += whole_item_events(b, item)
        for call, output, error in self.premade_calls:
            events += call.open() + call.close(output, error)
        return events

    async def _mcp_call(self, draft: _Draft, result: _TurnResult,
                        tool_messages: list[dict]) -> AsyncIterator[dict]:
        """A model's call to an MCP tool: an mcp_call item, run (or, when its server wants
        approval, an mcp_approval_request item; cut by max_output_tokens, an incomplete
        mcp_call that never ran)."""
        b = self.builder
        label = self.mcp.label(draft.name)
        if result.status == "incomplete":
            call = McpCall(b, label, draft.name, draft.arguments)
            for ev in call.open() + call.close(None, None, status="incomplete"):
                yield ev
            return
        if self.calls_made < self.max_calls and self.mcp.needs_approval(draft.name):
            for ev in whole_item_events(b, approval_request(label, draft.name, draft.arguments)):
                yield ev
            return
        call = McpCall(b, label, draft.name, draft.arguments)
        for ev in call.open():
            yield ev
        output, error = await self._run_call(call)
        for ev in call.close(output, error):
            yield ev
        tool_messages.append({"role": "tool", "tool_call_id": call.id,
                              "content": model_text(output, error)})

    def _count(self, result: _TurnResult) -> None:
        out, u = result.out, self.usage
        u["input"] += out.num_prompt_tokens or self.turn.num_prompt_tokens
        u["cached"] += out.num_cached_tokens
        output = out.num_output_tokens or len(out.token_ids)
        u["output"] += output
        u["reasoning"] += min(self.turn.message.num_reasoning_tokens, output)

    def _output_left(self) -> int | None:
        asked = self.req.max_output_tokens
        return None if asked is None else asked - self.usage["output"]

    def _usage(self) -> dict:
        u = self.usage
        return {"input_tokens": u["input"],
                "input_tokens_details": {"cached_tokens": u["cached"], "cache_write_tokens": 0},
                "output_tokens": u["output"],
                "output_tokens_details": {"reasoning_tokens": u["reasoning"]},
                "total_tokens": u["input"] + u["output"]}


async def turn_events(builder: ResponseBuilder, turn: _Turn, mcp_names: set[str],
                      result: _TurnResult) -> AsyncIterator:
    """The events of one model turn: its text read by the turn's message stream (reasoning,
    answer text, function calls), each part an output item of its own, in the order they come.
    Calls to MCP tools (named in `mcp_names`) are collected in `result.drafts`, to run once
    the turn has ended. _STARTED comes first, when the engine's first output does."""
    current = None                      # the output item being streamed
    calls: dict[int, _FunctionCall] = {}
    drafts: dict[int, _Draft] = {}
    started = False
    output = builder.response["output"]

    def switch(kind: str, make) -> list[dict]:
        """Close the current item unless it is of `kind`; open a new one made by `make`."""
        nonlocal current
        events = []
        if current is not None and current.kind == kind != "function_call":
            return events
        if current is not None:
            events += current.close("completed")
        current = make(len(output))
        return events + current.open()

    async with contextlib.aclosing(turn.outputs):
        async for out in turn.outputs:
            streaming._check_output(out)
            if not started:
                yield _STARTED
                started = True
            delta = turn.message.feed(out.text_delta, len(out.new_token_ids), out.finished)
            if thought := delta.get("reasoning_content"):
                for ev in switch("reasoning", lambda i: _Item(builder, "reasoning", i)):
                    yield ev
                yield current.delta(thought)
            answer = delta.get("content")
            if answer or (out.finished and current is None and not calls and not drafts
                          and not delta.get("tool_calls") and not output):
                for ev in switch("message", lambda i: _Item(builder, "message", i)):
                    yield ev
                if answer:
                    yield current.delta(answer)
            for c in delta.get("tool_calls") or []:
                index, fn = c["index"], c["function"]
                if index not in calls and index not in drafts:
                    if fn["name"] in mcp_names:
                        drafts[index] = _Draft(fn["name"])
                    else:
                        for ev in switch("function_call", lambda i: _FunctionCall(
                                builder, i, c["id"], fn["name"])):
                            yield ev
                        calls[index] = current
                if fn["arguments"]:
                    if index in drafts:
                        drafts[index].arguments += fn["arguments"]
                    else:
                        yield calls[index].delta(fn["arguments"])
            if out.finished:
                result.status = "incomplete" if out.finish_reason == "length" else "completed"
                if current is not None:
                    for ev in current.close(result.status):
                        yield ev
                result.out = out
                break
        else:
            raise APIError("The engine ended the request without finishing it",
                           status=500, type="server_error", code="engine_error")
    result.drafts = list(drafts.values())
    result.function_calls = len(calls)


async def _store_when_done(events: AsyncIterator[dict], store: ResponseStore,
                           input_items: list[dict], conversation) -> AsyncIterator[dict]:
    """Pass the events on; once the response has ended, store it with the conversation it
    ends (`conversation()`: the earlier turns, this input, this response's turns)."""
    async with contextlib.aclosing(events):
        async for ev in events:
            if ev["type"] in ("response.completed", "response.incomplete"):
                response = ev["response"]
                entry = StoredResponse(response, input_items, conversation())
                # linear in its size (the echoed tools may be megabytes)
                store.put(response["id"], await asyncio.to_thread(freeze, entry))
            yield ev


def assistant_turn(output: list[dict]) -> dict:
    """One model turn's output items as the assistant message a chat template renders: its
    answer, its reasoning (as reasoning_content), its function and MCP calls."""
    answer = "".join(item["content"][0]["text"] for item in output
                     if item["type"] == "message" and item["content"])
    turn = {"role": "assistant", "content": answer}
    reasoning = "\n".join(item["content"][0]["text"] for item in output
                          if item["type"] == "reasoning" and item["content"])
    if reasoning:
        turn["reasoning_content"] = reasoning
    calls = []
    for item in output:
        if item["type"] == "function_call":
            call_id = item["call_id"]
        elif item["type"] in ("mcp_call", "mcp_approval_request"):
            call_id = item["id"]
        else:
            continue
        calls.append(_template_tool_call({"id": call_id, "type": "function", "function": {
            "name": item["name"], "arguments": item["arguments"]}}, "output"))
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

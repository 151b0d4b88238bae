"""The OpenAI-compatible HTTP API (Quart): /v1/models, /v1/chat/completions, /v1/completions.

Handlers validate (server/protocol.py), tokenize, check the context window, hand the request to
the engine, and turn its outputs into chunks (server/streaming.py): sent as SSE when streaming,
folded into one JSON response otherwise.
"""
from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator

import jinja2
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from server import streaming
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, parse_json_body,
                             parse_request)

log = logging.getLogger("taper.server")


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status,
                    content_type="application/json")


def _error(e: APIError) -> Response:
    return _json(e.body(), e.status)


def create_app(engine, served_model_name: str | list[str] | None = None) -> Quart:
    app = Quart("taper")
    # Generation can take longer than Quart's 60 s default, streaming or not.
    app.config["RESPONSE_TIMEOUT"] = None
    names = ([served_model_name] if isinstance(served_model_name, str)
             else list(served_model_name or [])) or [engine.model_name]
    created = int(time.time())

    @app.errorhandler(APIError)
    async def _api_error(e: APIError):
        return _error(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException):
        kind = "not_found_error" if e.code == 404 else "invalid_request_error"
        return _error(APIError(f"{e.name}: {request.method} {request.path}", status=e.code,
                               type=kind))

    @app.errorhandler(Exception)
    async def _internal_error(e: Exception):
        log.exception("internal error on %s %s", request.method, request.path)
        return _error(APIError(f"Internal server error: {type(e).__name__}: {e}", status=500,
                               type="server_error"))

    @app.get("/health")
    async def health():
        if engine.is_running:
            return _json({"status": "ok"})
        return _json({"status": "engine stopped"}, 503)

    @app.get("/v1/models")
    async def list_models():
        return _json({"object": "list",
                      "data": [{"id": n, "object": "model", "created": created, "owned_by": "taper",
                                "max_model_len": engine.max_model_len} for n in names]})

    def resolve_model(name: str | None) -> str:
        if name is None:
            return names[0]
        if name not in names:
            raise APIError(f"The model '{name}' does not exist; this server serves "
                           + ", ".join(repr(n) for n in names), status=404,
                           param="model", code="model_not_found")
        return name

    async def read_request(cls):
        body = parse_json_body(await request.get_data())
        req = parse_request(cls, body)
        if not engine.is_running:
            raise APIError("The engine is not running", status=503, type="server_error")
        return req, resolve_model(req.model)

    def fit_context(req, prompt_len: int, param: str):
        """Check the prompt fits, and pick max_tokens: by default the room left."""
        max_len = engine.max_model_len
        if prompt_len >= max_len:
            raise APIError(f"This model's maximum context length is {max_len} tokens, and the "
                           f"{param} has {prompt_len} tokens (at least one more is needed for "
                           "the completion). Please shorten it.", param=param,
                           code="context_length_exceeded")
        room = max_len - prompt_len
        asked = req.requested_max_tokens()
        if asked is not None and asked > room:
            name = ("max_completion_tokens" if getattr(req, "max_completion_tokens", None)
                    else "max_tokens")
            raise APIError(f"This model's maximum context length is {max_len} tokens. However, "
                           f"you requested {prompt_len + asked} tokens ({prompt_len} in the "
                           f"{param}, {asked} for the completion). Please reduce the {param} or "
                           f"{name}.", param=name, code="context_length_exceeded")
        return req.to_sampling_params(default_max_tokens=room)

    async def respond(info: streaming.ResponseInfo, chunks: AsyncIterator[dict], fold):
        """Stream the chunks as SSE or fold them into one JSON body.

        The first chunk is awaited here, so a request that fails before producing anything gets
        an error status rather than a 200 stream holding an error event.
        """
        try:
            first = await anext(chunks)
        except BaseException:
            await chunks.aclose()
            raise
        if info.stream:
            resp = Response(streaming.sse_stream(info, first, chunks), status=200,
                            content_type="text/event-stream")
            resp.headers["Cache-Control"] = "no-cache"
            resp.headers["X-Accel-Buffering"] = "no"
            resp.timeout = None
            return resp

        async def all_chunks():
            yield first
            async for c in chunks:
                yield c
        return _json(await fold(info, all_chunks()))

    @app.post("/v1/chat/completions")
    async def chat_completions():
        req, model = await read_request(ChatCompletionRequest)
        tok = engine.tokenizer
        if tok is None:
            raise APIError("This model has no tokenizer; use /v1/completions with token ids",
                           param="messages", code="no_tokenizer")
        if not tok.has_chat_template and req.chat_template is None:
            raise APIError("This model has no chat template; use /v1/completions or pass "
                           "chat_template", param="messages", code="no_chat_template")
        messages = req.template_messages()
        try:
            prompt_ids = tok.encode_chat(messages, enable_thinking=req.enable_thinking(),
                                         add_generation_prompt=req.add_generation_prompt,
                                         chat_template=req.chat_template)
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
            # a template that rejects the conversation (e.g. roles out of order)
            raise APIError(f"The chat template could not render these messages: {e}",
                           param="messages", code="invalid_messages") from None
        params = fit_context(req, len(prompt_ids), "messages")
        info = streaming.ResponseInfo(streaming.random_id("chatcmpl"), model,
                                      "chat.completion.chunk", stream=req.stream,
                                      include_usage=bool(req.stream_options
                                                         and req.stream_options.include_usage))
        outputs = streaming.engine_outputs(engine, info.id, prompt_ids, params)
        chunks = streaming.chat_chunks(info, outputs, len(prompt_ids))
        return await respond(info, chunks, streaming.fold_chat)

    @app.post("/v1/completions")
    async def completions():
        req, model = await read_request(CompletionRequest)
        tok = engine.tokenizer
        prompts = req.prompts()
        if tok is None and (req.echo or any(isinstance(p, str) for p in prompts)):
            raise APIError("This model has no tokenizer: send the prompt as token ids, "
                           "without echo", param="prompt", code="no_tokenizer")
        batch_ids = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
        params_list = [fit_context(req, len(ids), "prompt") for ids in batch_ids]
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else tok.decode(p) for p in prompts]
        info = streaming.ResponseInfo(streaming.random_id("cmpl"), model, "text_completion",
                                      stream=req.stream,
                                      include_usage=bool(req.stream_options
                                                         and req.stream_options.include_usage))
        streams = [streaming.engine_outputs(engine, f"{info.id}-{i}", ids, params)
                   for i, (ids, params) in enumerate(zip(batch_ids, params_list))]
        chunks = streaming.completion_chunks(info, streams, [len(ids) for ids in batch_ids], echo)

        async def fold(info, chunks):
            return await streaming.fold_completion(info, chunks, len(prompts))
        return await respond(info, chunks, fold)

    return app

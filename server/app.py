"""The OpenAI-compatible HTTP API (Quart).

Routes: /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health,
/metrics, /version, and the web chat UI at /ui (server/ui.py). Handlers validate
(server/protocol.py), tokenize, check the context window, hand the request to the engine, and turn
its outputs into chunks (server/streaming.py): sent as SSE when streaming, folded into one JSON
response otherwise.

The app starts before the engine exists: `ServerState.engine` is None while the model loads
(503s and /health says "loading"), and `draining` is set on SIGTERM (503s for new requests while
the live ones finish).

Routes kept in modules of their own are registered from create_app: /v1/embeddings
(server/embeddings.py), /v1/rerank and /v1/score (server/rerank.py), the Responses API
(server/responses.py), Anthropic's /v1/messages (server/anthropic.py, whose errors take
Anthropic's shape), /v1/load_lora_adapter and /v1/unload_lora_adapter (server/lora_adapters.py).

LoRA adapters (--enable-lora) are served models too: a generation request names one in `model`,
and /v1/models lists each with `parent` set to the base model.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import AsyncIterator

import jinja2
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from engine.text.tokenizer import TextTooLong
from server import json_io, media, request_body, streaming, structured_outputs, tokenizing
from server.anthropic import error_body as anthropic_error_body
from server.anthropic import is_anthropic_path, register_anthropic
from server.embeddings import register_embeddings
from server.lora_adapters import register_lora
from server.rerank import register_rerank
from server.limits import Limits
from server.message_stream import MessageStream
from server.reasoning import ReasoningSplitter, prompt_opens_reasoning
from server.tool_calls import ChatTools, chat_tools, template_call_ids
from server.tool_grammar import strict_call_constraint, tool_call_constraint
from server.logprobs import prompt_text_offsets, token_text
from server.metrics import Metrics
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                             DetokenizeRequest, TokenizeRequest)
from server.responses import register_responses
from server.ui import is_ui_path, register_ui

log = logging.getLogger("taper.server")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_queued_requests: int | None = None   # waiting sequences before new requests get 429
    max_gen_tokens: int | None = None        # cap on the default max_tokens
    sampling_defaults: dict = field(default_factory=dict)  # server flags over generation_config
    chat_template: str | None = None         # --chat-template, over the tokenizer's
    trust_request_chat_template: bool = False  # a template is code: clients may not send one
    limits: Limits = field(default_factory=Limits)   # what one request may ask (server/limits.py)
    cors_origins: list[str] = field(default_factory=list)   # none: no browser origin may call
    responses_store_size: int = 1000         # stored Responses API responses, oldest dropped
    responses_store_bytes: int = 128 * 2**20  # and their size as JSON, oldest dropped
    structured_outputs_timeout: float = 5.0  # seconds a grammar may take to compile
    tool_parser: str | None = None           # --enforce-parser; else chosen for the model
    model_notice: str | None = None          # one line clients show beside the model (the demo's)
    rerank: str = "auto"                     # --rerank: how /v1/rerank and /v1/score score
    mcp_allowed_urls: list[str] = field(default_factory=list)  # Responses `mcp` server_urls
    mcp_max_calls: int = 20                  # MCP calls one response may run
    mcp_call_timeout: float = 120.0          # seconds one MCP call may take
    responses_max_background: int = 64       # background responses running at once
    media_limits: media.MediaSettings = field(default_factory=media.MediaSettings)  # images
    lora_runtime_updates: bool = False       # /v1/(un)load_lora_adapter are on


@dataclass
class ServerState:
    settings: ServerSettings
    engine: object | None = None             # None while the model loads
    draining: bool = False                   # SIGTERM received: finish live requests, take no new
    metrics: Metrics | None = None
    tool_parser: type | None = None          # the ToolParser class chat requests with tools use
    reasoning_model: bool = False            # the tokenizer has <think> and </think>
    mcp: object | None = None                # McpTools (--mcp-config): tools for tool-less requests

    def configure_chat(self) -> None:
        """How chat output is read for this model: its tool-call parser (--enforce-parser's,
        else the one its architecture and chat template point to; logged) and whether it
        reasons in <think> tags."""
        from server.tool_parsers import choose_parser, get_parser
        name, why = self.settings.tool_parser, "--enforce-parser"
        if name is None:
            tok = self.engine.tokenizer
            template = self.settings.chat_template or getattr(getattr(tok, "hf", None),
                                                              "chat_template", None)
            if isinstance(template, dict):       # named templates (default, tool_use, ...)
                template = "\n".join(template.values())
            name, why = choose_parser(self.engine.model_config.architecture, template)
        self.tool_parser = get_parser(name) if name else None
        log.info("tool-call parser: %s (%s)", name or "none", why)
        tok = self.engine.tokenizer
        self.reasoning_model = tok is not None and tok.has_tokens(("<think>", "</think>"))

    def resolve_model(self, name: str | None, lora: bool = False) -> str:
        """The served model a request names (the first served name when it names none); a 404
        naming `model` for any other. lora: a loaded LoRA adapter's name is served too (a
        generation request); else it is a 400 (embeddings and scores run the base model)."""
        names = self.settings.served_model_names
        if name is None:
            return names[0]
        if name not in names:
            if name in self.lora_names():
                if lora:
                    return name
                raise APIError(f"The model '{name}' is a LoRA adapter, which serves generation "
                               f"only; this endpoint serves the base model '{names[0]}'",
                               param="model", code="model_not_supported")
            served = names + self.lora_names()
            raise APIError(f"The model '{name}' does not exist; this server serves "
                           + ", ".join(repr(n) for n in served), status=404,
                           param="model", code="model_not_found")
        return name

    def lora_adapters(self) -> list:
        """The LoRA adapters loaded now (engine/lora/adapter.py LoraAdapter), in load order."""
        manager = getattr(self.engine, "lora", None)
        return [] if manager is None else manager.adapters()

    def lora_names(self) -> list[str]:
        return [a.name for a in self.lora_adapters()]

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` selects; None: the base model."""
        if model is None or model in self.settings.served_model_names:
            return None
        return model if model in self.lora_names() else None

    def unavailable(self) -> APIError | None:
        """Why requests cannot be served now (as the 503 to send), or None."""
        if self.draining:
            return APIError("The server is shutting down", status=503, type="server_error",
                            code="shutting_down")
        if self.engine is None:
            return APIError("The model is still loading; retry shortly", status=503,
                            type="server_error", code="model_loading",
                            headers={"Retry-After": "5"})
        if not self.engine.is_running:
            return APIError("The engine is not running", status=503, type="server_error",
                            code="engine_error")
        return None

    def image_processor(self, engine):
        """The model's image processor settings (preprocessor_config.json), read once."""
        if getattr(self, "_image_processor", None) is None:
            from engine.vision.families import image_processor
            self._image_processor = image_processor(engine.engine.model_dir,
                                                    engine.model_config.vision)
        return self._image_processor

    def ready_engine(self):
        if error := self.unavailable():
            raise error
        return self.engine

    def engine_stats(self):
        """The engine's stats, or data-parallel replicas' each by replica."""
        if self.engine is None:
            return None
        by_replica = getattr(self.engine, "stats_by_replica", None)
        return by_replica() if by_replica is not None else self.engine.stats()


def taper_version() -> str:
    try:
        return version("taper")
    except PackageNotFoundError:       # running from a source tree that was never installed
        return "unknown"


def is_json(mimetype: str) -> bool:
    """application/json, or a JSON-based type (application/...+json)."""
    return mimetype == "application/json" or (mimetype.startswith("application/")
                                              and mimetype.endswith("+json"))


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status,
                    content_type="application/json")


def _error(e: APIError) -> Response:
    body = anthropic_error_body(e) if is_anthropic_path(request.path) else e.body()
    resp = _json(body, e.status)
    resp.headers.update(e.headers)
    return resp


async def off_loop(engine, fn, *args, param: str, **kwargs):
    """Run tokenizer work (template rendering, encoding) on the tokenizer threads
    (server/tokenizing.py): a long prompt or a heavy template must not stall every other stream
    on the event loop. Text the tokenizer cannot take (a lone surrogate, say) is the client's
    error, named by `param`, and so is a text too long for the context."""
    try:
        return await tokenizing.run(fn, *args, **kwargs)
    except TextTooLong as e:
        raise tokenizing.too_long(engine, e, param) from None
    except (TypeError, ValueError, UnicodeError) as e:
        raise APIError(f"{param} could not be tokenized: {e}", param=param,
                       code="invalid_value") from None


def create_app(engine, settings: ServerSettings) -> Quart:
    """The app for `engine` (None: set `app.taper.engine` once loaded)."""
    state = ServerState(settings, engine)
    if engine is not None:
        state.configure_chat()
    names = settings.served_model_names
    state.metrics = Metrics(state.engine_stats, names[0])
    app = Quart("taper")
    app.taper = state
    # Generation can take longer than Quart's 60 s default, streaming or not.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = settings.limits.max_body_bytes
    created = int(time.time())

    @app.errorhandler(APIError)
    async def _api_error(e: APIError):
        return _error(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException):
        kind = "not_found_error" if e.code == 404 else "invalid_request_error"
        message = f"{e.name}: {request.method} {request.path}"
        if e.code == 413:
            message = (f"{e.name}: the request body is larger than this server accepts "
                       f"({settings.limits.max_body_bytes} bytes, --max-request-mb)")
        return _error(APIError(message, status=e.code, type=kind))

    @app.errorhandler(Exception)
    async def _internal_error(e: Exception):
        log.exception("internal error on %s %s", request.method, request.path)
        return _error(APIError("Internal server error (the server log has the details)",
                               status=500, type="server_error"))

    # ---- CORS (the web UI and browser clients) and auth

    def cors_headers(resp: Response) -> Response:
        origin = request.headers.get("Origin")
        allowed = settings.cors_origins
        if origin and ("*" in allowed or origin in allowed):
            resp.headers["Access-Control-Allow-Origin"] = "*" if "*" in allowed else origin
            # SDKs add their own headers (openai-node: x-stainless-*): allow what is asked
            resp.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type")
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
            resp.headers["Access-Control-Max-Age"] = "600"
            if "*" not in allowed:
                resp.headers["Vary"] = "Origin"
        return resp

    @app.before_request
    async def _preflight_auth_drain():
        if request.method == "OPTIONS":         # CORS preflight carries no credentials
            return Response(status=204)
        if request.path == "/health" or is_ui_path(request.path):   # public: no key, no 503
            return None
        if state.draining and request.path != "/metrics":
            return _error(state.unavailable())
        if settings.api_key is None:
            return None
        auth = request.headers.get("Authorization", "")
        # Anthropic's clients send the key as x-api-key
        token = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
            return _error(APIError("Incorrect or missing API key: send 'Authorization: Bearer "
                                   "<key>' or 'x-api-key: <key>'", status=401,
                                   code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"}))
        return None

    @app.before_request
    async def _json_only():
        # A web page can POST text/plain (or a body with no type) to any origin without a CORS
        # preflight: such a request must not run, whether or not the page may read the answer.
        if request.method == "POST" and not is_json(request.mimetype):
            return _error(APIError(f"Content-Type must be application/json (got "
                                   f"{request.content_type or 'none'})", status=415,
                                   code="unsupported_media_type"))
        return None

    @app.after_request
    async def _cors(resp: Response):
        return cors_headers(resp)

    register_ui(app)                          # the web chat UI at /ui

    # ---- service routes

    @app.get("/health")
    async def health():
        error = state.unavailable()
        if error is None:
            return _json({"status": "ok"})
        status = {"shutting_down": "shutting down", "model_loading": "loading"}.get(
            error.code, "engine stopped")
        return _json({"status": status}, 503)

    @app.get("/version")
    async def version_route():
        return _json({"version": taper_version()})

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, status=200, content_type=content_type)

    def model_card(name: str) -> dict:
        max_len = None if state.engine is None else state.engine.max_model_len
        card = {"id": name, "object": "model", "created": created, "owned_by": "taper",
                "max_model_len": max_len}
        if settings.model_notice:      # an extra field, as max_model_len: SDKs keep it
            card["notice"] = settings.model_notice
        adapter = next((a for a in state.lora_adapters() if a.name == name), None)
        if adapter is not None and name not in names:     # vLLM's fields for an adapter
            card.update(root=adapter.path, parent=names[0])
        return card

    @app.get("/v1/models")
    async def list_models():
        return _json({"object": "list",
                      "data": [model_card(n) for n in names + state.lora_names()]})

    @app.get("/v1/models/<path:name>")        # hub ids hold a slash
    async def retrieve_model(name: str):
        return _json(model_card(state.resolve_model(name, lora=True)))

    async def read_request(cls):
        req = await request_body.read(await request.get_data(), cls, state.engine,
                                      settings.limits)
        engine = state.ready_engine()
        return req, state.resolve_model(req.model, lora=True), engine

    def check_queue(engine, num_new: int = 1, param: str = "n"):
        """429 while the waiting sequences and the `num_new` a request brings (its prompts x n,
        or beams) pass --max-queued-requests; 400 naming `param` for a request that alone
        passes it."""
        limit = settings.max_queued_requests
        if limit is None:
            return
        if num_new > limit:
            raise APIError(f"{param}: this request runs {num_new} sequences, more than this "
                           f"server lets wait ({limit}, --max-queued-requests)", param=param,
                           code="too_many_sequences")
        if engine.num_queued_sequences() + num_new > limit:
            raise APIError(f"Too many requests are waiting ({limit} sequences); retry shortly",
                           status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})

    def fit_context(engine, req, prompt_len: int, param: str):
        """Check the prompt fits, and pick max_tokens: by default the room left, capped by
        --max-gen-tokens."""
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
        default = room if settings.max_gen_tokens is None else min(room, settings.max_gen_tokens)
        defaults = {**getattr(engine, "generation_defaults", {}), **settings.sampling_defaults}
        params = req.to_sampling_params(default_max_tokens=default, defaults=defaults,
                                        vocab_size=vocab_size(engine))
        params.lora_name = state.lora_name(getattr(req, "model", None))
        return params

    def vocab_size(engine) -> int:
        model_config = getattr(engine, "model_config", None)
        return model_config.vocab_size if model_config is not None else engine.tokenizer.vocab_size

    def logprobs_options(engine, req) -> streaming.LogprobsOptions:
        return streaming.LogprobsOptions(token_text(engine.tokenizer), req.output_logprobs(),
                                         req.prompt_logprobs)

    def require_tokenizer(engine, param: str):
        if engine.tokenizer is None:
            raise APIError("This model has no tokenizer: use /v1/completions with token ids",
                           param=param, code="no_tokenizer")
        return engine.tokenizer

    async def chat_prompt_ids(engine, req, param: str = "messages",
                              tools: list[dict] | None = None) -> list[int]:
        tok = require_tokenizer(engine, param)
        if req.chat_template is not None and not settings.trust_request_chat_template:
            raise APIError("chat_template in a request is refused: a template is code the "
                           "server runs; start it with --trust-request-chat-template to allow "
                           "this", param="chat_template", code="unsupported_parameter")
        template = req.chat_template or settings.chat_template
        if not tok.has_chat_template and template is None:
            raise APIError("This model has no chat template; use /v1/completions, or start the "
                           "server with --chat-template FILE", param=param,
                           code="no_chat_template")

        vision = getattr(engine.model_config, "vision", None)

        def encode(messages, images):  # off the event loop: there may be many messages
            if state.tool_parser is not None:
                messages = template_call_ids(messages, state.tool_parser.id_style)
            return tok.encode_chat(
                messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                chat_template=template, max_chars=tokenizing.max_text_chars(engine),
                rewrite=media.text_expander(vision, tok, images) if images else None,
                **req.template_kwargs())
        try:
            messages, sources = await tokenizing.run(
                lambda: media.take_images(req.template_messages(), vision))
            if not sources:
                return await tokenizing.run(encode, messages, [])
            # the images first: Gemma 3's pan-and-scan crops change the prompt's text
            images = await media.load_images(sources, settings.media_limits,
                                             state.image_processor(engine))
            ids = await tokenizing.run(encode, messages, images)
            return media.expand_image_tokens(ids, images, vision)
        except TextTooLong as e:
            raise tokenizing.too_long(engine, e, param) from None
        except (ValueError, TypeError, KeyError, UnicodeError, jinja2.TemplateError) as e:
            # a template that rejects the conversation (e.g. roles out of order)
            raise APIError(f"The chat template could not render these messages: {e}",
                           param=param, code="invalid_messages") from None

    async def respond(info: streaming.ResponseInfo, chunks: AsyncIterator[dict], fold):
        """Stream the chunks as SSE or fold them into one JSON body.

        The first chunk is awaited here, so a request that fails before producing anything gets
        an error status rather than a 200 stream holding an error event.
        """
        first = await streaming.first_of(chunks)
        if info.stream:
            return streaming.sse_response(streaming.sse_stream(info, first, chunks))

        async def all_chunks():
            yield first
            async for c in chunks:
                yield c
        return await json_io.response(await fold(info, all_chunks()))

    @app.post("/v1/chat/completions")
    async def chat_completions():
        req, model, engine = await read_request(ChatCompletionRequest)
        tools = chat_tools(req, state.tool_parser, state.mcp.tools() if state.mcp else None)
        prompt_ids = await chat_prompt_ids(engine, req, tools=tools.rendered)
        params = fit_context(engine, req, len(prompt_ids), "messages")
        await structured_outputs.prepare(engine, req, [params], settings,
                                         tool_constraint(engine, req, tools),
                                         "tools" if tools.choice == "auto" else "tool_choice")
        check_queue(engine, req.fan_out()[0])
        info = streaming.ResponseInfo(streaming.random_id("chatcmpl"), model,
                                      "chat.completion.chunk", stream=req.stream,
                                      include_usage=req.include_usage())
        message = chat_message_streams(engine, info.id, prompt_ids, params, tools)
        timing = state.metrics.request()
        outputs = streaming.engine_outputs(engine, info.id, prompt_ids, params, timing,
                                           "messages")
        if req.continuous_usage():
            info.running_usage = streaming.RunningUsage(len(prompt_ids))
            outputs = info.running_usage.watch(outputs)
        chunks = streaming.chat_chunks(info, outputs, len(prompt_ids), timing, req.n,
                                       logprobs_options(engine, req), message)
        return await respond(info, chunks, streaming.fold_chat)

    def tool_constraint(engine, req, tools: ChatTools):
        """The grammar that makes the model call a tool, when tool_choice requires one; under
        "auto", the lazy one that holds a started call to its strict tool's schema (unless the
        request constrains its output itself: then that constraint rules the answer)."""
        if tools.choice == "required" or isinstance(tools.choice, tuple):
            return tool_call_constraint(tools.parser, tools.rendered, tools.choice,
                                        tools.parallel, engine.tokenizer)
        if tools.choice == "auto" and structured_outputs.request_constraint(req) is None:
            return strict_call_constraint(tools.parser, tools.rendered, tools.parallel,
                                          engine.tokenizer)
        return None

    def chat_message_streams(engine, request_id, prompt_ids, params, tools: ChatTools,
                             reasoning: bool | None = None):
        """The MessageStream factory for a chat request's choices, or None when its text is
        plain content: reasoning is split for models with <think> tokens (or as `reasoning`
        says), tool calls are read when the request has tools. A parser whose markers are
        special tokens needs them in the text, so the request keeps special tokens and drops
        the stop token's text."""
        reasoning = state.reasoning_model if reasoning is None else reasoning
        if not reasoning and tools.parser is None:
            return None
        tok = engine.tokenizer
        stop_texts = ()
        if tools.parser is not None and tok.has_special_tokens(tools.parser.markers):
            params.skip_special_tokens = False
            stop_texts = tuple(tok.decode([t], skip_special_tokens=False)
                               for t in sorted(tok.eos_token_ids))
        opened = reasoning and prompt_opens_reasoning(
            tok.decode(prompt_ids[-8:], skip_special_tokens=False))
        return lambda i: MessageStream(f"{request_id}-{i}",
                                       ReasoningSplitter(opened) if reasoning else None,
                                       tools.parser, tools.parallel, stop_texts)

    @app.post("/v1/completions")
    async def completions():
        req, model, engine = await read_request(CompletionRequest)
        prompts = req.prompts()
        tok = engine.tokenizer
        if req.echo or any(isinstance(p, str) for p in prompts):
            require_tokenizer(engine, "prompt")

        tokenizing.check_lengths(engine, prompts, "prompt")

        def tokenize_batch():
            limit = tokenizing.max_text_chars(engine)
            return [tok.encode(p, max_chars=limit) if isinstance(p, str) else p for p in prompts]
        batch_ids = await off_loop(engine, tokenize_batch, param="prompt")
        params_list = [fit_context(engine, req, len(ids), "prompt") for ids in batch_ids]
        await structured_outputs.prepare(engine, req, params_list, settings)
        check_queue(engine, req.fan_out()[0])
        echo, echo_tokens = None, None
        if req.echo:
            echo = [p if isinstance(p, str) else tok.decode(p) for p in prompts]
            if req.logprobs is not None:
                echo_tokens = await off_loop(
                    engine, lambda: [(ids, prompt_text_offsets(tok, ids)) for ids in batch_ids],
                    param="prompt")
        info = streaming.ResponseInfo(streaming.random_id("cmpl"), model, "text_completion",
                                      stream=req.stream, include_usage=req.include_usage())
        timings = [state.metrics.request() for _ in prompts]
        streams = [streaming.engine_outputs(engine, f"{info.id}-{i}", ids, params, timing,
                                            "prompt")
                   for i, (ids, params, timing) in enumerate(zip(batch_ids, params_list, timings))]
        if req.continuous_usage():
            info.running_usage = streaming.RunningUsage(sum(len(ids) for ids in batch_ids))
            streams = [info.running_usage.watch(s, i) for i, s in enumerate(streams)]
        chunks = streaming.completion_chunks(info, streams, [len(ids) for ids in batch_ids],
                                             timings, echo, req.n, logprobs_options(engine, req),
                                             echo_tokens)

        async def fold(info, chunks):
            return await streaming.fold_completion(info, chunks, len(prompts) * req.n)
        return await respond(info, chunks, fold)

    register_embeddings(app, state, check_queue)
    register_rerank(app, state, check_queue)
    register_lora(app, state)

    @app.post("/tokenize")
    async def tokenize():
        req, _, engine = await read_request(TokenizeRequest)
        tok = require_tokenizer(engine, "prompt")
        if req.messages is not None:     # exactly the ids /v1/chat/completions would run
            ids = await chat_prompt_ids(engine, req)
        else:
            ids = await off_loop(engine, tok.encode, req.prompt, param="prompt",
                                 add_special_tokens=req.add_special_tokens,
                                 max_chars=tokenizing.max_text_chars(engine))
        return await json_io.response({
            "count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None})

    @app.post("/detokenize")
    async def detokenize():
        req, _, engine = await read_request(DetokenizeRequest)
        tok = require_tokenizer(engine, "tokens")
        vocab = tok.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"token id {req.tokens[bad]} is out of range [0, {vocab})",
                           param=f"tokens[{bad}]", code="invalid_value")
        return _json({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

    register_responses(app, read_request=read_request, check_queue=check_queue,
                       fit_context=fit_context, chat_prompt_ids=chat_prompt_ids,
                       tool_constraint=tool_constraint, message_streams=chat_message_streams)
    register_anthropic(app, limits=settings.limits, check_queue=check_queue,
                       fit_context=fit_context,
                       chat_prompt_ids=chat_prompt_ids, tool_constraint=tool_constraint,
                       message_streams=chat_message_streams)
    return app

"""OpenAI wire protocol: request models, validation, and the error shape.

Requests are parsed with pydantic; every failure becomes an `APIError` that the app renders as
OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with HTTP 400 (never 422),
naming the offending parameter. Features that later issues add are refused with a clear
"not yet supported" message rather than silently ignored.
"""
from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from engine.sampling.logprobs import MAX_LOGPROBS
from engine.sampling.sampling_params import SamplingParams
from server import json_io

log = logging.getLogger("taper.server")

MAX_N = 128      # choices per request, as OpenAI's chat API allows


class APIError(Exception):
    """An error answered to the client as `{"error": {...}}` with HTTP `status`."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code = param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def not_supported(param: str) -> APIError:
    return APIError(f"'{param}' is not yet supported by this server", param=param,
                    code="unsupported_parameter")


def _param_path(loc: tuple) -> str:
    """pydantic's error location as OpenAI writes params: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(part):
            out += ("." if out else "") + str(part)
    return out


def _is_union_tag(part: str) -> bool:
    # pydantic adds the union member's type to the location (e.g. "str", "list[int]",
    # "function-after[...]"); those are not parameter names.
    return any(c in part for c in "[]-") or part in ("str", "int", "list", "float", "bool")


_UNION_HINTS = {
    "prompt": "must be a string, an array of strings, an array of token ids "
              "or an array of arrays of token ids",
    "stop": "must be a string or an array of strings",
    "input": "must be a string, an array of strings, an array of token ids "
             "or an array of arrays of token ids",
    "content": "must be a string or an array of content parts",
}
# the same field name meaning something else in one request type (ValidationError.title)
_UNION_HINTS_BY_MODEL = {
    ("CreateResponseRequest", "input"): "must be a string or an array of input items",
}


def validation_error(err: ValidationError) -> APIError:
    first = err.errors(include_url=False)[0]
    loc = first["loc"]
    param = _param_path(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    union = next((i for i, part in enumerate(loc)
                  if isinstance(part, str) and _is_union_tag(part)), None)
    if union is not None and first["type"] != "value_error":
        # A failed union reports one error per member; say what the parameter accepts instead.
        param = _param_path(loc[:union])
        field = str(loc[union - 1])
        msg = _UNION_HINTS_BY_MODEL.get((err.title, field)) or _UNION_HINTS.get(
            field, "has an invalid type")
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    text = f"{param}: {msg}" if param else msg
    return APIError(text, param=param, code=code if param else None)


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json_io.loads(raw)     # in pieces when large (call it off the event loop then)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"Request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:        # server/limits.py's depth check comes first; this backs it up
        raise APIError("The request body is nested too deeply to parse",
                       code="json_too_deep") from None
    if not isinstance(body, dict):
        raise APIError("Request body must be a JSON object", code="invalid_json")
    return body


# ---- shared sampling fields

class _Request(BaseModel):
    # Unknown fields are accepted and ignored (parse_request logs them), as OpenAI-compatible
    # servers commonly do.
    model_config = ConfigDict(extra="allow")
    # Lists server/limits.py bounds before validation: field name -> "messages", "prompts", "stop"
    limited_fields: ClassVar[dict[str, str]] = {}

    def check_supported(self):
        """Refuse valid fields whose feature this server does not have (yet)."""

    def fan_out(self) -> tuple[int, str]:
        """The sequences this request runs, and how they come (for the limit's message)."""
        return 1, "1 sequence"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM's: usage on every chunk (implies the above)


class _SamplingRequest(_Request):
    limited_fields: ClassVar[dict[str, str]] = {"stop": "stop"}
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None          # chat: a bool, completions: a count (the subclasses say)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # vLLM's field
    # beam search (vLLM's names): best_of beams, the n best returned
    use_beam_search: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    response_format: Any = None                # server/structured_outputs.py reads it
    # Accepted by the protocol, refused until a later issue implements them.
    functions: list[dict] | None = None        # the deprecated spelling of tools
    function_call: Any = None
    # Structured outputs (server/structured_outputs.py reads them and response_format): vLLM's
    # object and its older top-level spellings.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Many clients send `"stream": null`, `"n": null`: read null as "not given".
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].default is None}
        return data

    def check_supported(self):
        if self.use_beam_search and self.stream:
            raise APIError("streaming is not supported with beam search (use_beam_search)",
                           param="stream", code="invalid_value")
        if self.best_of not in (None, 1) and not self.use_beam_search:
            raise not_supported("best_of")     # OpenAI's sampled best_of; beams are supported
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sequences_per_prompt(self) -> tuple[int, str]:
        """n choices, or with beam search best_of beams (n when it is not given)."""
        if self.use_beam_search:
            return max(self.best_of or self.n, self.n), "beams"
        return self.n, "choices"

    def fan_out(self) -> tuple[int, str]:
        count, kind = self.sequences_per_prompt()
        return count, f"{count} {kind}"

    def output_logprobs(self) -> int | None:
        """Top logprobs per output token the engine computes (None: no logprobs)."""
        return None

    def reasoning_budget(self) -> int | None:
        """Reasoning tokens before the engine forces </think> (None: no budget)."""
        return None

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def check_logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with integer keys; 400 naming it for a key that is not a token id of this
        model or a value outside [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                tid = None
            if tid is None or not 0 <= tid < vocab_size:
                raise APIError(f"logit_bias: {key!r} is not a token id of this model "
                               f"(ids are 0 to {vocab_size - 1})", param="logit_bias",
                               code="invalid_value")
            if not -100.0 <= value <= 100.0:
                raise APIError(f"logit_bias: the bias {value} for token {tid} is outside "
                               "[-100, 100]", param="logit_bias", code="invalid_value")
            out[tid] = out.get(tid, 0.0) + value
        return out

    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, default_max_tokens: int,
                           defaults: dict[str, float] | None = None,
                           vocab_size: int | None = None) -> SamplingParams:
        """Engine parameters. `default_max_tokens` applies when the request gives none;
        `defaults` (the server's sampling flags over generation_config.json) fill in the sampling
        fields the request leaves out; `vocab_size` bounds logit_bias's token ids."""
        defaults = defaults or {}
        max_tokens = self.requested_max_tokens()
        kwargs: dict[str, Any] = dict(
            n=self.n,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            # OpenAI's seed is a signed 64-bit int; the engine's generator takes an unsigned one.
            seed=None if self.seed is None else self.seed % 2**64,
            logprobs=self.output_logprobs(), prompt_logprobs=self.engine_prompt_logprobs(),
            use_beam_search=self.use_beam_search, best_of=self.best_of,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            logit_bias=self.check_logit_bias(vocab_size if vocab_size is not None else 2**31),
            reasoning_budget=self.reasoning_budget(),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:       # SamplingParams names the parameter first
            text = str(e)
            raise APIError(text, param=text.split(" ", 1)[0], code="invalid_value") from None


# ---- /v1/chat/completions

class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None

    def text(self, where: str) -> str | None:
        """The content as one string; array parts must all be text."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type in _MEDIA_PARTS:
                raise APIError(f"This model is text-only: content parts of type '{part.type}' "
                               "are not supported", param=f"{where}.content[{j}].type",
                               code="unsupported_content")
            if part.type not in ("text", "input_text") or part.text is None:
                raise APIError(f"content part type '{part.type}' is not supported (text parts "
                               "need a 'text' string)", param=f"{where}.content[{j}]",
                               code="invalid_value")
            texts.append(part.text)
        return "\n".join(texts)

    def _template_content(self, where: str):
        """The content as one string, or, when it holds images, a list of text parts and image
        parts (server/media.py turns them into the model's image placeholders)."""
        if not isinstance(self.content, list) or not any(p.type in _IMAGE_PARTS
                                                         for p in self.content):
            return self.text(where) or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.type in _IMAGE_PARTS:
                parts.append(image_part(part.model_dump(), f"{where}.content[{j}]"))
            else:
                parts.append({"type": "text", "text": ChatMessage(
                    role=self.role, content=[part]).text(f"{where}.content[{j}]")})
        return parts

    def template_message(self, where: str) -> dict:
        """The message as chat templates read it. `developer` is OpenAI's newer name for
        `system`; tool-call arguments arrive as JSON strings and templates expect objects."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self._template_content(where)}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [_template_tool_call(c, f"{where}.tool_calls[{k}]")
                                 for k, c in enumerate(self.tool_calls)]
        # An earlier answer's reasoning, under either name this server sends it by; templates
        # (Qwen3's) read `reasoning_content` and show it in the turns after the last question.
        extra = self.model_extra or {}
        reasoning = extra.get("reasoning_content", extra.get("reasoning"))
        if self.role == "assistant" and isinstance(reasoning, str):
            msg["reasoning_content"] = reasoning
        return msg


# Media a text-only model cannot read; images go to a vision model (server/media.py).
_MEDIA_PARTS = {"image_url", "input_image", "image", "input_audio", "audio", "video_url", "file"}
_IMAGE_PARTS = ("image_url", "input_image")


def image_part(part, where: str) -> dict:
    """A chat template's image part for a request's image content part; `where` names the
    part in errors."""
    url = part.get("image_url") if isinstance(part, dict) else None
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise APIError("an image part needs an image URL ('image_url': {'url': ...}, or a "
                       "string); file ids are not supported", param=where, code="invalid_value")
    return {"type": "image", "image_url": url, "param": where}


def _template_tool_call(call: dict, where: str) -> dict:
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise APIError("a tool call needs type 'function' and function.name", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass                      # not JSON: the template gets the string as sent
    return {**call, "type": "function", "function": {**fn, "arguments": args}}


class _ChatInput(_Request):
    """Messages and the chat-template controls: chat completions and /tokenize share them."""
    limited_fields: ClassVar[dict[str, str]] = {"messages": "messages"}
    messages: list[ChatMessage] | None = None
    # vLLM-style extensions
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # candle-vllm's switch for reasoning models; a bool or Anthropic-style {"type": "enabled"}
    thinking: bool | dict | None = None
    enable_thinking: bool | None = None

    def template_messages(self) -> list[dict]:
        return [m.template_message(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template: chat_template_kwargs, and enable_thinking from
        whichever of the three spellings the client used."""
        kwargs = dict(self.chat_template_kwargs or {})
        thinking = self.thinking
        if isinstance(thinking, dict):
            thinking = thinking.get("type", "enabled") != "disabled"
        for value in (self.enable_thinking, thinking):
            if value is not None:
                kwargs["enable_thinking"] = bool(value)
        return kwargs


class ChatCompletionRequest(_SamplingRequest, _ChatInput):
    limited_fields: ClassVar[dict[str, str]] = {"messages": "messages", "stop": "stop"}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: reasoning tokens (after <think>) before the engine forces </think>
    thinking_token_budget: int | None = Field(default=None, ge=0)

    def check_supported(self):
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")

    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def reasoning_budget(self) -> int | None:
        return self.thinking_token_budget

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; it wins when both are given.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ---- /v1/completions

class CompletionRequest(_SamplingRequest):
    limited_fields: ClassVar[dict[str, str]] = {"prompt": "prompts", "stop": "stop"}
    prompt: str | list[str] | list[int] | list[list[int]]
    # Top logprobs per token: OpenAI allows 0-5, we allow up to 20 as vLLM does.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if isinstance(v[0], list) and any(not ids for ids in v):
                raise ValueError("token id lists must not be empty")
            flat = [t for ids in v for t in ids] if isinstance(v[0], list) else v
            if flat and isinstance(flat[0], int) and min(flat) < 0:
                raise ValueError("token ids must be non-negative")
        return v

    def check_supported(self):
        super().check_supported()
        if self.suffix:
            raise not_supported("suffix")
        for name in ("functions", "function_call"):      # tools are for chat
            if getattr(self, name) not in (None, [], "none"):
                raise APIError(f"'{name}' is a chat parameter; /v1/completions has no tools",
                               param=name, code="unsupported_parameter")

    def output_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        # echo with logprobs shows the prompt tokens' logprobs too
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def fan_out(self) -> tuple[int, str]:
        count, kind = self.sequences_per_prompt()
        prompts = len(self.prompts())
        return prompts * count, f"{prompts} prompts x {count} {kind}"

    def prompts(self) -> list[str | list[int]]:
        """The batch: each element a text prompt or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


# ---- /tokenize and /detokenize (vLLM's shapes)

class TokenizeRequest(_ChatInput):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True          # prompts only: messages get the chat route's ids
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def parse_request(cls: type[_Request], body: dict) -> _Request:
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model_extra:
        log.info("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
    req.check_supported()
    return req

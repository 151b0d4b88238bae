"""The Responses API's request (POST /v1/responses): fields, what is refused, and the input as
chat-template messages.

The sampling fields and vLLM's extras (top_k, min_p, seed, chat_template_kwargs, ...) are the
chat route's; the Responses API's own names are `input`, `instructions` and `max_output_tokens`.
Function tools are server/responses_tools.py's. A field whose feature this server lacks and
that would change the output (other tools, structured outputs, logprobs, background mode, ...)
is refused with a 400 naming it; fields that
cannot change the output here (parallel_tool_calls, tool_choice "auto" with no tools, ...) are
accepted and echoed.
"""
from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator

from server.protocol import APIError, _ChatInput, _SamplingRequest, not_supported
from server.responses_tools import call_message, output_message

_ROLES = ("user", "assistant", "system", "developer")
_CUSTOM_TOOL_ITEMS = {"custom_tool_call", "custom_tool_call_output"}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio", "image_url", "file"}


def random_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class CreateResponseRequest(_SamplingRequest, _ChatInput):
    limited_fields: ClassVar[dict[str, str]] = {"input": "messages"}
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    text: dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    reasoning: dict | None = None
    include: list[str] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    # no effect on a self-hosted server's output: accepted
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    # the earlier turns (from previous_response_id) and this input, as template messages
    _turns: list[dict] = PrivateAttr(default_factory=list)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(s) > 512
                                                  for k, s in v.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of "
                             "at most 512")
        return v

    def check_supported(self):
        super().check_supported()
        if self.max_tokens is not None:
            raise APIError("the Responses API names this max_output_tokens",
                           param="max_tokens", code="unknown_parameter")
        if self.messages is not None:
            raise APIError("the Responses API takes the conversation as 'input' (a string or "
                           "a list of message items)", param="messages",
                           code="unknown_parameter")
        fmt = (self.text or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise APIError("text.format: only {'type': 'text'} is supported; structured outputs "
                           "(json_schema, json_object) are not yet supported",
                           param="text.format", code="unsupported_parameter")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise not_supported("text.verbosity")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise not_supported("reasoning")
        if self.logprobs or self.top_logprobs:
            raise not_supported("top_logprobs" if self.top_logprobs else "logprobs")
        # chat's and completions' decoding extras, which a response (one output) does not take
        if self.n != 1:
            raise not_supported("n")
        for name in ("use_beam_search", "prompt_logprobs"):
            if getattr(self, name):
                raise not_supported(name)
        for name in ("include", "background", "conversation", "prompt", "context_management"):
            if getattr(self, name):
                raise not_supported(name)

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def template_messages(self) -> list[dict]:
        """What the chat template renders: the instructions as a system message (never carried
        over by previous_response_id), then the conversation."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + self._turns

    def turns(self) -> list[dict]:
        return self._turns

    def set_turns(self, earlier: list[dict], turn: list[dict]) -> None:
        self._turns = earlier + turn


def input_messages(value: str | list[dict],
                   earlier_call_ids: set[str] = frozenset()) -> tuple[list[dict], list[dict]]:
    """(template messages, input items as GET .../input_items lists them) of `input`.
    function_call items join the assistant message before them as its tool calls;
    function_call_output items become `tool` messages and must answer a call made before
    (in this input or, by id, in `earlier_call_ids`)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    messages, items = [], []
    open_ids = set(earlier_call_ids)
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":          # an earlier turn's reasoning: templates drop it
            continue
        if kind == "function_call":
            call, stored = call_message(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            open_ids.add(call["id"])
            items.append(stored)
            continue
        if kind == "function_call_output":
            message, stored = output_message(item, where)
            if message["tool_call_id"] not in open_ids:
                raise APIError(f"call_id {message['tool_call_id']!r} answers no earlier "
                               "function_call", param=f"{where}.call_id", code="invalid_value")
            messages.append(message)
            items.append(stored)
            continue
        if kind in _CUSTOM_TOOL_ITEMS:
            raise APIError(f"input items of type '{kind}' need custom tools, which this server "
                           "does not run (function tools only)", param=f"{where}.type",
                           code="unsupported_parameter")
        if kind != "message":
            raise APIError(f"input item type '{kind}' is not supported (give messages: "
                           "{'role', 'content'})", param=f"{where}.type", code="invalid_value")
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(f"role must be one of {', '.join(_ROLES)}", param=f"{where}.role",
                           code="invalid_value")
        text = _content_text(item.get("content"), role, where)
        messages.append({"role": "system" if role == "developer" else role, "content": text})
        part = "output_text" if role == "assistant" else "input_text"
        stored = {"id": item.get("id") or random_item_id("msg"), "type": "message",
                  "role": role, "status": "completed",
                  "content": [{"type": part, "text": text}]}
        if role == "assistant":
            stored["content"][0].update(annotations=[], logprobs=[])
        items.append(stored)
    if not messages:
        raise APIError("input has no message", param="input", code="invalid_value")
    return messages, items


def _content_text(content, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError("content must be a string or a list of content parts",
                       param=f"{where}.content", code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise APIError(f"This model is text-only: content parts of type '{kind}' are not "
                           "supported", param=f"{where}.content[{j}].type",
                           code="unsupported_content")
        allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
        key = "refusal" if kind == "refusal" else "text"
        if kind not in allowed or not isinstance(part.get(key), str):
            raise APIError(f"a {role} message's content parts must be of type "
                           f"{' or '.join(allowed)}, with a '{key}' string",
                           param=f"{where}.content[{j}]", code="invalid_value")
        texts.append(part[key])
    return "\n".join(texts)

"""The Responses API's request (POST /v1/responses): fields, what is refused, and the input as
chat-template messages.

The sampling fields and vLLM's extras (top_k, min_p, seed, chat_template_kwargs, ...) are the
chat route's; the Responses API's own names are `input`, `instructions` and `max_output_tokens`.
Function tools are server/responses_tools.py's, `mcp` tools server/responses_mcp.py's,
`text.format` is read by server/structured_outputs.py as chat's response_format is.
`reasoning.effort` reaches the chat template as `reasoning_effort` (and "none" as
`enable_thinking: false`); `reasoning.summary` is accepted, but no model here writes summaries
apart from its reasoning, so `summary` stays empty and the reasoning is the item's `content`.

Reasoning round trip: with `include: ["reasoning.encrypted_content"]` a reasoning item carries
its text in `encrypted_content`, which is an opaque encoding, not encryption (the client has the
text in `content` anyway); a reasoning item sent back as input (its `content`, else its
`encrypted_content`) becomes the next assistant turn's `reasoning_content`, which templates that
show earlier reasoning (Qwen3's, within a tool-call loop) render. An encrypted_content this server
did not make is a 400.

A field whose feature this server lacks and that would change the output (other tools,
logprobs, ...) is refused with a 400 naming it; fields that cannot change the output here
(parallel_tool_calls, tool_choice "auto" with no tools, ...) are accepted and echoed.
"""
from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator

from server.protocol import APIError, _ChatInput, _SamplingRequest, image_part, not_supported
from server.responses_mcp import McpInput
from server.responses_tools import call_message, output_message

_ROLES = ("user", "assistant", "system", "developer")
_CUSTOM_TOOL_ITEMS = {"custom_tool_call", "custom_tool_call_output"}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio", "image_url", "file"}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = ("auto", "concise", "detailed")
INCLUDE_ENCRYPTED = "reasoning.encrypted_content"
# Marks the reasoning text this server encodes in encrypted_content (no encryption: see above).
_ENCODED = "taper.reasoning.v1:"


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
    # the output tokens left to a later model turn of the response (tool loops), when set
    _max_output_now: int | None = PrivateAttr(default=None)

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
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise not_supported("text.verbosity")
        self._check_reasoning()
        for i, name in enumerate(self.include or []):
            if name != INCLUDE_ENCRYPTED:
                raise APIError(f"include: {name!r} is not supported (this server can include "
                               f"{INCLUDE_ENCRYPTED!r})", param=f"include[{i}]",
                               code="unsupported_parameter")
        if self.background:
            if not self.store:
                raise APIError("background responses need store: true (they are read back "
                               "with GET /v1/responses/{id})", param="background",
                               code="invalid_value")
            if self.stream:
                raise APIError("stream with background is not supported: poll GET "
                               "/v1/responses/{id} instead", param="stream",
                               code="unsupported_parameter")
        if self.logprobs or self.top_logprobs:
            raise not_supported("top_logprobs" if self.top_logprobs else "logprobs")
        # chat's and completions' decoding extras, which a response (one output) does not take
        if self.n != 1:
            raise not_supported("n")
        for name in ("use_beam_search", "prompt_logprobs"):
            if getattr(self, name):
                raise not_supported(name)
        for name in ("conversation", "prompt", "context_management"):
            if getattr(self, name):
                raise not_supported(name)

    def _check_reasoning(self):
        if self.reasoning is None:
            return
        if not isinstance(self.reasoning, dict):
            raise APIError("reasoning must be an object", param="reasoning", code="invalid_value")
        for key, value in self.reasoning.items():
            allowed = {"effort": _EFFORTS, "summary": _SUMMARIES,
                       "generate_summary": _SUMMARIES}.get(key)
            if value is None:
                continue
            if allowed is None:
                raise not_supported(f"reasoning.{key}")
            if value not in allowed:
                raise APIError(f"reasoning.{key} must be one of {', '.join(allowed)}",
                               param=f"reasoning.{key}", code="invalid_value")

    def reasoning_echo(self) -> dict:
        r = self.reasoning or {}
        return {"effort": r.get("effort"), "summary": r.get("summary", r.get("generate_summary"))}

    def text_format(self) -> dict | None:
        """text.format, for server/structured_outputs.py (which checks it)."""
        return (self.text or {}).get("format")

    def include_encrypted_reasoning(self) -> bool:
        return INCLUDE_ENCRYPTED in (self.include or [])

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = super().template_kwargs()
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
            if effort == "none":
                kwargs.setdefault("enable_thinking", False)
        return kwargs

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens if self._max_output_now is None else self._max_output_now

    def limit_output_now(self, tokens: int) -> None:
        """Later model turns of one response share max_output_tokens: `tokens` are left."""
        self._max_output_now = tokens

    def template_messages(self) -> list[dict]:
        """What the chat template renders: the instructions as a system message (never carried
        over by previous_response_id), then the conversation."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + self._turns

    def turns(self) -> list[dict]:
        return self._turns

    def set_turns(self, earlier: list[dict], turn: list[dict]) -> None:
        self._turns = earlier + turn


def input_messages(value: str | list[dict], earlier_call_ids: set[str] = frozenset(),
                   mcp: McpInput | None = None) -> tuple[list[dict], list[dict]]:
    """(template messages, input items as GET .../input_items lists them) of `input`.
    function_call items join the assistant message before them as its tool calls;
    function_call_output items become `tool` messages and must answer a call made before
    (in this input or, by id, in `earlier_call_ids`). A reasoning item's text goes with the
    assistant turn after it. MCP items (mcp_call, mcp_list_tools, mcp_approval_request and
    mcp_approval_response) are read by `mcp` (server/responses_mcp.py)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    mcp = mcp or McpInput()
    messages, items = [], []
    open_ids = set(earlier_call_ids)
    reasoning: list[str] = []            # read, waiting for the assistant turn it belongs to

    def assistant_turn() -> dict:
        """The assistant message the next call joins (a new one unless the last is)."""
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning and "reasoning_content" not in last:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return last

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError("an input item must be an object", param=where, code="invalid_value")
        kind = item.get("type", "message")
        if kind == "reasoning":
            text, stored = reasoning_input(item, where)
            if text:
                reasoning.append(text)
            items.append(stored)
            continue
        if kind == "function_call":
            call, stored = call_message(item, where)
            assistant_turn().setdefault("tool_calls", []).append(call)
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
        if kind in McpInput.KINDS:
            items.append(mcp.read(item, where, messages, assistant_turn))
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
        message = {"role": "system" if role == "developer" else role, "content": text}
        if role == "assistant" and reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        part = "output_text" if role == "assistant" else "input_text"
        stored = {"id": item.get("id") or random_item_id("msg"), "type": "message",
                  "role": role, "status": "completed",
                  "content": [{"type": part, "text": text}] if isinstance(text, str)
                  else list(item["content"])}      # with its images
        if role == "assistant":
            stored["content"][0].update(annotations=[], logprobs=[])
        items.append(stored)
    if not messages:
        raise APIError("input has no message", param="input", code="invalid_value")
    return messages, items


def encode_reasoning(text: str) -> str:
    """A reasoning item's encrypted_content: its text, encoded (not encrypted)."""
    return _ENCODED + base64.urlsafe_b64encode(text.encode("utf-8", "surrogatepass")).decode()


def reasoning_input(item: dict, where: str) -> tuple[str, dict]:
    """(the text, the item as stored) of a reasoning input item: its reasoning_text parts, else
    its encrypted_content as this server encodes it."""
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise APIError("a reasoning item's content is a list of reasoning_text parts",
                       param=f"{where}.content", code="invalid_value")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" \
                or not isinstance(part.get("text"), str):
            raise APIError("a reasoning item's content parts are {'type': 'reasoning_text', "
                           "'text': ...}", param=f"{where}.content[{j}]", code="invalid_value")
        texts.append(part["text"])
    text = "\n".join(texts)
    encoded = item.get("encrypted_content")
    if not texts and encoded is not None:
        text = _decode_reasoning(encoded, f"{where}.encrypted_content")
    stored = {"id": item.get("id") or random_item_id("rs"), "type": "reasoning", "summary": [],
              "content": [{"type": "reasoning_text", "text": text}] if text else []}
    return text, stored


def _decode_reasoning(encoded, param: str) -> str:
    if isinstance(encoded, str) and encoded.startswith(_ENCODED):
        try:
            return base64.urlsafe_b64decode(encoded[len(_ENCODED):].encode("ascii")).decode(
                "utf-8", "surrogatepass")
        except (ValueError, binascii.Error, UnicodeError):
            pass
    raise APIError("encrypted_content was not made by this server: it can read back only the "
                   "reasoning of its own responses (asked for with include: "
                   f"['{INCLUDE_ENCRYPTED}']); send the item's content instead", param=param,
                   code="invalid_value")


def _content_text(content, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError("content must be a string or a list of content parts",
                       param=f"{where}.content", code="invalid_value")
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and role == "user":   # for a vision model (server/media.py)
            parts.append(image_part(part, f"{where}.content[{j}]"))
            continue
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
        parts.append({"type": "text", "text": part[key]})
    return "\n".join(texts) if len(parts) == len(texts) else parts

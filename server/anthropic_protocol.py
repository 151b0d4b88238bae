"""Anthropic's Messages API requests (POST /v1/messages and /v1/messages/count_tokens): their
fields, what is refused, and their translation into the chat route's request.

The translation is the whole of what is Anthropic's here: once a request is a
`ChatCompletionRequest`, the chat route's template rendering, tool checks, tool-call parser and
tool grammars serve it unchanged (server/anthropic.py runs them).

- `system` (a string or text blocks) becomes the system message; `messages` the conversation:
  consecutive turns of one role are one turn (as Anthropic combines them), text blocks are the
  content, `tool_use` blocks the assistant's tool calls, `tool_result` blocks `tool` messages
  (in the order of the blocks), `thinking` blocks the assistant's `reasoning_content`.
- A conversation that ends with an assistant turn is a prefill: its text is continued
  (transformers' `continue_final_message`), not answered.
- `tools` (name, description, input_schema, strict) become function tools; `tool_choice` auto,
  any, tool and none become "auto", "required", the named function and "none";
  `disable_parallel_tool_use` is `parallel_tool_calls: false`.
- `thinking` enabled or adaptive is the template's `enable_thinking`, disabled turns it off;
  enabled's `budget_tokens` (checked as Anthropic checks it) is the chat route's
  `thinking_token_budget`: after that many reasoning tokens the engine forces `</think>` and the
  model answers (engine/sampling/reasoning_budget.py). Adaptive has no budget.
- `output_config.format` (a JSON schema) is the chat route's `response_format`.

A field that would change the output and that this server lacks is a 400 naming it (media
blocks, server tools, `mcp_servers`); fields with no effect here (metadata, cache_control,
service_tier, output_config.effort, ...) are accepted and ignored.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.protocol import APIError

# Anthropic's minimum for thinking.budget_tokens
MIN_THINKING_BUDGET = 1024
# Blocks a text-only model cannot read.
_MEDIA_BLOCKS = {"image", "document", "search_result", "container_upload"}
# Fields that ask the server to do what it does not: refused rather than ignored.
_REFUSED_FIELDS = {"mcp_servers": "server-side MCP servers",
                   "container": "code-execution containers"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict]


class _AnthropicInput(BaseModel):
    """What both routes take: the conversation, tools and thinking (count_tokens counts the
    prompt that /v1/messages would run for them)."""
    model_config = ConfigDict(extra="allow")
    # the lists server/limits.py bounds before validation builds anything from them
    limited_fields: ClassVar[dict[str, str]] = {"messages": "messages", "stop_sequences": "stop"}
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None

    def check_supported(self):
        for name, what in _REFUSED_FIELDS.items():
            if (self.model_extra or {}).get(name):
                raise APIError(f"{name}: {what} are not supported by this server",
                               param=name, code="unsupported_parameter")
        thinking_type(self.thinking)

    def max_tokens_asked(self) -> int | None:
        return None

    def fan_out(self) -> tuple[int, str]:
        """One sequence: Anthropic's API has no n (server/limits.py asks every request)."""
        return 1, "1 sequence"

    def chat_body(self) -> dict:
        """The request as the chat route's request body (server/protocol.py's
        ChatCompletionRequest)."""
        messages = chat_messages(self.system, self.messages)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if messages[-1]["role"] == "assistant":
            # a prefill: the model goes on writing the assistant's text
            body["add_generation_prompt"] = False
            body["chat_template_kwargs"] = {"continue_final_message": True}
        if self.tools is not None:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"], parallel = chat_tool_choice(self.tool_choice)
            if not parallel:
                body["parallel_tool_calls"] = False
        thinking = thinking_type(self.thinking)
        if thinking is not None:
            body["enable_thinking"] = thinking != "disabled"
        if thinking == "enabled":
            body["thinking_token_budget"] = self.thinking["budget_tokens"]
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            body["response_format"] = chat_response_format(fmt)
        return body


class CountTokensRequest(_AnthropicInput):
    pass


class MessagesRequest(_AnthropicInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict | None = None

    def check_supported(self):
        super().check_supported()
        budget = (self.thinking or {}).get("budget_tokens")
        if thinking_type(self.thinking) == "enabled" and budget >= self.max_tokens:
            raise APIError(f"max_tokens ({self.max_tokens}) must be greater than "
                           f"thinking.budget_tokens ({budget})", param="max_tokens",
                           code="invalid_value")
        if any(not s for s in self.stop_sequences or []):
            raise APIError("stop_sequences must not hold an empty string",
                           param="stop_sequences", code="invalid_value")

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    def chat_body(self) -> dict:
        body = super().chat_body()
        body.update(max_tokens=self.max_tokens, stop=self.stop_sequences or [],
                    stream=self.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


# ---- the conversation

def chat_messages(system, messages: list[AnthropicMessage]) -> list[dict]:
    """The system prompt and the conversation as chat messages (the chat route's shape)."""
    out: list[dict] = []
    if system is not None:
        text = system if isinstance(system, str) else _texts(system, "system")
        out.append({"role": "system", "content": text})
    turns = _combined_turns(messages)
    call_ids: set[str] = set()
    for n, (role, blocks) in enumerate(turns):
        last = n == len(turns) - 1
        if role == "assistant":
            out.append(_assistant_message(blocks, last))
            call_ids.update(c["id"] for c in out[-1].get("tool_calls", []))
        else:
            out += _user_messages(blocks, call_ids)
    return out


def _combined_turns(messages: list[AnthropicMessage]) -> list[tuple[str, list]]:
    """[(role, [(where, block), ...])]: consecutive messages of one role are one turn, as
    Anthropic combines them; a string content is one text block."""
    turns: list[tuple[str, list]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        blocks = ([(where, {"type": "text", "text": m.content})] if isinstance(m.content, str)
                  else [(f"{where}[{j}]", b) for j, b in enumerate(m.content)])
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    return turns


def _block_type(block, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise APIError("a content block needs a 'type'", param=where, code="invalid_value")
    if kind in _MEDIA_BLOCKS:
        raise APIError(f"This model is text-only: content blocks of type '{kind}' are not "
                       "supported", param=f"{where}.type", code="unsupported_content")
    return kind


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError("a text block needs a 'text' string", param=f"{where}.text",
                       code="invalid_value")
    return block["text"]


def _texts(blocks, where: str) -> str:
    """Text blocks as one string (the chat route joins text parts with newlines too)."""
    if not isinstance(blocks, list):
        raise APIError("must be a string or a list of text blocks", param=where,
                       code="invalid_value")
    texts = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise APIError(f"only text blocks are allowed here, not '{kind}'",
                           param=f"{where}[{j}].type", code="invalid_value")
        texts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _user_messages(blocks: list, call_ids: set[str]) -> list[dict]:
    """A user turn: its text blocks as user messages and its tool_result blocks as `tool`
    messages, in the order of the blocks; each tool_result answers one of `call_ids`, the
    tool_use blocks before it."""
    out: list[dict] = []
    for where, block in blocks:
        kind = _block_type(block, where)
        if kind == "text":
            text = _text(block, where)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            use_id = block.get("tool_use_id")
            if not isinstance(use_id, str) or not use_id:
                raise APIError("a tool_result block needs the tool_use_id it answers",
                               param=f"{where}.tool_use_id", code="invalid_value")
            if use_id not in call_ids:
                raise APIError(f"tool_use_id {use_id!r} answers no earlier tool_use block",
                               param=f"{where}.tool_use_id", code="invalid_value")
            content = block.get("content", "")
            # is_error has no place in a chat template: the result's own text says what failed
            text = content if isinstance(content, str) else _texts(content, f"{where}.content")
            out.append({"role": "tool", "tool_call_id": use_id, "content": text})
        else:
            raise APIError(f"a user message cannot hold '{kind}' blocks (text and tool_result "
                           "only)", param=f"{where}.type", code="invalid_value")
    return out


def _assistant_message(blocks: list, last: bool) -> dict:
    """An assistant turn as one message: its text, its tool_use blocks as tool calls, its
    thinking as reasoning_content (redacted thinking has no text to show)."""
    texts, thoughts, calls = [], [], []
    for where, block in blocks:
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            pass
        elif kind == "tool_use":
            calls.append(_tool_call(block, where))
        else:
            raise APIError(f"an assistant message cannot hold '{kind}' blocks (text, thinking "
                           "and tool_use only)", param=f"{where}.type", code="invalid_value")
    if last and calls:
        raise APIError("the last message is an assistant turn with tool_use blocks: answer "
                       "them with tool_result blocks in a user message", param="messages",
                       code="invalid_value")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _tool_call(block: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise APIError(f"a tool_use block needs an '{key}' string", param=f"{where}.{key}",
                           code="invalid_value")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise APIError("a tool_use block's input must be an object", param=f"{where}.input",
                       code="invalid_value")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(args,
                                                                        ensure_ascii=False)}}


# ---- tools, thinking, output format

def chat_tool(tool, i: int) -> dict:
    """An Anthropic client tool as a chat function tool; server tools (web search, bash, ...)
    are refused: this server runs none."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError("a tool must be an object", param=where, code="invalid_value")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise APIError(f"tools of type {kind!r} are server tools, which this server does not "
                       "run (client tools only: name, description, input_schema)",
                       param=f"{where}.type", code="unsupported_parameter")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError("a tool needs a name", param=f"{where}.name", code="invalid_value")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise APIError("a tool needs an input_schema object (a JSON Schema)",
                       param=f"{where}.input_schema", code="invalid_value")
    # OpenAI's order (templates print the tool as JSON)
    fn: dict[str, Any] = {"name": tool["name"]}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    fn["parameters"] = schema
    if tool.get("strict") is not None:
        if not isinstance(tool["strict"], bool):
            raise APIError("strict must be a boolean", param=f"{where}.strict",
                           code="invalid_value")
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: dict) -> tuple[object, bool]:
    """(chat's tool_choice, whether parallel calls are allowed)."""
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError("tool_choice of type 'tool' needs the tool's name",
                           param="tool_choice.name", code="invalid_value")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(f"tool_choice.type {kind!r}: use auto, any, tool or none",
                   param="tool_choice.type", code="invalid_value")


def thinking_type(thinking: dict | None) -> str | None:
    """"enabled", "disabled" or "adaptive" (between_tools reads as adaptive); 400 for an
    unknown type or an enabled one without a budget of at least 1024 tokens."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "between_tools":
        return "adaptive"
    if kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(f"thinking.type {kind!r}: use enabled, disabled or adaptive",
                       param="thinking.type", code="invalid_value")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) \
                or budget < MIN_THINKING_BUDGET:
            raise APIError(f"thinking.budget_tokens must be an integer of at least "
                           f"{MIN_THINKING_BUDGET}", param="thinking.budget_tokens",
                           code="invalid_value")
    return kind


def chat_response_format(fmt) -> dict:
    """output_config.format ({"type": "json_schema", "schema": ...}) as chat's
    response_format."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise APIError("output_config.format must be {\"type\": \"json_schema\", \"schema\": "
                       "{...}}", param="output_config.format", code="invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}

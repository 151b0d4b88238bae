"""Function tools in the Responses API, in the chat route's terms: the request's `tools` and
`tool_choice` become chat's (server/tool_calls.py checks them, the same parser reads the output,
the same grammar enforces required, named and strict calls), and `function_call` /
`function_call_output` input items become the assistant tool calls and `tool` messages that
chat templates render.

In the Responses API a function tool is `strict` unless it says otherwise (OpenAI's default),
so a call the model starts under tool_choice "auto" is held to its schema. `mcp` tools are
server/responses_mcp.py's: their tools join the function tools here, as strict ones.
"""
from __future__ import annotations

import uuid

from server.protocol import APIError, _template_tool_call
from server.responses_mcp import echoed as echoed_mcp
from server.responses_mcp import is_mcp_tool
from server.tool_calls import ChatTools, request_tool_choice, request_tools, tools_in_use


def response_tools(req, parser_class, mcp=None, first_turn: bool = True,
                   offer_mcp: bool = True) -> ChatTools:
    """The request's function tools (and the tools of its MCP servers, `mcp`, unless not
    `offer_mcp`) and tool_choice as chat's; 400 naming the field for another kind of tool, or
    when tools are asked for and the model has no parser. tool_choice binds the first model
    turn of a response; the turns after MCP calls choose freely ("auto")."""
    tools = [_chat_tool(t, i) for i, t in enumerate(req.tools or []) if not is_mcp_tool(t)]
    if mcp is not None and offer_mcp:
        tools += mcp.chat_tools()
    tools = request_tools(tools or None, None)
    choice = req.tool_choice if first_turn else ("auto" if tools else None)
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        if mcp is None:
            raise APIError("tool_choice of type 'mcp' needs an mcp tool", param="tool_choice",
                           code="invalid_value")
        choice = mcp.tool_choice(choice)
    else:
        choice = _chat_choice(choice)
    choice = request_tool_choice(choice, None, tools)
    return tools_in_use(tools, choice, parser_class, req.parallel_tool_calls)


def check_function_tools(req) -> None:
    """400 naming the field for a tool that is neither a function nor an mcp tool, or a
    malformed function tool (before anything is connected or rendered)."""
    request_tools([_chat_tool(t, i) for i, t in enumerate(req.tools or [])
                   if not is_mcp_tool(t)] or None, None)


def function_names(req) -> set[str]:
    return {t.get("name") for t in req.tools or []
            if isinstance(t, dict) and t.get("type") == "function"}


def echoed_tools(req) -> list[dict]:
    """The tools as the response object lists them (FunctionTool: strict and parameters
    always present; MCPTool without its secrets)."""
    return [echoed_mcp(t) if is_mcp_tool(t) else
            {"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True) is not False}
            for t in req.tools or []]


def _chat_tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError(f"tools of type {kind!r} are not supported: this server runs function "
                       "tools (the client executes them) and mcp tools", param=f"{where}.type",
                       code="unsupported_parameter")
    strict = tool.get("strict", True)
    if strict is not None and not isinstance(strict, bool):
        raise APIError("strict must be a boolean", param=f"{where}.strict", code="invalid_value")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": {**fn, "strict": strict is not False}}


def _chat_choice(choice):
    """tool_choice in chat's shape: the Responses API names a function as {"type":
    "function", "name": ...}."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise APIError(f"tool_choice {kind!r}: use none, auto, required, {{\"type\": "
                   "\"function\", \"name\": ...} or {\"type\": \"mcp\", \"server_label\": "
                   "..., \"name\": ...}", param="tool_choice", code="invalid_value")


# ---- input items

def call_message(item: dict, where: str) -> tuple[dict, dict]:
    """A function_call input item: (its tool call, for the assistant message that renders it;
    the item as stored). Arguments that are not JSON (a call cut by max_output_tokens, replayed
    by an agent with an error output) go to the template as they came."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise APIError(f"a function_call item needs a {key} string", param=f"{where}.{key}",
                           code="invalid_value")
    call = _template_tool_call({"id": item["call_id"], "type": "function", "function": {
        "name": item["name"], "arguments": item["arguments"]}}, where)
    stored = {"id": item.get("id") or _item_id("fc"), "type": "function_call",
              "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
              "status": "completed"}
    return call, stored


def output_message(item: dict, where: str) -> tuple[dict, dict]:
    """A function_call_output input item: (its `tool` message, the item as stored)."""
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise APIError("a function_call_output item needs the call_id it answers",
                       param=f"{where}.call_id", code="invalid_value")
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") != "input_text" \
                    or not isinstance(part.get("text"), str):
                raise APIError("this text-only model reads function outputs of input_text "
                               "parts", param=f"{where}.output[{j}]", code="invalid_value")
            texts.append(part["text"])
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise APIError("output must be a string or a list of input_text parts",
                       param=f"{where}.output", code="invalid_value")
    stored = {"id": item.get("id") or _item_id("fco"), "type": "function_call_output",
              "call_id": call_id, "output": output, "status": "completed"}
    return {"role": "tool", "tool_call_id": call_id, "content": output}, stored


def call_ids(turns: list[dict]) -> set[str]:
    """The ids of the tool calls in a conversation's assistant messages."""
    return {c["id"] for m in turns for c in m.get("tool_calls") or []}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"

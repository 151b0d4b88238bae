"""Tools in a chat request: the tool list and tool_choice checked, the deprecated `functions` /
`function_call` spellings read as tools, and the conversation's earlier calls checked against
the results that answer them. Every fault is a 400 naming the parameter."""
from __future__ import annotations

from dataclasses import dataclass

from server.protocol import APIError
from server.tool_parsers import tool_call_id


@dataclass(slots=True)
class ChatTools:
    """What a chat request's tools mean for rendering and for reading the output."""
    rendered: list[dict] | None       # the tools the chat template shows the model
    choice: object                    # "none" | "auto" | "required" | ("function", name)
    parser: object | None             # a ToolParser over the tools, when calls are read
    parallel: bool = True             # parallel_tool_calls: more than one call may be returned


def chat_tools(req, parser_class, mcp_tools: list[dict] | None = None) -> ChatTools:
    """The request's tools (the MCP servers' when it sends none and the model has a parser to
    read calls with; `tools: []` opts out), tool_choice and history checked; 400 when the
    request asks for tools and the model has no parser."""
    tools = request_tools(req.tools, req.functions)
    if tools is None and mcp_tools and parser_class is not None:
        tools = mcp_tools
    choice = request_tool_choice(req.tool_choice, req.function_call, tools)
    check_history(req.messages)
    return tools_in_use(tools, choice, parser_class, req.parallel_tool_calls)


def tools_in_use(tools: list[dict] | None, choice, parser_class, parallel) -> ChatTools:
    """Checked tools and tool_choice as what rendering and output reading use (nothing when
    there are no tools or the choice is "none"); 400 when tools are asked for and the model has
    no parser."""
    if not tools or choice == "none":
        return ChatTools(None, "none", None)
    if parser_class is None:
        raise APIError("this model has no tool-call parser (no known format for its "
                       "architecture or chat template); start the server with --enforce-parser "
                       "NAME", param="tools", code="unsupported_parameter")
    return ChatTools(tools, choice, parser_class(tools), parallel is not False)


def request_tools(tools: list | None, functions: list | None) -> list[dict] | None:
    """The request's tools in the `tools` shape; `functions` (deprecated) when no tools."""
    if tools is None and functions:
        tools = [{"type": "function", "function": f} for f in functions]
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise APIError("a tool needs type 'function' and a 'function' object", param=where,
                           code="invalid_value")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError("a function needs a name", param=f"{where}.function.name",
                           code="invalid_value")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError("function parameters must be a JSON Schema object",
                           param=f"{where}.function.parameters", code="invalid_value")
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(f"two tools are named {dup!r}", param="tools", code="invalid_value")
    return tools


def request_tool_choice(choice, function_call, tools: list[dict] | None):
    """"none", "auto", "required", or the name of the one function to call (a str in a
    tuple: ("function", name)). A named function that is not a tool is a 400."""
    if choice is None and function_call is not None:       # the deprecated spelling
        choice = function_call if isinstance(function_call, str) else \
            {"type": "function", "function": function_call}
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(f"tool_choice {choice!r}: use none, auto, required or a named "
                           "function", param="tool_choice", code="invalid_value")
        if choice == "required" and not tools:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice",
                           code="invalid_value")
        return choice
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise APIError("a named tool_choice is {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", param="tool_choice", code="invalid_value")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise APIError(f"tool_choice names {name!r}, which is not in tools",
                       param="tool_choice", code="invalid_value")
    return ("function", name)


def check_history(messages: list) -> None:
    """Each `tool` message answers the id of a call made before it. An earlier call's arguments
    need not be JSON: a call cut by max_tokens, which agents replay with an error result, goes
    to the template as it came (server/protocol.py's _template_tool_call)."""
    open_ids: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.tool_calls or []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                open_ids.add(call["id"])
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError("a tool message needs the tool_call_id it answers",
                               param=f"messages[{i}].tool_call_id", code="invalid_value")
            if m.tool_call_id not in open_ids:
                raise APIError(f"tool_call_id {m.tool_call_id!r} answers no earlier tool call",
                               param=f"messages[{i}].tool_call_id", code="invalid_value")


def template_call_ids(messages: list[dict], style: str) -> list[dict]:
    """The conversation with its tool-call ids in the model's style. Mistral's templates
    refuse any id but 9 alphanumerics, so another client's ids (OpenAI's `call_...`) are
    mapped to 9 derived from each; an id maps the same in the call and in its result."""
    if style != "mistral":
        return messages

    def fit(call_id):
        if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isascii()
                                            and call_id.isalnum()):
            return call_id
        return tool_call_id("mistral", call_id, 0)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": fit(c.get("id"))} if isinstance(c, dict) else c
                                     for c in m["tool_calls"]]}
        if "tool_call_id" in m:
            m = {**m, "tool_call_id": fit(m["tool_call_id"])}
        out.append(m)
    return out

"""Server-side MCP tools in the Responses API: `tools: [{"type": "mcp", "server_label", ...}]`.

A request's `mcp` tool names its server by `server_url`, which must be one of the URLs the
operator allowed at start-up (`--mcp-allowed-urls`; none by default), or, without a server_url,
by a `server_label` that names a server of `--mcp-config` (its connection is shared, held by
server/mcp_tools.py). Before the model runs, the server connects (a URL: for this response
only), lists the tools (`allowed_tools` filters them; a server that cannot be listed is a 424
naming the tool) and offers them to the model as strict function tools under their own names
(a name two tools share is a 400: leave one out with allowed_tools). The model's calls to them
run here (server/responses.py's loop), each an `mcp_call` output item with the tool's output
or error, and the model is run again on the results until it answers without calling one.

`require_approval` ("always" by default, as OpenAI's; "never"; or {"always": filter, "never":
filter}) turns a call into an `mcp_approval_request` item that ends the response; the next
request answers it with an `mcp_approval_response` input item (after the request item, or with
previous_response_id), and an approved call runs before the model does.

Everything the MCP client does is server/mcp_tools.py's (McpConnection); calls are read from
the model's text by the same tool parsers and grammars as function calls.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from server.mcp_tools import McpConnection, McpServerSpec, first_line, function_of
from server.protocol import APIError, _template_tool_call

# Each URL server is a connection opened for the response's life.
MAX_SERVERS = 8
CONNECT_TIMEOUT_S = 10.0
_APPROVALS = ("always", "never")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(message, param=param, code=code)


# ---- the request's `mcp` tools

@dataclass(frozen=True, slots=True)
class ToolFilter:
    """MCPToolFilter: tool names and/or the readOnlyHint annotation; matches when all given
    conditions hold."""
    names: frozenset[str] | None = None
    read_only: bool | None = None

    def matches(self, tool) -> bool:
        if self.names is not None and tool.name not in self.names:
            return False
        if self.read_only is not None:
            hint = getattr(tool.annotations, "read_only_hint", None) if tool.annotations else None
            return bool(hint) == self.read_only
        return True


@dataclass(slots=True)
class McpToolSpec:
    index: int                          # in the request's tools
    label: str
    url: str | None                     # None: the --mcp-config server named `label`
    headers: dict[str, str]
    allowed: ToolFilter | None          # None: every tool
    approval_default: bool              # approval needed for a tool no filter below matches
    always: ToolFilter | None = None
    never: ToolFilter | None = None

    def needs_approval(self, tool) -> bool:
        if self.always is not None and self.always.matches(tool):
            return True
        if self.never is not None and self.never.matches(tool):
            return False
        return self.approval_default


def is_mcp_tool(tool) -> bool:
    return isinstance(tool, dict) and tool.get("type") == "mcp"


def mcp_tool_specs(tools: list | None, allowed_urls: list[str], config) -> list[McpToolSpec]:
    """The request's `mcp` tools, checked: 400 naming the field for a malformed one, a
    server_url outside the allow-list, or a label that names no --mcp-config server."""
    specs: list[McpToolSpec] = []
    for i, tool in enumerate(tools or []):
        if is_mcp_tool(tool):
            specs.append(_spec(tool, f"tools[{i}]", i, allowed_urls, config))
    labels = [s.label for s in specs]
    for spec in specs:
        if labels.count(spec.label) > 1:
            raise _invalid(f"tools[{spec.index}].server_label",
                           f"two mcp tools have the server_label {spec.label!r}")
    if len(specs) > MAX_SERVERS:
        raise _invalid("tools", f"at most {MAX_SERVERS} mcp tools per request")
    return specs


def _spec(tool: dict, where: str, index: int, allowed_urls: list[str], config) -> McpToolSpec:
    for key in ("connector_id", "tunnel_id", "defer_loading", "allowed_callers"):
        if tool.get(key):
            raise _invalid(f"{where}.{key}", f"{key} is not supported by this server: name an "
                           "MCP server by server_url or by a --mcp-config server's name",
                           "unsupported_parameter")
    label = tool.get("server_label")
    if not isinstance(label, str) or not label:
        raise _invalid(f"{where}.server_label", "an mcp tool needs a server_label string")
    url = tool.get("server_url")
    headers = tool.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in headers.items()):
        raise _invalid(f"{where}.headers", "headers must be an object of strings")
    auth = tool.get("authorization")
    if auth is not None:
        if not isinstance(auth, str):
            raise _invalid(f"{where}.authorization", "authorization must be a string")
        headers = {**headers, "Authorization": f"Bearer {auth}"}
    if url is not None:
        if not isinstance(url, str) or url.rstrip("/") not in {u.rstrip("/")
                                                              for u in allowed_urls}:
            raise _invalid(f"{where}.server_url",
                           f"server_url {url!r} is not one this server may connect to (the "
                           "operator allows URLs with --mcp-allowed-urls"
                           + (": none are allowed" if not allowed_urls else "") + ")",
                           "mcp_server_not_allowed")
    else:
        names = config.names() if config is not None else []
        if label not in names:
            raise _invalid(f"{where}.server_url",
                           f"an mcp tool needs a server_url, or a server_label naming a server "
                           f"of --mcp-config ({', '.join(names) or 'none configured'})")
        if headers:
            raise _invalid(f"{where}.headers", "headers and authorization are for server_url "
                           "servers: a --mcp-config server has its own")
    always = never = None
    approval = tool.get("require_approval")
    if approval is None or approval in _APPROVALS:
        default = approval != "never"
    elif isinstance(approval, dict) and set(approval) <= set(_APPROVALS):
        default = True
        always = _filter(approval.get("always"), f"{where}.require_approval.always")
        never = _filter(approval.get("never"), f"{where}.require_approval.never")
    else:
        raise _invalid(f"{where}.require_approval", "require_approval is 'always', 'never' or "
                       "{'always': filter, 'never': filter}")
    allowed = tool.get("allowed_tools")
    if isinstance(allowed, list):
        if not all(isinstance(n, str) for n in allowed):
            raise _invalid(f"{where}.allowed_tools", "allowed_tools lists tool names")
        allowed = ToolFilter(frozenset(allowed))
    else:
        allowed = _filter(allowed, f"{where}.allowed_tools")
    return McpToolSpec(index, label, url, headers, allowed, default, always, never)


def _filter(value, where: str) -> ToolFilter | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= {"tool_names", "read_only"}:
        raise _invalid(where, "a tool filter is {'tool_names': [...], 'read_only': bool}")
    names, read_only = value.get("tool_names"), value.get("read_only")
    if names is not None and (not isinstance(names, list)
                              or not all(isinstance(n, str) for n in names)):
        raise _invalid(f"{where}.tool_names", "tool_names is a list of strings")
    if read_only is not None and not isinstance(read_only, bool):
        raise _invalid(f"{where}.read_only", "read_only is a boolean")
    return ToolFilter(None if names is None else frozenset(names), read_only)


def echoed(tool: dict) -> dict:
    """An mcp tool as the response echoes it: without its headers and authorization (secrets
    have no place in a stored response)."""
    return {k: v for k, v in tool.items() if k not in ("headers", "authorization")}


# ---- one response's MCP servers

@dataclass(slots=True)
class _Server:
    spec: McpToolSpec
    connection: McpConnection
    owned: bool                         # opened for this response: closed at its end
    tools: list                         # mcp Tool objects, allowed_tools applied


class McpSession:
    """The MCP servers of one response: connected, their tools listed and offered, calls run."""

    def __init__(self, servers: list[_Server], call_timeout: float):
        self.servers = servers
        self.call_timeout = call_timeout
        self._routes: dict[str, tuple[_Server, object]] = {}
        for server in servers:
            for tool in server.tools:
                self._routes[tool.name] = (server, tool)

    @classmethod
    async def open(cls, specs: list[McpToolSpec], config, function_names: set[str],
                   call_timeout: float) -> McpSession:
        """Connect to and list every server; 424 naming the tool for one that cannot be
        listed, 400 for a tool name two tools share."""
        servers: list[_Server] = []
        try:
            for spec in specs:
                servers.append(await _connect(spec, config))
            _check_names(servers, function_names)
        except BaseException:
            await cls(servers, call_timeout).close()
            raise
        return cls(servers, call_timeout)

    async def close(self) -> None:
        for server in self.servers:
            if server.owned:
                await server.connection.close()

    def names(self) -> set[str]:
        return set(self._routes)

    def chat_tools(self) -> list[dict]:
        """The tools, as chat's strict function tools (their calls are held to the schema)."""
        return [{"type": "function", "function": {**function_of(tool), "strict": True}}
                for server in self.servers for tool in server.tools]

    def tool_choice(self, choice: dict):
        """tool_choice {"type": "mcp", "server_label", "name"} as chat's named function."""
        label, name = choice.get("server_label"), choice.get("name")
        route = self._routes.get(name) if isinstance(name, str) else None
        if route is None or route[0].spec.label != label:
            raise _invalid("tool_choice", f"tool_choice names no tool {name!r} of an mcp tool "
                           f"with server_label {label!r} (give both)")
        return {"type": "function", "function": {"name": name}}

    def label(self, name: str) -> str:
        return self._routes[name][0].spec.label

    def has_label(self, label: str) -> bool:
        return any(s.spec.label == label for s in self.servers)

    def needs_approval(self, name: str) -> bool:
        server, tool = self._routes[name]
        return server.spec.needs_approval(tool)

    def listing_items(self) -> list[dict]:
        """The mcp_list_tools output items, one per server."""
        return [{"id": _item_id("mcpl"), "type": "mcp_list_tools",
                 "server_label": s.spec.label, "error": None,
                 "tools": [{"name": t.name, "description": t.description,
                            "input_schema": t.input_schema or {"type": "object"},
                            "annotations": (t.annotations.model_dump(exclude_none=True)
                                            if t.annotations else None)}
                           for t in s.tools]} for s in self.servers]

    async def run(self, label: str, name: str, arguments: str) -> tuple[str | None, dict | None]:
        """Run a call: (its output, None) or (None, its error as MCPToolCallError)."""
        server = next((s for s in self.servers if s.spec.label == label), None)
        if server is None or name not in {t.name for t in server.tools}:
            return None, _protocol_error(-32602, f"no tool {name!r} on MCP server {label!r}")
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return None, _protocol_error(-32602, "the arguments are not a JSON object")
        from mcp import MCPError
        try:
            result = await server.connection.call(name, args, self.call_timeout)
        except MCPError as e:
            return None, _protocol_error(e.code, e.message)
        except (TimeoutError, ConnectionError, OSError) as e:
            return None, _protocol_error(-32000, first_line(e) or type(e).__name__)
        text = result_text(result)
        if result.is_error:
            return None, {"type": "mcp_tool_execution_error",
                          "content": [{"type": "text", "text": text}]}
        return text, None


async def _connect(spec: McpToolSpec, config) -> _Server:
    where = f"tools[{spec.index}]"
    owned = spec.url is not None
    if owned:
        connection = McpConnection(McpServerSpec(spec.label, url=spec.url,
                                                 headers=spec.headers))
    else:
        connection = config.connection(spec.label)
    try:
        if connection is None:
            raise ConnectionError("it is not connected (see the server log)")
        if owned:
            await connection.open(CONNECT_TIMEOUT_S)
        tools = await connection.list_tools()
    except Exception as e:   # noqa: BLE001 - any failure to list is the request's 424
        if owned:
            await connection.close()
        raise APIError(f"Error retrieving tool list from MCP server {spec.label!r}: "
                       f"{first_line(e) or type(e).__name__}", status=424, param=where,
                       type="external_connector_error", code="mcp_list_tools_failed") from None
    if spec.allowed is not None:
        tools = [t for t in tools if spec.allowed.matches(t)]
    return _Server(spec, connection, owned, tools)


def _check_names(servers: list[_Server], function_names: set[str]) -> None:
    seen: dict[str, str] = {name: "a function tool" for name in function_names}
    for server in servers:
        for tool in server.tools:
            other = seen.get(tool.name)
            if other is not None:
                raise _invalid(f"tools[{server.spec.index}].allowed_tools",
                               f"MCP server {server.spec.label!r} has a tool named "
                               f"{tool.name!r}, as {other} has: leave one out with "
                               "allowed_tools")
            seen[tool.name] = f"MCP server {server.spec.label!r}"


def _protocol_error(code: int, message: str) -> dict:
    return {"type": "mcp_protocol_error", "code": code, "message": message}


def result_text(result) -> str:
    """A CallToolResult's content as the text the model reads (a text-only model: other
    content is named, not shown)."""
    texts = []
    for block in result.content or []:
        if getattr(block, "type", None) == "text":
            texts.append(block.text)
        else:
            texts.append(f"[{getattr(block, 'type', 'unknown')} content, not shown]")
    if not texts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(texts)


def model_text(output: str | None, error: dict | None) -> str:
    """What the model reads as a call's result."""
    if error is None:
        return output or ""
    if error["type"] == "mcp_tool_execution_error":
        return "Error: " + "\n".join(c.get("text", "") for c in error["content"]
                                     if isinstance(c, dict))
    return f"Error: {error.get('message', '')}"


# ---- output items and their stream events

class McpCall:
    """An mcp_call output item: opened (its arguments streamed) before it runs, closed with its
    output or error."""

    def __init__(self, builder, label: str, name: str, arguments: str,
                 approval_request_id: str | None = None, item_id: str | None = None):
        self.builder, self.label, self.name, self.arguments = builder, label, name, arguments
        self.approval_request_id = approval_request_id
        self.id = item_id or _item_id("mcp")
        self.output_index = 0

    def item(self, status: str, output=None, error=None) -> dict:
        return {"id": self.id, "type": "mcp_call", "server_label": self.label,
                "name": self.name, "arguments": self.arguments if status != "in_progress"
                else "", "output": output, "error": error, "status": status,
                "approval_request_id": self.approval_request_id}

    def _at(self) -> dict:
        return {"item_id": self.id, "output_index": self.output_index}

    def open(self) -> list[dict]:
        b = self.builder
        self.output_index = len(b.response["output"])
        events = [b.event("response.output_item.added", output_index=self.output_index,
                          item=self.item("in_progress")),
                  b.event("response.mcp_call.in_progress", **self._at())]
        if self.arguments:
            events.append(b.event("response.mcp_call_arguments.delta", **self._at(),
                                  delta=self.arguments))
        return events + [b.event("response.mcp_call_arguments.done", **self._at(),
                                 arguments=self.arguments)]

    def close(self, output: str | None, error: dict | None,
              status: str | None = None) -> list[dict]:
        """The item ended: completed with `output`, failed with `error`, or `status`
        (incomplete: the model's call was cut and never ran)."""
        b = self.builder
        status = status or ("failed" if error is not None else "completed")
        done = self.item(status, output, error)
        b.response["output"].append(done)
        events = []
        if status in ("completed", "failed"):
            events.append(b.event(f"response.mcp_call.{status}", **self._at()))
        return events + [b.event("response.output_item.done", output_index=self.output_index,
                                 item=done)]


def whole_item_events(builder, item: dict) -> list[dict]:
    """The events of an mcp_list_tools or mcp_approval_request item made whole: added (a list
    with its tools still to come), in progress and completed (a list), done."""
    b = builder
    index = len(b.response["output"])
    b.response["output"].append(item)
    if item["type"] != "mcp_list_tools":
        return [b.event("response.output_item.added", output_index=index, item=item),
                b.event("response.output_item.done", output_index=index, item=item)]
    at = {"item_id": item["id"], "output_index": index}
    return [b.event("response.output_item.added", output_index=index,
                    item={**item, "tools": []}),
            b.event("response.mcp_list_tools.in_progress", **at),
            b.event("response.mcp_list_tools.completed", **at),
            b.event("response.output_item.done", output_index=index, item=item)]


def approval_request(label: str, name: str, arguments: str) -> dict:
    return {"id": _item_id("mcpr"), "type": "mcp_approval_request", "server_label": label,
            "name": name, "arguments": arguments}


# ---- MCP input items

@dataclass(slots=True)
class Approval:
    """An mcp_approval_response of the input: the request it answers, and the `tool` message
    (in the conversation where the response came) that the call's result or refusal fills."""
    request: dict
    approve: bool
    reason: str | None
    message: dict


class McpInput:
    """The MCP items of a request's input, as the conversation's turns: an mcp_call is an
    assistant tool call and its result; an mcp_approval_request a call waiting for its answer;
    an mcp_approval_response answers one (from this input, or from the previous response's
    output), to be run before the model is; an mcp_list_tools item has no turn."""
    KINDS = ("mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response")

    def __init__(self, earlier_output: list[dict] = ()):
        self.requests = {item["id"]: item for item in earlier_output
                         if item.get("type") == "mcp_approval_request"}
        self.approvals: list[Approval] = []

    def read(self, item: dict, where: str, messages: list[dict], assistant_turn) -> dict:
        """Add the item's turns to `messages`; the item as stored."""
        kind = item["type"]
        if kind == "mcp_list_tools":
            _strings(item, where, "server_label")
            return {"id": item.get("id") or _item_id("mcpl"), "type": kind,
                    "server_label": item["server_label"], "tools": item.get("tools") or [],
                    "error": item.get("error")}
        if kind == "mcp_approval_response":
            return self._answer(item, where, messages)
        _strings(item, where, "id", "server_label", "name", "arguments")
        stored = {k: item[k] for k in ("id", "server_label", "name", "arguments")}
        call = _template_tool_call({"id": item["id"], "type": "function", "function": {
            "name": item["name"], "arguments": item["arguments"]}}, where)
        assistant_turn().setdefault("tool_calls", []).append(call)
        if kind == "mcp_approval_request":
            self.requests[item["id"]] = {"type": kind, **stored}
            return {"type": kind, **stored}
        output, error = item.get("output"), item.get("error")
        messages.append({"role": "tool", "tool_call_id": item["id"],
                         "content": model_text(output if isinstance(output, str) else None,
                                               error if isinstance(error, dict) else None)})
        return {"type": kind, **stored, "output": output, "error": error,
                "status": item.get("status") or "completed",
                "approval_request_id": item.get("approval_request_id")}

    def _answer(self, item: dict, where: str, messages: list[dict]) -> dict:
        request_id, approve = item.get("approval_request_id"), item.get("approve")
        if not isinstance(approve, bool):
            raise _invalid(f"{where}.approve", "approve must be a boolean")
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise _invalid(f"{where}.approval_request_id",
                           f"approval_request_id {request_id!r} answers no mcp_approval_request "
                           "of this input or of the previous response")
        if any(a.request["id"] == request_id for a in self.approvals):
            raise _invalid(f"{where}.approval_request_id",
                           f"the approval request {request_id!r} is answered twice")
        reason = item.get("reason")
        message = {"role": "tool", "tool_call_id": request_id, "content": ""}
        messages.append(message)
        self.approvals.append(Approval(request, approve, reason if isinstance(reason, str)
                                       else None, message))
        return {"id": item.get("id") or _item_id("mcpa"), "type": "mcp_approval_response",
                "approval_request_id": request_id, "approve": approve,
                "reason": reason if isinstance(reason, str) else None}


def _strings(item: dict, where: str, *keys: str) -> None:
    for key in keys:
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise _invalid(f"{where}.{key}", f"an {item['type']} item needs a {key} string")


def declined(reason: str | None) -> str:
    """What the model reads for a call the user did not approve."""
    return "The user declined to run this tool call." + (f" Reason: {reason}" if reason else "")

"""MCP tools: the tools of the MCP servers named in `--mcp-config`, offered to chat requests, and
the MCP connections the Responses API's `mcp` tools run their calls over
(server/responses_mcp.py: a --mcp-config server's held connection, or one to an allowed URL
opened for one response).

The config is the common `mcp.json` shape:
    {"mcpServers": {"files": {"command": "npx", "args": [...], "env": {...}},
                    "search": {"url": "https://host/mcp", "headers": {"Authorization": "..."}}}}
A server with `command` is started as a subprocess and spoken to over stdio; one with `url` over
streamable HTTP. Both go through the official `mcp` SDK's `Client`.

Each connection (McpConnection) is held by a task of its own, since anyio's context managers
must be entered and left in one task; any task lists and calls through it. Each configured server
gets one for the server's lifetime, and its tools are listed again every `refresh_s` seconds.
Start-up waits at most `connect_timeout_s` for the first listings; a server that fails to start,
or has not answered by then, is logged and left out (a late one joins when it answers). A tool
name that two servers share is offered as `server__tool` for each of them, so no server's tool
hides another's; `route(name)` maps an offered name back to (server, tool).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

log = logging.getLogger("taper.server")


@dataclass(frozen=True, slots=True)
class McpServerSpec:
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict | None = None
    url: str | None = None
    headers: dict | None = None


def load_mcp_config(path: str) -> list[McpServerSpec]:
    """The servers of an mcp.json file; ValueError naming the file and the fault otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"--mcp-config {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"--mcp-config {path}: not valid JSON ({e})") from None
    servers = config.get("mcpServers") if isinstance(config, dict) else None
    if not isinstance(servers, dict):
        raise ValueError(f"--mcp-config {path}: expected an object with \"mcpServers\"")
    specs = []
    for name, s in servers.items():
        where = f"--mcp-config {path}: server {name!r}"
        if not isinstance(s, dict) or ("command" in s) == ("url" in s):
            raise ValueError(f"{where} needs either \"command\" (stdio) or \"url\" (HTTP)")
        if "command" in s:
            args, env = s.get("args", []), s.get("env")
            if not isinstance(s["command"], str) or not isinstance(args, list) or \
                    not all(isinstance(a, str) for a in args) or \
                    not (env is None or isinstance(env, dict)):
                raise ValueError(f"{where}: \"command\" is a string, \"args\" a list of strings, "
                                 f"\"env\" an object")
            specs.append(McpServerSpec(name, command=s["command"], args=tuple(args),
                                       env={str(k): str(v) for k, v in (env or {}).items()} or None))
        else:
            headers = s.get("headers")
            if not isinstance(s["url"], str) or not (headers is None or isinstance(headers, dict)):
                raise ValueError(f"{where}: \"url\" is a string, \"headers\" an object")
            specs.append(McpServerSpec(name, url=s["url"],
                                       headers={str(k): str(v) for k, v in (headers or {}).items()}))
    return specs


class McpConnection:
    """One MCP server's connection. A task of its own holds it (anyio's context managers must be
    entered and left in one task); any task may list and call through it while it is open."""

    def __init__(self, spec: McpServerSpec):
        self.spec = spec
        self.client = None                 # the mcp SDK's Client, while connected
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None

    async def open(self, timeout: float | None = None) -> None:
        """Connect; raises the connection's error, or TimeoutError after `timeout` seconds."""
        self._task = asyncio.create_task(self._hold(), name=f"mcp-{self.spec.name}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait({self._task, ready}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self.client is None:
            await self.close()
            raise self._error or TimeoutError(f"no answer within {timeout:g} s")

    async def list_tools(self) -> list:
        """The server's tools (mcp Tool objects), every page."""
        client = self._connected()
        tools, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                return tools

    async def call(self, name: str, arguments: dict, timeout: float):
        """The tool's CallToolResult; MCPError (from the server), TimeoutError, or
        ConnectionError (the connection is gone) otherwise."""
        client = self._connected()
        return await asyncio.wait_for(client.call_tool(name, arguments,
                                                       read_timeout_seconds=timeout),
                                      timeout + 1)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None

    def _connected(self):
        if self.client is None:
            raise ConnectionError(f"the connection to MCP server {self.spec.name!r} is closed"
                                  + (f" ({first_line(self._error)})" if self._error else ""))
        return self.client

    async def _hold(self) -> None:
        try:
            from mcp import Client
            async with Client(_target(self.spec), cache=None) as client:
                self.client = client
                self._ready.set()
                await self._stop.wait()
        except Exception as e:   # noqa: BLE001 - kept for open() and later calls to report
            self._error = e
        finally:
            self.client = None


@dataclass
class McpTools:
    specs: list[McpServerSpec]
    refresh_s: float = 300.0
    connect_timeout_s: float = 10.0
    listings: dict[str, list] = field(default_factory=dict)   # server -> its mcp Tool objects
    _tools: list[dict] = field(default_factory=list)          # OpenAI tools, offered names
    _routes: dict[str, tuple[str, str]] = field(default_factory=dict)
    _connections: dict[str, McpConnection] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _stop: asyncio.Event | None = None

    async def start(self) -> None:
        """Connect to every server and wait (at most connect_timeout_s) for their first lists."""
        self._stop = asyncio.Event()
        first: list[asyncio.Event] = []
        for spec in self.specs:
            listed = asyncio.Event()
            first.append(listed)
            self._tasks.append(asyncio.create_task(self._serve(spec, listed),
                                                   name=f"mcp-{spec.name}-listing"))
        if first:
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)),
                                       self.connect_timeout_s)
            except asyncio.TimeoutError:
                late = [s.name for s, e in zip(self.specs, first) if not e.is_set()]
                log.warning("MCP servers %s did not list their tools within %g s; serving "
                            "without them until they do", late, self.connect_timeout_s)
        log.info("MCP tools: %d from %d servers: %s", len(self._tools), len(self.listings),
                 ", ".join(t["function"]["name"] for t in self._tools) or "none")

    async def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
        self._tasks.clear()

    def tools(self) -> list[dict]:
        """The tools in OpenAI's chat `tools` format, under their offered names."""
        return list(self._tools)

    def route(self, name: str) -> tuple[str, str] | None:
        return self._routes.get(name)

    def names(self) -> list[str]:
        """The servers of the config."""
        return [spec.name for spec in self.specs]

    def connection(self, server: str) -> McpConnection | None:
        """The open connection to a server of the config (None while it is not connected)."""
        return self._connections.get(server)

    # ---- one server

    async def _serve(self, spec: McpServerSpec, listed: asyncio.Event) -> None:
        conn = McpConnection(spec)
        try:
            await conn.open()
            self._connections[spec.name] = conn
            while True:
                self.listings[spec.name] = await conn.list_tools()
                self._rebuild()
                listed.set()
                try:
                    await asyncio.wait_for(self._stop.wait(), self.refresh_s)
                    return
                except asyncio.TimeoutError:
                    continue
        except Exception as e:   # noqa: BLE001 - one failing server must not stop the others
            log.warning("MCP server %r is skipped: %s: %s", spec.name, type(e).__name__,
                        first_line(e))
        finally:
            listed.set()
            self._connections.pop(spec.name, None)
            await conn.close()
            if self.listings.pop(spec.name, None) is not None:
                self._rebuild()

    def _rebuild(self) -> None:
        owners: dict[str, list[str]] = {}
        for server, tools in self.listings.items():
            for tool in tools:
                owners.setdefault(tool.name, []).append(server)
        offered, routes = [], {}
        for server in sorted(self.listings):
            for tool in self.listings[server]:
                name = tool.name if len(owners[tool.name]) == 1 else f"{server}__{tool.name}"
                routes[name] = (server, tool.name)
                offered.append({"type": "function", "function": function_of(tool, name)})
        self._tools, self._routes = offered, routes


def _target(spec: McpServerSpec):
    if spec.command is not None:
        from mcp.client.stdio import StdioServerParameters
        return StdioServerParameters(command=spec.command, args=list(spec.args), env=spec.env)
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client
    return streamable_http_client(spec.url, http_client=create_mcp_http_client(headers=spec.headers))


def first_line(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup) and e.exceptions:
        return first_line(e.exceptions[0])
    return (str(e) or repr(e)).splitlines()[0]


def function_of(tool, name: str | None = None) -> dict:
    """An mcp Tool as the `function` of an OpenAI tool, named `name` (its own by default)."""
    return {"name": name or tool.name, "description": tool.description or "",
            "parameters": tool.input_schema or {"type": "object", "properties": {}}}

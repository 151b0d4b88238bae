"""MCP tools against real MCP servers written here with the official SDK: one over stdio, one
over streamable HTTP (with a required header), one that fails to start; name clashes, refresh,
and config errors."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("mcp", reason="could not import the mcp SDK (requirements-test.txt pins it)")

from server.mcp_tools import McpServerSpec, McpTools, load_mcp_config  # noqa: E402
from server_fakes import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SERVER = textwrap.dedent('''
    import os, sys
    from mcp.server.mcpserver import MCPServer

    mcp = MCPServer("{name}")

    @mcp.tool()
    def search(query: str, limit: int = 5) -> str:
        """Search the {name} index."""
        return query

    if os.environ.get("EXTRA_TOOL"):
        @mcp.tool(name=os.environ["EXTRA_TOOL"])
        def extra() -> str:
            """Added by the environment."""
            return "x"

    {run}
''')


def write_server(tmp_path, name: str, run: str) -> str:
    path = tmp_path / f"{name}_server.py"
    path.write_text(SERVER.format(name=name, run=run))
    return str(path)


@pytest.fixture
def http_server(tmp_path):
    """A streamable-HTTP MCP server that only answers requests carrying X-Key: secret."""
    port = free_port()
    script = write_server(tmp_path, "web", textwrap.dedent(f'''
        import uvicorn
        from starlette.responses import PlainTextResponse
        app = mcp.streamable_http_app()
        async def guarded(scope, receive, send):
            if scope["type"] == "http" and dict(scope["headers"]).get(b"x-key") != b"secret":
                await PlainTextResponse("no key", status_code=401)(scope, receive, send)
                return
            await app(scope, receive, send)
        uvicorn.run(guarded, host="127.0.0.1", port={port}, log_level="warning")
    '''))
    proc = subprocess.Popen([sys.executable, script])
    deadline = time.time() + 30
    import socket
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def run(coro):
    return asyncio.run(coro)


def test_stdio_and_http_servers_their_tools_and_a_failing_one(tmp_path, http_server, caplog):
    stdio = write_server(tmp_path, "files", "mcp.run()")
    specs = [McpServerSpec("files", command=sys.executable, args=(stdio,),
                           env={"EXTRA_TOOL": "read_file"}),
             McpServerSpec("web", url=http_server, headers={"X-Key": "secret"}),
             McpServerSpec("broken", command=sys.executable, args=("-c", "raise SystemExit(3)"))]

    async def go():
        tools = McpTools(specs, connect_timeout_s=30)
        await tools.start()
        try:
            return tools.tools(), tools.route("files__search"), tools.route("read_file")
        finally:
            await tools.close()
    offered, search_route, read_route = run(go())
    by_name = {t["function"]["name"]: t["function"] for t in offered}
    # Both servers have "search": each is offered under its server's name; read_file is unique.
    assert sorted(by_name) == ["files__search", "read_file", "web__search"]
    assert search_route == ("files", "search") and read_route == ("files", "read_file")
    assert by_name["web__search"]["description"] == "Search the web index."
    params = by_name["files__search"]["parameters"]
    assert params["properties"]["query"]["type"] == "string" and params["required"] == ["query"]
    assert any("'broken' is skipped" in r.getMessage() for r in caplog.records)


def test_a_wrong_header_is_a_skipped_server(http_server, caplog):
    async def go():
        tools = McpTools([McpServerSpec("web", url=http_server, headers={"X-Key": "wrong"})],
                         connect_timeout_s=30)
        await tools.start()
        await tools.close()
        return tools.tools()
    assert run(go()) == []
    assert any("'web' is skipped" in r.getMessage() for r in caplog.records)


def test_tools_are_listed_again_on_the_refresh_interval(tmp_path):
    """The server's tools come from a file it reads on each listing: a change shows up after
    one refresh interval without reconnecting."""
    names = tmp_path / "names.txt"
    names.write_text("alpha")
    script = tmp_path / "dynamic.py"
    script.write_text(textwrap.dedent(f'''
        from mcp.server.lowlevel import Server
        import mcp_types as types
        from mcp.server.stdio import stdio_server
        import anyio

        async def list_tools(ctx, params):
            names = open({str(names)!r}).read().split()
            return types.ListToolsResult(tools=[
                types.Tool(name=n, description=n, input_schema={{"type": "object"}})
                for n in names])

        server = Server("dynamic", on_list_tools=list_tools)

        async def main():
            async with stdio_server() as (r, w):
                await server.run(r, w, server.create_initialization_options())
        anyio.run(main)
    '''))

    async def go():
        tools = McpTools([McpServerSpec("dyn", command=sys.executable, args=(str(script),))],
                         refresh_s=0.5, connect_timeout_s=30)
        await tools.start()
        before = [t["function"]["name"] for t in tools.tools()]
        names.write_text("alpha beta")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(tools.tools()) < 2:
            await asyncio.sleep(0.2)
        after = [t["function"]["name"] for t in tools.tools()]
        await tools.close()
        return before, after
    before, after = run(go())
    assert before == ["alpha"] and after == ["alpha", "beta"]


@pytest.mark.parametrize("config, message", [
    ("not json", "not valid JSON"),
    ('{"servers": {}}', 'expected an object with "mcpServers"'),
    ('{"mcpServers": {"a": {}}}', "server 'a' needs either \"command\" (stdio) or \"url\""),
    ('{"mcpServers": {"a": {"command": "x", "url": "y"}}}', "needs either"),
    ('{"mcpServers": {"a": {"command": "x", "args": "y"}}}', "a list of strings"),
    ('{"mcpServers": {"a": {"url": 5}}}', '"url" is a string'),
])
def test_config_errors_name_the_problem(tmp_path, config, message):
    path = tmp_path / "mcp.json"
    path.write_text(config)
    with pytest.raises(ValueError, match=re_escape(message)):
        load_mcp_config(str(path))


def test_config_reads_both_kinds(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "a": {"command": "node", "args": ["x.js"], "env": {"K": 1}},
        "b": {"url": "http://h/mcp", "headers": {"Authorization": "Bearer t"}}}}))
    assert load_mcp_config(str(path)) == [
        McpServerSpec("a", command="node", args=("x.js",), env={"K": "1"}),
        McpServerSpec("b", url="http://h/mcp", headers={"Authorization": "Bearer t"})]
    with pytest.raises(ValueError, match="cannot read it"):
        load_mcp_config(str(tmp_path / "missing.json"))


def re_escape(s: str) -> str:
    import re
    return re.escape(s)

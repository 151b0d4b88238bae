"""The web UI's routes over real HTTP (no browser): the page is public while the API keeps its key,
every file index.html and the scripts name is served with its type, the page is confined by a
Content-Security-Policy, and nothing outside server/static/ can be fetched through /ui."""
from __future__ import annotations

import re

import pytest

from server.app import ServerSettings, create_app
from server.ui import STATIC_DIR as STATIC
from server_fakes import FakeEngine, ThreadedServer, http_response


@pytest.fixture(scope="module")
def server():
    s = ThreadedServer(create_app(FakeEngine(), ServerSettings(["fake-model"], api_key="k")))
    yield s
    s.close()


def test_the_page_is_public_and_the_api_is_not(server):
    status, headers, body = http_response(server.port, "GET", "/ui/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'<script type="module" src="app.js">' in body
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "unsafe-inline" not in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert http_response(server.port, "GET", "/v1/models")[0] == 401
    for path in ("/", "/ui"):
        status, headers, _ = http_response(server.port, "GET", path)
        assert (status, headers["location"]) == (302, "/ui/")


def test_every_file_the_page_loads_is_served(server):
    with open(f"{STATIC}/index.html") as f:
        html = f.read()
    names = set(re.findall(r'(?:src|href)="([\w.-]+\.(?:js|css))"', html))
    for name in ("app.js", "markdown.js", "stream.js"):
        with open(f"{STATIC}/{name}") as f:
            names |= set(re.findall(r'from "\./([\w.-]+\.js)"', f.read()))
    assert names == {"app.js", "markdown.js", "stream.js", "style.css"}
    for name in names:
        status, headers, _ = http_response(server.port, "GET", f"/ui/{name}")
        want = "text/css" if name.endswith(".css") else "text/javascript"
        assert status == 200 and headers["content-type"].startswith(want), name


@pytest.mark.parametrize("path", ["/ui/../app.py", "/ui/%2e%2e/app.py", "/ui/nope.js",
                                  "/ui/..%2fapp.py"])
def test_nothing_outside_static_is_served(server, path):
    status, _, body = http_response(server.port, "GET", path)
    assert status == 404, body
    assert b"create_app" not in body

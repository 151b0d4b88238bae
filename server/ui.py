"""The web chat UI: static files (server/static/) served at /ui on the API's own port.

Same origin as the API, so the browser needs no CORS and the API key works as for any client.
The page itself is public (it holds no secrets and must load before the user has typed a key);
every API call it makes is checked as usual. A strict Content-Security-Policy is the second line
of defence behind the UI's own rule that model text only ever becomes DOM text, never markup.
"""
from __future__ import annotations

from pathlib import Path

from quart import Quart, redirect, send_from_directory

STATIC_DIR = Path(__file__).with_name("static")
UI_PREFIX = "/ui"

# Scripts, styles and fetches from this origin only: no inline script, no eval, no CDN.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_ui_path(path: str) -> bool:
    return path == "/" or path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


def register_ui(app: Quart) -> None:
    @app.get("/")
    async def ui_root():
        return redirect(UI_PREFIX + "/")

    @app.get(UI_PREFIX)
    async def ui_no_slash():
        return redirect(UI_PREFIX + "/")

    @app.get(UI_PREFIX + "/")
    async def ui_index():
        return await _static("index.html")

    @app.get(UI_PREFIX + "/<path:name>")
    async def ui_file(name: str):
        return await _static(name)


async def _static(name: str):
    # send_from_directory refuses paths that climb out of the folder (404)
    resp = await send_from_directory(STATIC_DIR, name)
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Cache-Control"] = "no-cache"      # a new version shows on reload
    return resp

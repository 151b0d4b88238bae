"""The web chat UI (server/static/ at /ui) in a real browser: Debian's Chromium, driven by
Playwright through `executable_path` (no browser download).

Against a live `python -m server` on the demo checkpoint: a message streams in over several DOM
updates and equals what the official `openai` client gets for the same request; stop ends the
answer and the server counts an abort; without the API key the page says so. Against the real
app with a scripted engine (the only way to make a model say exactly `<script>`): model markup
stays text, reasoning shows apart and folds, and loading, draining and engine errors are
explained. Screenshots land in $TAPER_TEST_ARTIFACTS (else the test's tmp_path); the path is
printed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from server_fakes import FakeEngine, LiveServer, ThreadedServer, client_for, http_response

# Pinned in requirements-test.txt: where it is missing, CI must fail (tests/ci_skips.py).
sync_api = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.timeout(300)

KEY = "sk-ui-test"


def chromium_path() -> str | None:
    for name in (os.environ.get("TAPER_CHROMIUM"), "chromium", "chromium-browser",
                 "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None and os.environ.get("TAPER_CI"):
        pytest.fail("no Chromium binary: .ci/run installs Debian's chromium; it must be found")
    if path is None:
        pytest.skip("no Chromium binary on this machine (Debian: apt-get install -y chromium; "
                    "or point TAPER_CHROMIUM at one)")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI and containers run as root, where Chromium's sandbox cannot start
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def screenshot(tmp_path, capsys):
    folder = Path(os.environ.get("TAPER_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)

    def take(pg, name: str) -> Path:
        path = folder / f"web-ui-{name}.png"
        pg.screenshot(path=str(path))
        with capsys.disabled():
            print(f"\nscreenshot: {path}")
        return path
    return take


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


def assistant_bodies(pg):
    return pg.locator("#messages .msg.assistant .body")


def wait_idle(pg, timeout=120_000):
    """Until no answer is streaming (the Send button is back)."""
    pg.wait_for_selector("#send:not([hidden])", timeout=timeout)


def stored_conversations(pg) -> list:
    return json.loads(pg.evaluate("localStorage.getItem('taper.conversations')") or "[]")


def count_text_updates(pg):
    """Record every distinct text the newest assistant message shows, as the browser renders
    it (a MutationObserver on the message list)."""
    pg.evaluate("""() => {
        window.__texts = [];
        new MutationObserver(() => {
            const bodies = document.querySelectorAll('#messages .msg.assistant .body');
            const text = bodies.length ? bodies[bodies.length - 1].textContent : '';
            if (text && text !== window.__texts.at(-1)) window.__texts.push(text);
        }).observe(document.getElementById('messages'),
                   {childList: true, subtree: true, characterData: true});
    }""")


def metric(port: int, name: str) -> float:
    _, _, body = http_response(port, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body.decode(), re.MULTILINE)
    return float(m.group(1)) if m else 0.0


# ---- a live server on the demo checkpoint

@pytest.fixture(scope="module")
def live(demo_dir, tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("ui-live"), demo_dir, "--mem", "64",
                        "--served-model-name", "demo", "--api-key", KEY, "--ui-server")
    yield server
    server.close()


def test_live_key_stream_stop_and_history(live, page, screenshot):
    base = f"http://127.0.0.1:{live.port}"
    assert http_response(live.port, "GET", "/v1/models")[0] == 401    # the server wants the key
    assert "web chat UI: http://127.0.0.1:%d/ui/" % live.port in live.log()
    page.goto(base + "/")                                             # redirects to /ui/
    assert page.url == base + "/ui/"

    # 1. without the key: /v1/models and a message are refused, and the page says why
    notice = page.locator("#notice")
    sync_api.expect(notice).to_contain_text("needs an API key (401)")
    sync_api.expect(page.locator("#model-notice")).to_be_hidden()   # no model list, no notice
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    wait_idle(page)
    sync_api.expect(page.locator(".msg.assistant .badge.error")).to_contain_text("API key")
    sync_api.expect(notice).to_contain_text("Incorrect or missing API key")

    # 2. with the key and settings: the request carries them, tokens stream in
    page.fill("#api-key", KEY)
    page.press("#api-key", "Tab")                                     # "change" fires
    sync_api.expect(page.locator("#model")).to_have_value("demo")
    sync_api.expect(notice).to_be_hidden()
    # the demo checkpoint: the server says its weights are random, and the page shows it
    from server.__main__ import DEMO_NOTICE
    sync_api.expect(page.locator("#model-notice")).to_have_text(DEMO_NOTICE)
    assert "random weights" in DEMO_NOTICE
    page.click("#new-chat")
    page.fill("#system", "You are terse.")
    page.fill("#temperature", "0")
    page.fill("#top-p", "0.9")
    # enough tokens to span several animation frames however fast this machine decodes
    page.fill("#max-tokens", "200")
    sent = []
    page.on("request", lambda r: sent.append(r) if r.url.endswith("/v1/chat/completions") else None)
    count_text_updates(page)
    page.fill("#prompt", "Tell me about France")
    page.press("#prompt", "Enter")
    wait_idle(page)
    body = json.loads(sent[-1].post_data)
    assert sent[-1].headers["authorization"] == f"Bearer {KEY}"
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"],
            body["stream"]) == ("demo", 0, 0.9, 200, True)
    assert body["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Tell me about France"}]
    texts = page.evaluate("window.__texts")
    assert len(texts) >= 3, texts                                     # several DOM updates
    # the streamed answer is what the official SDK gets for the same request (greedy)
    reference = client_for(live.port).with_options(api_key=KEY).chat.completions.create(
        model="demo", messages=body["messages"], temperature=0, top_p=0.9, max_tokens=200)
    reply = stored_conversations(page)[0]["messages"][-1]
    assert reply["content"] == reference.choices[0].message.content
    assert reply["status"] == "done"
    sync_api.expect(page.locator(".msg.assistant .meta").last).to_contain_text("200 tokens")
    screenshot(page, "live-chat")

    # 3. stop: a long answer ends where it is, and the server aborts the request
    page.fill("#max-tokens", "3000")
    page.fill("#prompt", "Write a long story")
    page.press("#prompt", "Enter")
    sync_api.expect(page.locator("#stop")).to_be_visible()
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant .body')[1]"
                           ".textContent.length > 20", timeout=60_000)
    page.click("#stop")
    wait_idle(page, 10_000)
    stopped = assistant_bodies(page).last.text_content()
    sync_api.expect(page.locator(".msg.assistant .meta").last).to_contain_text("stopped")
    abort_line = 'taper:request_success_total{finished_reason="abort",model_name="demo"}'
    deadline = time.time() + 20
    while (metric(live.port, abort_line) < 1 or metric(live.port, "taper:num_requests_running")
           ) and time.time() < deadline:
        time.sleep(0.2)
    assert metric(live.port, abort_line) == 1, "the server did not see the abort"
    assert metric(live.port, "taper:num_requests_running") == 0
    time.sleep(0.5)
    assert assistant_bodies(page).last.text_content() == stopped       # nothing more arrived
    assert stored_conversations(page)[0]["messages"][-1]["status"] == "stopped"

    # 4. history survives a reload; conversations can be added and deleted
    page.reload()
    titles = page.locator("#conversations .conv-title")
    sync_api.expect(titles).to_have_count(2)
    sync_api.expect(titles.first).to_have_text("Tell me about France")
    sync_api.expect(assistant_bodies(page)).to_have_count(2)
    assert assistant_bodies(page).last.text_content() == stopped
    sync_api.expect(page.locator("#api-key")).to_have_value(KEY)        # the key is kept too
    page.click("#new-chat")                  # the conversation is made by its first message
    sync_api.expect(page.locator("#messages .empty")).to_be_visible()
    sync_api.expect(page.locator("#conversations li.active")).to_have_count(0)
    titles.first.click()
    sync_api.expect(page.locator("#chat-title")).to_have_text("Tell me about France")
    page.locator("#conversations li.active .conv-delete").click()
    sync_api.expect(titles).to_have_count(1)
    assert [c["title"] for c in stored_conversations(page)] == ["Hello"]


# ---- the real app with a scripted engine

class ScriptedEngine(FakeEngine):
    """Says exactly the words given: how a test makes a model emit markup."""

    def __init__(self, words, delay=0.02):
        super().__init__(max_model_len=4096, delay=delay)
        self.WORDS = words


HOSTILE = ["<think>", "Plan: <b>bold?</b> then answer", "</think>",
           "Here: <script>window.__pwned = 1</script>",
           ' <img src=x onerror="window.__pwned = 2">',
           "\n\n```html\n<script>alert(1)</script>\n```\n\n",
           "[click](javascript:window.__pwned=3) and **done**"]


@pytest.fixture
def scripted():
    engine = ScriptedEngine(HOSTILE)
    from server.app import ServerSettings, create_app
    server = ThreadedServer(create_app(engine, ServerSettings(["scripted"])))
    yield server, engine
    server.close()


def test_model_markup_stays_text_and_reasoning_folds(scripted, page, screenshot):
    server, _ = scripted
    page.goto(f"http://127.0.0.1:{server.port}/ui/")
    page.fill("#max-tokens", str(len(HOSTILE)))
    page.fill("#prompt", "Show me some HTML")
    page.press("#prompt", "Enter")
    wait_idle(page)
    sync_api.expect(page.locator("#model")).to_have_value("scripted")
    sync_api.expect(page.locator("#model-notice")).to_be_hidden()   # nothing said of this model
    messages = page.locator("#messages")
    answer = assistant_bodies(page).last
    # the markup is on screen as characters, and nothing of it became an element or ran
    sync_api.expect(answer).to_contain_text("Here: <script>window.__pwned = 1</script>")
    sync_api.expect(answer).to_contain_text('<img src=x onerror="window.__pwned = 2">')
    sync_api.expect(answer.locator(".code-block code")).to_have_text("<script>alert(1)</script>")
    for tag in ("script", "img", "b", "a", "iframe"):
        assert messages.locator(tag).count() == 0, tag
    assert page.evaluate("window.__pwned") is None
    assert answer.locator("strong").text_content() == "done"           # markdown still renders
    # the check can fail: the same text as HTML does make elements
    made = page.evaluate("""(html) => { const d = document.createElement('div');
        d.innerHTML = html; return d.querySelectorAll('script, img, b').length; }""",
                         "".join(HOSTILE))
    assert made >= 3
    # reasoning: apart from the answer, folded once the answer came, opens on a click
    reasoning = page.locator(".msg.assistant details.reasoning")
    sync_api.expect(reasoning).to_be_visible()
    assert reasoning.get_attribute("open") is None
    assert "Plan" not in answer.text_content() and "<think>" not in answer.text_content()
    page.click(".msg.assistant details.reasoning summary")
    sync_api.expect(reasoning.locator(".reasoning-body")).to_have_text(
        "Plan: <b>bold?</b> then answer")
    screenshot(page, "markup-and-reasoning")


MARKDOWN = ["# Title\n\n", "- one\n- two *it*\n", "\n| a | b |\n|---|--:|\n| 1 | 2 |\n",
            "\nSee [the docs](https://example.com/x) or https://example.org/y.\n",
            "\n> quoted `code`\n\n---\n"]


def test_markdown_renders_as_elements(page):
    engine = ScriptedEngine(MARKDOWN)
    from server.app import ServerSettings, create_app
    server = ThreadedServer(create_app(engine, ServerSettings(["scripted"])))
    try:
        page.goto(f"http://127.0.0.1:{server.port}/ui/")
        page.fill("#max-tokens", str(len(MARKDOWN)))
        page.fill("#prompt", "Format something")
        page.press("#prompt", "Enter")
        wait_idle(page)
        answer = assistant_bodies(page).last
        sync_api.expect(answer.locator("h1")).to_have_text("Title")
        sync_api.expect(answer.locator("ul > li")).to_have_text(["one", "two it"])
        sync_api.expect(answer.locator("li em")).to_have_text("it")
        sync_api.expect(answer.locator("th")).to_have_text(["a", "b"])
        sync_api.expect(answer.locator("td")).to_have_text(["1", "2"])
        assert answer.locator("td").nth(1).evaluate("td => td.style.textAlign") == "right"
        links = answer.locator("a")
        assert [links.nth(i).get_attribute("href") for i in range(links.count())] == [
            "https://example.com/x", "https://example.org/y"]
        assert links.first.get_attribute("rel") == "noopener noreferrer nofollow"
        sync_api.expect(answer.locator("blockquote code")).to_have_text("code")
        sync_api.expect(answer.locator("hr")).to_have_count(1)
    finally:
        server.close()


def test_reasoning_content_deltas_show_apart(scripted, page):
    """vLLM and SGLang send reasoning as `reasoning_content` deltas (this server does not yet):
    a stream shaped like theirs, served to the page in place of the real one."""
    server, _ = scripted

    def chunk(delta, finish=None):
        return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                      "model": "scripted", "choices": [
                                          {"index": 0, "delta": delta, "finish_reason": finish}]})
    events = [chunk({"role": "assistant", "content": ""}),
              chunk({"reasoning_content": "First, think. "}),
              chunk({"reasoning": "Then think more."}),
              chunk({"content": "The answer is 4."}), chunk({}, "stop"), "data: [DONE]"]
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body="\n\n".join(events) + "\n\n"))
    page.goto(f"http://127.0.0.1:{server.port}/ui/")
    page.fill("#prompt", "2+2?")
    page.press("#prompt", "Enter")
    wait_idle(page)
    sync_api.expect(assistant_bodies(page).last).to_have_text("The answer is 4.")
    body = page.locator(".msg.assistant .reasoning-body")
    sync_api.expect(body).to_have_text("First, think. Then think more.")
    assert "think" not in assistant_bodies(page).last.text_content()


def test_an_error_mid_answer_keeps_the_text_and_says_why(page):
    engine = ScriptedEngine(["word "], delay=0.1)
    from server.app import ServerSettings, create_app
    server = ThreadedServer(create_app(engine, ServerSettings(["scripted"])))
    try:
        page.goto(f"http://127.0.0.1:{server.port}/ui/")
        page.fill("#prompt", "Go on")
        page.press("#prompt", "Enter")
        sync_api.expect(assistant_bodies(page).last).to_contain_text("word word word")
        engine.fail_with = "the device fell over"      # the stream already started: an event
        wait_idle(page, 10_000)
        sync_api.expect(page.locator("#notice")).to_contain_text(
            "The server stopped this answer: The engine failed on this request: the device "
            "fell over")
        sync_api.expect(assistant_bodies(page).last).to_contain_text("word word word")
    finally:
        server.close()


def test_an_answer_cut_by_closing_the_page_shows_as_stopped(scripted, page):
    server, _ = scripted
    page.goto(f"http://127.0.0.1:{server.port}/ui/")
    conv = {"id": "c1", "title": "Earlier", "created": 0, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Half an ans", "reasoning": "", "status": "streaming"}]}
    page.evaluate("""(conv) => { localStorage.setItem('taper.conversations', JSON.stringify([conv]));
                                 localStorage.setItem('taper.current', '"c1"'); }""", conv)
    page.reload()
    sync_api.expect(assistant_bodies(page)).to_have_text("Half an ans")
    sync_api.expect(page.locator(".msg.assistant .badge")).to_have_text("stopped")
    sync_api.expect(page.locator("#send")).to_be_visible()


@pytest.mark.parametrize("text, reasoning, answer", [
    ("<think>plan</think>\n\nanswer", "plan", "answer"),
    ("  <think>still planning", "still planning", ""),
    ("plan only closed</think>answer", "plan only closed", "answer"),   # Qwen3, DeepSeek-R1
    ("<thi", "", ""),                                                  # a tag still arriving
    ("no tags <think> later", "", "no tags <think> later"),
])
def test_think_tags_split(scripted, page, text, reasoning, answer):
    server, _ = scripted
    page.goto(f"http://127.0.0.1:{server.port}/ui/")
    got = page.evaluate("""async (text) => {
        const { splitThink } = await import('/ui/stream.js');
        return splitThink(text); }""", text)
    assert (got["reasoning"], got["answer"]) == (reasoning, answer)


def test_loading_draining_and_errors_are_explained(page, screenshot):
    from server.app import ServerSettings, create_app
    app = create_app(None, ServerSettings(["scripted"]))         # the model is still loading
    server = ThreadedServer(app)
    try:
        status, _, payload = http_response(server.port, "POST", "/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "Hi"}]})
        assert (status, json.loads(payload)["error"]["code"]) == (503, "model_loading")
        page.goto(f"http://127.0.0.1:{server.port}/ui/")
        sync_api.expect(page.locator("#server-status")).to_have_text("loading the model\u2026")
        sync_api.expect(page.locator("#notice")).to_contain_text("still loading")
        page.fill("#prompt", "Hi")
        page.press("#prompt", "Enter")
        wait_idle(page)
        sync_api.expect(page.locator(".msg.assistant .badge.error")).to_contain_text(
            "The model is still loading")
        screenshot(page, "loading")

        engine = ScriptedEngine(["Hello", " world"])
        app.taper.engine = engine                                  # loaded: the page notices
        sync_api.expect(page.locator("#server-status")).to_have_text("ready", timeout=10_000)
        sync_api.expect(page.locator("#notice")).to_be_hidden()
        sync_api.expect(page.locator("#model")).to_have_value("scripted")

        engine.fail_with = "out of blocks"                         # the engine fails a request
        sent = []
        page.on("request", lambda r: sent.append(r) if r.method == "POST" else None)
        page.fill("#prompt", "Hi again")
        page.press("#prompt", "Enter")
        wait_idle(page)
        # the question that got no answer is not sent again: roles keep alternating
        assert json.loads(sent[-1].post_data)["messages"] == [
            {"role": "user", "content": "Hi again"}]
        sync_api.expect(page.locator("#notice")).to_contain_text(
            "The server answered 500: The engine failed on this request: out of blocks")

        app.taper.draining = True                                  # SIGTERM: draining
        page.fill("#prompt", "Still there?")
        page.press("#prompt", "Enter")
        wait_idle(page)
        sync_api.expect(page.locator(".msg.assistant .badge.error").last).to_contain_text(
            "shutting down (draining)")
        sync_api.expect(page.locator("#server-status")).to_have_text("shutting down",
                                                                      timeout=20_000)
    finally:
        server.close()

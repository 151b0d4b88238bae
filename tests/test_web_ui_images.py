"""The web chat UI's image attachments in a real browser (Debian's Chromium through Playwright,
as tests/test_web_ui.py): against a live `python -m server` on the tiny Gemma 3 vision checkpoint
(tests/gemma3_vision_checkpoint.py), an image file picked through the Image button's file input
shows as a thumbnail, goes out as an image_url data-URL part of the user message (the request the
page sends is read), and the answer shown is the one the official openai client gets for the same
message. A second turn sends the image again with the history; a removed attachment is not sent.
"""
from __future__ import annotations

import base64
import json

import pytest

from test_web_ui import (assistant_bodies, browser, page, screenshot,  # noqa: F401
                         stored_conversations, wait_idle)
from server_fakes import LiveServer, client_for

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("torch")
pytest.importorskip("PIL")

pytestmark = pytest.mark.timeout(300)
GEN = 8


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint
    tmp = tmp_path_factory.mktemp("ui-images")
    ckpt = tiny_gemma3_vision_checkpoint(tmp / "ckpt")
    server = LiveServer(tmp, ckpt, "--mem", "16", "--served-model-name", "g3")
    yield server
    server.close()


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    from vision_checkpoint import png_bytes, sample_image
    path = tmp_path_factory.mktemp("picked") / "gradient.png"
    path.write_bytes(png_bytes(sample_image(40, 30, seed=1)))
    return path


def chat_requests(pg) -> list:
    """The bodies of the chat requests the page sends, as they leave it."""
    sent = []
    pg.on("request", lambda r: sent.append(json.loads(r.post_data))
          if r.url.endswith("/v1/chat/completions") and r.method == "POST" else None)
    return sent


def test_attach_send_and_answer(live, page, image_file, screenshot):  # noqa: F811
    base = f"http://127.0.0.1:{live.port}"
    sent = chat_requests(page)
    page.goto(base + "/ui/")
    page.fill("#max-tokens", str(GEN))
    page.fill("#temperature", "0")
    page.set_input_files("#image-file", str(image_file))
    thumb = page.locator("#attachments img")
    sync_api.expect(thumb).to_have_count(1)
    sync_api.expect(thumb).to_have_attribute("alt", "gradient.png")
    page.fill("#prompt", "Describe")
    screenshot(page, "image-attached")
    page.click("#send")
    wait_idle(page)
    sync_api.expect(page.locator("#attachments")).to_be_hidden()     # sent with the message
    sync_api.expect(page.locator("#messages .msg.user img")).to_have_count(1)

    assert len(sent) == 1
    url = "data:image/png;base64," + base64.b64encode(image_file.read_bytes()).decode()
    user = sent[0]["messages"][-1]
    assert user == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe"}]}
    want = client_for(live.port).chat.completions.create(
        model="g3", messages=[user], max_tokens=GEN, temperature=0)
    reply = stored_conversations(page)[0]["messages"][-1]
    assert reply["status"] == "done" and reply["content"] == want.choices[0].message.content
    assert assistant_bodies(page).last.inner_text().strip()          # the answer shows
    screenshot(page, "image-answered")

    # a second turn: the first message's image goes again, with the history
    page.fill("#prompt", "And then?")
    page.click("#send")
    wait_idle(page)
    assert len(sent) == 2 and sent[1]["messages"][0] == user
    assert sent[1]["messages"][-1] == {"role": "user", "content": "And then?"}


def test_removed_attachment_is_not_sent(live, page, image_file):  # noqa: F811
    sent = chat_requests(page)
    page.goto(f"http://127.0.0.1:{live.port}/ui/")
    page.fill("#max-tokens", "2")
    page.set_input_files("#image-file", str(image_file))
    page.click("#attachments .remove")
    sync_api.expect(page.locator("#attachments")).to_be_hidden()
    page.fill("#prompt", "Hello")
    page.click("#send")
    wait_idle(page)
    assert sent[0]["messages"][-1] == {"role": "user", "content": "Hello"}

"""Images through a live `python -m server` with the official openai client (issue 33): data
URLs, http URLs from an allowed host (a local HTTP server), several images, the Responses API's
input_image, the tokens transformers generates for the same image, and the 400s: an
undecodable image, too large (bytes and pixels), too many, a host not allowed, a failing URL,
images sent to a text-only model."""
from __future__ import annotations

import base64
import http.server
import threading

import numpy as np
import openai
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from server_fakes import LiveServer, client_for  # noqa: E402
from vision_checkpoint import png_bytes, sample_image, tiny_vl_checkpoint  # noqa: E402

GEN = 8


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


class ImageHost:
    """A local HTTP server: /a.png an image, /big.png more bytes than allowed, /slow.png
    never answers in time, /missing.png a 404."""

    def __init__(self, image_bytes: bytes):
        body = image_bytes
        stop = threading.Event()
        self.stop = stop

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/a.png":
                    data = body
                elif self.path == "/big.png":
                    data = b"\0" * (2 * 2**20)
                elif self.path == "/slow.png":
                    stop.wait(5)
                    return
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, name: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/{name}"

    def close(self):
        self.stop.set()
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vl_server")
    ckpt = tiny_vl_checkpoint(tmp / "ckpt")
    image = sample_image(40, 56, seed=5)
    host = ImageHost(png_bytes(image))
    server = LiveServer(tmp, ckpt, "--mem", "16", "--served-model-name", "vl",
                        "--allowed-media-domains", "127.0.0.1", "--max-images-per-request", "3",
                        "--max-image-mb", "1", "--max-image-pixels", "40000",
                        "--media-fetch-timeout", "1")
    yield ckpt, image, host, client_for(server.port)
    server.close()
    host.close()


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str)
               else {"type": "image_url", "image_url": {"url": p[0]}} for p in parts]
    return [{"role": "user", "content": content}]


def chat(client, messages, **kw):
    return client.chat.completions.create(model="vl", messages=messages, max_tokens=GEN,
                                          temperature=0, extra_body={"ignore_eos": True}, **kw)


@torch.no_grad()
def hf_tokens(ckpt, image, text_before: str, text_after: str) -> list[int]:
    from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    ip, tok = Qwen2VLImageProcessorPil.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    out = ip(images=[image], return_tensors="pt")
    n = int(out["image_grid_thw"][0].prod()) // 4
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": text_before}, {"type": "image"},
                                      {"type": "text", "text": text_after}]}],
        tokenize=False, add_generation_prompt=True).replace("<|image_pad|>", "<|image_pad|>" * n)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       mm_token_type_ids=(ids == model.config.image_token_id).int(),
                       pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                       max_new_tokens=GEN, do_sample=False)
    return tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True), ids.shape[1]


def test_data_url_and_fetched_url_match_transformers(served):
    ckpt, image, host, client = served
    text, prompt_len = hf_tokens(ckpt, image, "What is this?", " Describe it.")
    for url in (data_url(image), host.url("a.png")):
        out = chat(client, user("What is this?", (url,), " Describe it."))
        assert out.choices[0].message.content == text, url[:30]
        assert out.usage.prompt_tokens == prompt_len        # the image's tokens count
    changed = chat(client, user("What is this?", (data_url(sample_image(40, 56, seed=6)),),
                                " Describe it."))
    assert changed.choices[0].message.content != text


def test_several_images_and_conversation(served):
    ckpt, image, host, client = served
    two = user("Compare", (data_url(image),), "and", (host.url("a.png"),))
    out = chat(client, two + [{"role": "assistant", "content": "ok"}]
               + user((data_url(sample_image(20, 30, seed=2)),), "and this?"))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == GEN
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, two, stream=True)
                       if c.choices)
    assert streamed == chat(client, two).choices[0].message.content


def test_responses_input_image(served):
    ckpt, image, host, client = served
    text, _ = hf_tokens(ckpt, image, "What is this?", " Describe it.")
    out = client.responses.create(model="vl", max_output_tokens=GEN, temperature=0, input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": " Describe it."}]}])
    assert out.output_text == text


@pytest.mark.parametrize("url, param, code", [
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
     "messages[0].content[1]", "invalid_image"),
    ("data:image/png;base64,@@@", "messages[0].content[1]", "invalid_image"),
    ("big", "messages[0].content[1]", "image_too_large"),
    ("huge-pixels", "messages[0].content[1]", "image_too_large"),
    ("http://localhost:1/a.png", "messages[0].content[1]", "image_url_not_allowed"),
    ("missing", "messages[0].content[1]", "image_fetch_failed"),
    ("slow", "messages[0].content[1]", "image_fetch_failed"),
    ("file:///etc/passwd", "messages[0].content[1]", "invalid_image"),
])
def test_bad_images_are_400s(served, url, param, code):
    ckpt, image, host, client = served
    url = {"big": host.url("big.png"), "missing": host.url("missing.png"),
           "slow": host.url("slow.png"),
           "huge-pixels": data_url(sample_image(250, 250))}.get(url, url)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, user("Look:", (url,)))
    assert e.value.body["param"] == param and e.value.body["code"] == code, e.value.body


def test_too_many_images(served):
    ckpt, image, host, client = served
    url = data_url(sample_image(12, 12))
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, user((url,), (url,), "x", (url,), (url,)))
    assert e.value.body["code"] == "too_many_images"
    assert e.value.body["param"] == "messages[0].content[4]"


def test_text_only_model_refuses_images(tmp_path):
    from checkpoints import tiny_checkpoint
    from tiny_tokenizers import build_byte_level
    build_byte_level(tmp_path / "m")
    tiny_checkpoint(tmp_path / "m", vocab_size=270)
    server = LiveServer(tmp_path, str(tmp_path / "m"), "--mem", "16", "--served-model-name", "t")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client_for(server.port).chat.completions.create(
                model="t", max_tokens=2,
                messages=user("Hi", (data_url(sample_image(8, 8)),)))
    finally:
        server.close()
    assert e.value.body["param"] == "messages[0].content[1].type"
    assert e.value.body["code"] == "unsupported_content"
    assert "text-only" in e.value.body["message"]


def test_chat_client_image_command(served, tmp_path):
    """`taper chat`'s /image PATH: the file goes with the next message as an image_url part,
    which the vision server answers as it answers the same data URL."""
    from server.chat.conversation import Conversation
    ckpt, image, host, client = served
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(image))
    conversation = Conversation()
    with pytest.raises(ValueError, match="not an image"):
        conversation.attach(str(tmp_path / "notes.txt"))
    assert conversation.attach(str(path)) == path.stat().st_size
    conversation.ask("What is this?")
    message = conversation.messages()[-1]
    assert message["content"][1] == {"type": "image_url", "image_url": {"url": data_url(image)}}
    assert not conversation.images                       # the next question goes alone
    out = chat(client, conversation.messages())
    assert out.choices[0].message.content == chat(
        client, user("What is this?", (data_url(image),))).choices[0].message.content

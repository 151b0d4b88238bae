"""Gemma 3 with images through a live `python -m server` and the official openai client (issue
33): a message with one and with two data-URL images gets transformers' greedy tokens (its
processor's prompt, token_type_ids for the bidirectional image mask), the prompt counts each
image's tokens, and another image changes the answer."""
from __future__ import annotations

import base64

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint  # noqa: E402
from server_fakes import LiveServer, client_for  # noqa: E402
from vision_checkpoint import png_bytes, sample_image  # noqa: E402

GEN = 12


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3v_server")
    ckpt = tiny_gemma3_vision_checkpoint(tmp / "ckpt")
    server = LiveServer(tmp, ckpt, "--mem", "16", "--served-model-name", "g3")
    yield ckpt, client_for(server.port)
    server.close()


@pytest.fixture(scope="module")
def hf(served):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    ckpt = served[0]
    model = Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(ckpt)


@torch.no_grad()
def hf_answer(hf, parts) -> tuple[str, int]:
    """(transformers' greedy text, its prompt's length) for one user message; parts: text, or
    a PIL image."""
    model, proc = hf
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
               for p in parts]
    text = proc.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                    add_generation_prompt=True)
    inputs = proc(text=text, images=[p for p in parts if not isinstance(p, str)],
                  return_tensors="pt")
    g = model.generate(**inputs, max_new_tokens=GEN, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return proc.tokenizer.decode(g[0, n:], skip_special_tokens=True), n


def ask(client, parts):
    content = [{"type": "text", "text": p} if isinstance(p, str)
               else {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    return client.chat.completions.create(
        model="g3", messages=[{"role": "user", "content": content}], max_tokens=GEN,
        temperature=0, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("parts", [
    ["Describe", sample_image(40, 30, seed=1)],
    ["Compare the two images:", sample_image(30, 40, seed=2), sample_image(40, 30, seed=1)],
], ids=["one image", "two images"])
def test_answers_equal_transformers(served, hf, parts):
    client = served[1]
    text, prompt_len = hf_answer(hf, parts)
    out = ask(client, parts)
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == prompt_len        # 16 tokens (+ markers) per image


def test_another_image_changes_the_answer(served, hf):
    from PIL import ImageOps
    client = served[1]
    image = sample_image(40, 30, seed=1)
    first = ask(client, ["Describe", image]).choices[0].message.content
    other = ask(client, ["Describe", ImageOps.invert(image)]).choices[0].message.content
    assert other != first
    assert other == hf_answer(hf, ["Describe", ImageOps.invert(image)])[0]


def test_responses_input_image(served, hf):
    client = served[1]
    image = sample_image(40, 30, seed=1)
    out = client.responses.create(model="g3", max_output_tokens=GEN, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe"},
                                     {"type": "input_image", "image_url": data_url(image)}]}])
    assert out.output_text == hf_answer(hf, ["Describe", image])[0]

"""Qwen3-VL, dense and MoE, through a live `python -m server` with the official openai client
(issue 33): a message with one image and one with two (data URLs) get the tokens transformers'
generate gives for the same processor outputs, the images' tokens counted in the usage."""
from __future__ import annotations

import base64

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from qwen3_vl_checkpoint import tiny_qwen3_vl_checkpoint  # noqa: E402
from server_fakes import LiveServer, client_for  # noqa: E402
from vision_checkpoint import png_bytes, sample_image  # noqa: E402

GEN = 8

MESSAGES = {   # parts: text, or the (width, height, seed) of an image
    "one image": ["What is this?", (40, 56, 5), " Describe it."],
    "two images": [(23, 31, 1), "Compare the two images:", (48, 40, 2), "which one is brighter?"],
}


@pytest.fixture(scope="module", params=["dense", "moe"])
def served(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"qwen3vl_server_{request.param}")
    ckpt = tiny_qwen3_vl_checkpoint(tmp / "ckpt", moe=request.param == "moe")
    server = LiveServer(tmp, ckpt, "--mem", "16", "--served-model-name", "vl")
    yield ckpt, client_for(server.port), request.param == "moe"
    server.close()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@torch.no_grad()
def hf_reply(ckpt, moe: bool, parts: list) -> tuple[str, int]:
    """transformers' greedy reply (decoded) and prompt length for the message, its image
    tokens expanded as Qwen3VLProcessor expands them."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    model_class = (transformers.Qwen3VLMoeForConditionalGeneration if moe
                   else transformers.Qwen3VLForConditionalGeneration)
    model = model_class.from_pretrained(ckpt, dtype=torch.float32).eval()
    ip, tok = Qwen2VLImageProcessorPil.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    images = [sample_image(*p) for p in parts if isinstance(p, tuple)]
    out = ip(images=images, return_tensors="pt")
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
               for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    for grid in out["image_grid_thw"]:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       mm_token_type_ids=(ids == model.config.image_token_id).int(),
                       pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                       max_new_tokens=GEN, do_sample=False)
    return tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True), ids.shape[1]


@pytest.mark.parametrize("name", list(MESSAGES))
def test_reply_matches_transformers(served, name):
    ckpt, client, moe = served
    parts = MESSAGES[name]
    text, prompt_len = hf_reply(ckpt, moe, parts)
    content = [{"type": "text", "text": p} if isinstance(p, str)
               else {"type": "image_url", "image_url": {"url": data_url(sample_image(*p))}}
               for p in parts]
    out = client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": content}], max_tokens=GEN,
        temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == prompt_len         # the images' tokens count

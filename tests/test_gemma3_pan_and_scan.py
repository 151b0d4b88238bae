"""Gemma 3's pan-and-scan (issue 33) on a tiny random Gemma3ForConditionalGeneration whose
processor config turns it on (tests/gemma3_vision_checkpoint.py, crops of at least 8 pixels):
the crops' pixels, the prompt text with the original's and each crop's tokens, and greedy tokens
for a wide image, each against transformers. transformers 5.23's Gemma3Processor does not read
the pan-and-scan keys of the config (its own images_kwargs defaults win over the image
processor's), so the reference gets them as call arguments: what the checkpoint asks for."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint  # noqa: E402
from test_gemma3_vision import GEN, hf_generate, make_engine, messages, run  # noqa: E402
from vision_checkpoint import sample_image  # noqa: E402

MIN_CROP = 8
# what the processor is called with: the checkpoint's setting and Gemma3Processor's defaults
PAS = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=MIN_CROP,
           pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)

WIDE = (100, 30)            # 3 crops of 34x30 (the last 32x30)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_gemma3_vision_checkpoint(
        tmp_path_factory.mktemp("gemma3pas"),
        processor=dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=MIN_CROP))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    model = Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def vision(ckpt):
    from engine.models.model_config import ModelConfig
    return ModelConfig.from_pretrained(ckpt).vision


@pytest.fixture(scope="module")
def processor(ckpt, vision):
    from engine.vision.families import image_processor
    return image_processor(ckpt, vision)


def hf_inputs(hf, parts, images, pan_and_scan: bool = True):
    proc = hf[1]
    text = proc.apply_chat_template(messages(parts), tokenize=False, add_generation_prompt=True)
    return proc(text=text, images=images, return_tensors="pt", **(PAS if pan_and_scan else {}))


def engine_prompt(ckpt, vision, processor, parts, images):
    """The server's way: the images preprocessed, the rendered text expanded for them (crops
    included), tokenized, the crops placed after their image."""
    from engine.text.tokenizer import Tokenizer
    from server.media import expand_image_tokens, text_expander
    tok = Tokenizer.from_pretrained(ckpt)
    processed = [processor.preprocess(im) for im in images]
    ids = tok.encode_chat(messages(parts), add_generation_prompt=True,
                          rewrite=text_expander(vision, tok, processed))
    return expand_image_tokens(ids, processed, vision)


def test_config_is_read_and_checked(ckpt, vision, processor, tmp_path):
    from engine.vision.families import image_processor
    assert processor.do_pan_and_scan and processor.pan_and_scan_min_crop_size == MIN_CROP
    assert (processor.pan_and_scan_max_num_crops, processor.pan_and_scan_min_ratio_to_activate) \
        == (4, 1.2)
    with open(f"{ckpt}/processor_config.json") as f:
        cfg = json.load(f)["image_processor"]
    with open(f"{ckpt}/config.json") as f:
        (tmp_path / "config.json").write_text(f.read())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**cfg, "pan_and_scan_max_num_crops": 1}))
    with pytest.raises(ValueError, match="pan_and_scan_max_num_crops >= 2"):
        image_processor(str(tmp_path), vision)


@pytest.mark.parametrize("size, mode, crops", [
    (WIDE, "RGB", 3), ((101, 30), "RGBA", 3), ((30, 70), "RGB", 2), ((300, 20), "P", 4),
    ((40, 36), "RGB", 0), ((100, 6), "L", 0)])
def test_pixels_equal_hf_processor(hf, processor, size, mode, crops):
    """The original and each crop: the same bits as transformers' Gemma3ImageProcessorPil with
    pan-and-scan on, as many crops, in its order (a tall image's crops top to bottom; at most
    4; none under 8 pixels a side or for a nearly square image)."""
    image = sample_image(*size, seed=3, mode=mode)
    ref = hf[1].image_processor(images=[image], return_tensors="np", **PAS)
    assert ref["num_crops"].tolist() == [crops]
    mine = processor.preprocess(image)
    assert mine.num_crops == crops and len(ref["pixel_values"]) == crops + 1
    p = processor.patch_size
    for view, pixels in zip(mine.views, ref["pixel_values"]):
        C, H, W = pixels.shape
        patches = pixels.reshape(C, H // p, p, W // p, p).transpose(1, 3, 0, 2, 4)
        assert np.array_equal(view.pixel_values, patches.reshape(-1, C * p * p))
        assert view.grid_thw == (1, 4, 4)
    assert len({v.content_hash for v in mine.views}) == crops + 1


@pytest.mark.parametrize("sizes", [[WIDE], [WIDE, (32, 32)], [(30, 70), WIDE]])
def test_prompt_equals_hf_processor(ckpt, hf, vision, processor, sizes):
    """"Here is the original image ... and here are some crops to help you see better" and each
    crop's tokens, per image: transformers' input_ids."""
    parts = ["Describe"] + [None] * len(sizes)
    images = [sample_image(*s, seed=1) for s in sizes]
    ids = engine_prompt(ckpt, vision, processor, parts, images)
    assert list(ids) == hf_inputs(hf, parts, images)["input_ids"][0].tolist()
    assert len(ids.images) == sum(1 + processor.preprocess(im).num_crops for im in images)


def test_greedy_matches_hf_generate(ckpt, hf, vision, processor):
    """A wide image, encoded as itself and 3 crops: transformers' greedy tokens; without the
    crops transformers' tokens differ, so the crops are what matches."""
    parts, images = ["Describe", None], [sample_image(*WIDE, seed=1)]
    tokens, trusted = hf_generate(hf, hf_inputs(hf, parts, images))
    assert trusted >= 8, f"reference near-tie at token {trusted}"
    assert hf_generate(hf, hf_inputs(hf, parts, images, pan_and_scan=False))[0] != tokens
    ids = engine_prompt(ckpt, vision, processor, parts, images)
    engine = make_engine(ckpt)
    seq = run(engine, list(ids), ids.images, GEN)
    assert seq.output_token_ids[:trusted] == tokens[:trusted]
    assert engine.runner.vision.num_encoded == 4


@torch.no_grad()
def test_server_answer_equals_transformers(ckpt, hf, tmp_path):
    """Through a live `python -m server` and the openai client: the images are read before the
    prompt is tokenized (their crops change its text), so the answer and the prompt's length are
    transformers'."""
    from server_fakes import LiveServer, client_for
    from test_gemma3_vision_server import data_url
    parts = ["Describe", sample_image(*WIDE, seed=1), sample_image(32, 32, seed=2)]
    images = [p for p in parts if not isinstance(p, str)]
    inputs = hf_inputs(hf, [p if isinstance(p, str) else None for p in parts], images)
    g = hf[0].generate(**inputs, max_new_tokens=GEN, do_sample=False)
    n = inputs["input_ids"].shape[1]
    content = [{"type": "text", "text": p} if isinstance(p, str)
               else {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    server = LiveServer(tmp_path, ckpt, "--mem", "16", "--served-model-name", "g3")
    try:
        out = client_for(server.port).chat.completions.create(
            model="g3", messages=[{"role": "user", "content": content}], max_tokens=GEN,
            temperature=0, extra_body={"ignore_eos": True})
    finally:
        server.close()
    assert out.choices[0].message.content == hf[1].tokenizer.decode(
        g[0, n:], skip_special_tokens=True)
    assert out.usage.prompt_tokens == n            # (1 + 3 crops + 1) images of 16 tokens

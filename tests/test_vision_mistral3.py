"""Mistral 3 vision through the engine (issue 33) on a tiny random checkpoint written by
transformers (tests/mistral3_checkpoint.py): Pixtral's processor pixels and image token rows, the
tower and projector's outputs, greedy tokens for prompts with one and two images against
transformers' generate, and the prefix cache keyed by the image's content."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from mistral3_checkpoint import MERGE, PATCH, tiny_mistral3_checkpoint  # noqa: E402
from vision_checkpoint import sample_image  # noqa: E402
from vision_oracle import (  # noqa: E402
    CASES, GEN, BareBackend, GeluOnlyBackend, case_images, check_backends_refused,
    check_prefix_cache_keys, greedy_with_trust, make_engine, messages, one_pixel_changed, run)

from engine.vision.families import image_processor, preprocess  # noqa: E402

UNIT = PATCH * MERGE         # PixtralProcessor's patch size for the image processor


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_mistral3_checkpoint(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import (AutoTokenizer, Mistral3ForConditionalGeneration,
                              PixtralImageProcessorPil)
    model = Mistral3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return (model, PixtralImageProcessorPil.from_pretrained(ckpt),
            AutoTokenizer.from_pretrained(ckpt))


@pytest.fixture(scope="module")
def processor(ckpt):
    from engine.models.model_config import ModelConfig
    return image_processor(ckpt, ModelConfig.from_pretrained(ckpt).vision)


def hf_pixels(hf, images: list):
    """transformers' image processor as PixtralProcessor calls it (patch x merge)."""
    return hf[1](images=images, patch_size={"height": UNIT, "width": UNIT}, return_tensors="pt")


def hf_prompt(hf, parts: list, images: list) -> list[int]:
    """One user message's prompt as PixtralProcessor builds it: each [IMG] replaced by the
    image's rows of [IMG]s, each row ended by [IMG_BREAK], the last by [IMG_END]."""
    tok = hf[2]
    text = tok.apply_chat_template(messages(parts), tokenize=False)
    sizes = iter(hf_pixels(hf, images)["image_sizes"].tolist()) if images else iter(())
    pieces = text.split("[IMG]")
    out = pieces[0]
    for piece in pieces[1:]:
        h, w = next(sizes)
        out += ("[IMG]" * (w // UNIT) + "[IMG_BREAK]") * (h // UNIT - 1)
        out += "[IMG]" * (w // UNIT) + "[IMG_END]" + piece
    return tok(out, add_special_tokens=False)["input_ids"]


def prompt_ids(hf, parts: list, processed: list) -> list[int]:
    """The same prompt as the server builds it: the template's [IMG]s replaced by each
    processed image's run."""
    tok = hf[2]
    text = tok.apply_chat_template(messages(parts), tokenize=False)
    image_id = tok.convert_tokens_to_ids("[IMG]")
    out, it = [], iter(processed)
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        out += next(it).prompt_tokens(t) if t == image_id else [t]
    return out


def hf_generate(hf, ids: list[int], images: list, n: int = GEN):
    """transformers' greedy tokens and how many are trusted (top-two gap over TIE)."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        out = hf_pixels(hf, images)
        kwargs = dict(pixel_values=out["pixel_values"], image_sizes=out["image_sizes"])
    return greedy_with_trust(hf[0], n, input_ids=input_ids,
                             attention_mask=torch.ones_like(input_ids), **kwargs)


# ---- preprocessing and the vision side

@pytest.mark.parametrize("size, mode", [((40, 56), "RGB"), ((23, 17), "RGBA"), ((9, 9), "L"),
                                        ((300, 20), "P"), ((100, 70), "RGB")])
def test_pixels_and_tokens_equal_hf_processor(hf, processor, size, mode):
    """Resize (scaled down to the longest edge, sides up to multiples of patch x merge),
    rescale, normalise: the same bits as transformers' PixtralImageProcessorPil; the image's
    prompt run is PixtralProcessor's rows of [IMG] ended by [IMG_BREAK] / [IMG_END]."""
    image = sample_image(*size, seed=3, mode=mode)
    ref = hf_pixels(hf, [image])
    h, w = ref["image_sizes"][0].tolist()
    pixels = ref["pixel_values"][0].numpy()
    patches = pixels.reshape(3, h // PATCH, PATCH, w // PATCH, PATCH).transpose(1, 3, 0, 2, 4)
    mine = preprocess(image, processor)
    assert mine.grid_thw == (1, h // PATCH, w // PATCH)
    assert np.array_equal(mine.pixel_values, patches.reshape(-1, 3 * PATCH * PATCH))
    assert prompt_ids(hf, [None], [mine]) == hf_prompt(hf, [None], [image])


def test_encoder_matches_hf(ckpt, hf, processor):
    """The tower and projector's rows for the image's [IMG] tokens equal transformers'
    get_image_features; the break rows are left for the token embeddings."""
    from engine.loader.safetensors import load_safetensors
    from engine.models.mistral3 import _checkpoint_names
    from engine.models.model_config import ModelConfig
    from engine.vision.pixtral_encoder import PixtralVisionEncoder
    from pyx.cpu_backend import CpuBackend
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    config = ModelConfig.from_pretrained(ckpt).vision
    encoder = PixtralVisionEncoder(config, weights, CpuBackend())
    for size in [(40, 56), (23, 17), (48, 48)]:
        image = sample_image(*size, seed=1)
        out = hf_pixels(hf, [image])
        with torch.no_grad():
            ref = hf[0].model.get_image_features(
                out["pixel_values"], out["image_sizes"]).pooler_output[0].numpy()
        mine = preprocess(image, processor)
        got = encoder.encode(mine.pixel_values, mine.grid_thw)
        is_image = np.array(mine.tokens) == config.image_token_id
        np.testing.assert_allclose(got[is_image], ref, atol=5e-5 * np.abs(ref).max())
        assert not got[~is_image].any()



def test_processor_config_layouts_and_errors(ckpt, processor, tmp_path):
    """transformers 5 saves the image processor's keys inside processor_config.json
    ("image_processor"); older saves beside it in preprocessor_config.json: both are read. A
    tokenizer without the break token, or a patch size unlike the tower's, is refused by name."""
    import json
    import shutil

    from engine.models.model_config import ModelConfig
    vision = ModelConfig.from_pretrained(ckpt).vision
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{ckpt}/{name}", tmp_path / name)
    with open(f"{ckpt}/processor_config.json") as f:
        proc = json.load(f)
    with open(f"{ckpt}/preprocessor_config.json") as f:
        image = json.load(f)
    nested = tmp_path / "processor_config.json"
    nested.write_text(json.dumps({**proc, "image_processor": {**image, "size": {
        "longest_edge": 24}}}))
    read = image_processor(str(tmp_path), vision)
    assert read.longest_edge == 24 and processor.longest_edge == 48
    assert (read.image_token_id, read.image_break_token_id, read.image_end_token_id) == (
        processor.image_token_id, processor.image_break_token_id, processor.image_end_token_id)
    nested.write_text(json.dumps({**proc, "image_break_token": "[ROW]"}))
    with pytest.raises(ValueError, match=r"the tokenizer has no \[ROW\] token"):
        image_processor(str(tmp_path), vision)
    nested.write_text(json.dumps({**proc, "patch_size": 8}))
    with pytest.raises(ValueError, match="patch 8 / merge 2 differ from config.json's"):
        image_processor(str(tmp_path), vision)


# ---- generation against transformers


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf_generate(ckpt, hf, processor, name):
    """Chunked prefill (chunks of 16 tokens cut the images' runs), then decodes: transformers'
    tokens up to its first near-tie; the images inverted change transformers' tokens (so the
    image's embeddings are what the check compares)."""
    from PIL import ImageOps
    parts, sizes = CASES[name]
    images = case_images(sizes)
    processed = [preprocess(im, processor) for im in images]
    ids = prompt_ids(hf, parts, processed)
    assert ids == hf_prompt(hf, parts, images)
    tokens, trusted = hf_generate(hf, ids, images)
    assert trusted >= 6, f"reference near-tie at token {trusted}"
    other, _ = hf_generate(hf, ids, [ImageOps.invert(im) for im in images])
    assert other[:trusted] != tokens[:trusted]
    engine = make_engine(ckpt, max_num_batched_tokens=16)
    seq = run(engine, ids, processed)
    assert seq.output_token_ids[:trusted] == tokens[:trusted]
    # each image encoded once, though chunks of 16 split its tokens (the encoder cache)
    assert engine.runner.vision.num_encoded == len(images)


# ---- caches and admission

def test_prefix_cache_keys_hold_the_image(ckpt, hf, processor):
    """Same image and text: the second request's prompt blocks come from the cache; a
    different image (one pixel changed) with the same text: no block is shared past the
    image's first block, and its tokens are its own (transformers' for that image)."""
    parts, sizes = CASES["one image"]
    image = sample_image(*sizes[0], seed=5)
    other = one_pixel_changed(image)
    a = [preprocess(image, processor)]
    b = [preprocess(image, processor)]        # decoded again: the same content
    c = [preprocess(other, processor)]
    assert a[0].content_hash == b[0].content_hash != c[0].content_hash
    ids = prompt_ids(hf, parts, a)
    assert prompt_ids(hf, parts, c) == ids      # the same tokens: only the key tells them apart
    check_prefix_cache_keys(ckpt, hf, ids, a, b, c, hf_generate(hf, ids, [other]))


def test_admission_errors(ckpt, hf, processor):
    image = preprocess(sample_image(40, 56), processor)
    small = preprocess(sample_image(9, 9), processor)
    ids = prompt_ids(hf, ["Hi", None], [image])
    engine = make_engine(ckpt)
    with pytest.raises(ValueError, match="image tokens but no images"):
        engine.add_request("x", ids, __import__("engine").SamplingParams())
    with pytest.raises(ValueError, match="image tokens for 1 of its 2 images"):
        engine.add_request("y", ids, __import__("engine").SamplingParams(), images=[image] * 2)
    with pytest.raises(ValueError, match="image 0 needs a run of 6 tokens"):
        engine.add_request("z", ids, __import__("engine").SamplingParams(), images=[small])


def test_backend_without_vision_ops_is_refused(ckpt):
    """Loading refuses a backend whose class leaves gelu or encoder_attention to the op table's
    base class, naming the missing ones (CUDA has both: tests/test_cuda_host.py; the tower on
    CUDA: tests/gpu/test_cuda_vision.py)."""
    from engine.models.mistral3 import Mistral3ForConditionalGeneration
    check_backends_refused(Mistral3ForConditionalGeneration, ckpt, [
        (BareBackend(), "the bare backend has no gelu and encoder_attention ops"),
        (GeluOnlyBackend(), "has no encoder_attention op, which the Pixtral")])


# ---- through the server

def test_server_matches_hf_generate(ckpt, hf, tmp_path):
    """A live `python -m server` with the official openai client: one image and two images as
    data URLs give transformers' greedy text for the prompt PixtralProcessor builds, and count
    every token of the images' runs in the prompt."""
    import base64

    from server_fakes import LiveServer, client_for
    from vision_checkpoint import png_bytes
    server = LiveServer(tmp_path, ckpt, "--mem", "16", "--served-model-name", "m3")
    try:
        client = client_for(server.port)
        for name, (parts, sizes) in CASES.items():
            images = case_images(sizes)
            ids = hf_prompt(hf, parts, images)
            tokens, trusted = hf_generate(hf, ids, images, n=GEN)
            assert trusted == GEN, f"{name}: reference near-tie at token {trusted}"
            it = iter(images)
            content = [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(png_bytes(next(it))).decode()}}
                if p is None else {"type": "text", "text": p} for p in parts]
            out = client.chat.completions.create(
                model="m3", messages=[{"role": "user", "content": content}], max_tokens=GEN,
                temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].message.content == hf[2].decode(
                tokens, skip_special_tokens=True), name
            assert out.usage.prompt_tokens == len(ids), name
    finally:
        server.close()

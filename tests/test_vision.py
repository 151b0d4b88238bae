"""Images through the engine (issue 33) on a tiny random Qwen2.5-VL written by transformers
(tests/vision_checkpoint.py): the image processor's pixels, the vision tower's outputs, greedy
tokens for prompts with one and two images against transformers' generate, M-RoPE positions
against get_rope_index, the prefix cache and the encoder cache keyed by image content, and the
per-step encoder budget."""
from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from vision_checkpoint import sample_image, tiny_vl_checkpoint  # noqa: E402
from vision_oracle import (  # noqa: E402
    CASES, GEN, BareBackend, GeluOnlyBackend, case_images, check_backends_refused,
    check_greedy_case, check_mrope_positions, check_prefix_cache_keys, hf_generate, make_engine,
    one_pixel_changed, prompt_ids, run)

from engine.vision.config import ImageProcessorConfig  # noqa: E402
from engine.vision.preprocess import preprocess_image  # noqa: E402

ARCH = "Qwen2_5_VLForConditionalGeneration"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_vl_checkpoint(tmp_path_factory.mktemp("qwen25vl"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return (model, Qwen2VLImageProcessorPil.from_pretrained(ckpt),
            AutoTokenizer.from_pretrained(ckpt))


@pytest.fixture(scope="module")
def processor(ckpt):
    from engine.models.model_config import ModelConfig
    return ImageProcessorConfig.from_pretrained(ckpt, ModelConfig.from_pretrained(ckpt).vision)


# ---- preprocessing and the vision tower

@pytest.mark.parametrize("size, mode", [((40, 56), "RGB"), ((23, 17), "RGBA"), ((9, 9), "L"),
                                        ((300, 20), "P"), ((200, 150), "RGB")])
def test_pixels_equal_hf_processor(hf, processor, size, mode):
    """Resize (smart resize, min and max pixels), rescale, normalise and patch order are the
    same bits as transformers' Qwen2VLImageProcessorPil."""
    image = sample_image(*size, seed=3, mode=mode)
    ref = hf[1](images=[image], return_tensors="np")
    mine = preprocess_image(image, processor)
    assert mine.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert np.array_equal(mine.pixel_values, ref["pixel_values"])


def test_encoder_matches_hf(ckpt, hf, processor):
    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    from engine.vision.qwen2_5_vl_encoder import Qwen25VisionEncoder
    from pyx.cpu_backend import CpuBackend
    encoder = Qwen25VisionEncoder(ModelConfig.from_pretrained(ckpt).vision,
                                  load_safetensors(ckpt, progress=False), CpuBackend())
    for size in [(40, 56), (23, 17), (48, 48)]:
        image = sample_image(*size, seed=1)
        out = hf[1](images=[image], return_tensors="pt")
        with torch.no_grad():
            ref = hf[0].model.get_image_features(
                out["pixel_values"], out["image_grid_thw"]).pooler_output[0].numpy()
        mine = encoder.encode(out["pixel_values"].numpy(), tuple(out["image_grid_thw"][0].tolist()))
        np.testing.assert_allclose(mine, ref, atol=5e-5 * np.abs(ref).max())


# ---- generation against transformers

@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf_generate(ckpt, hf, processor, name):
    """Chunked prefill (chunks of 32 tokens cut the images' runs), then decodes: transformers'
    tokens up to its first near-tie."""
    check_greedy_case(ckpt, hf, lambda im: preprocess_image(im, processor), name)


def test_images_and_mrope_change_the_tokens(ckpt, hf, processor):
    """The test above can fail: transformers' tokens differ with another image, and with the
    image tokens given text positions (M-RoPE off)."""
    parts, sizes = CASES["one image"]
    image = sample_image(*sizes[0], seed=5)
    processed = [preprocess_image(image, processor)]
    ids = prompt_ids(hf, parts, processed)
    tokens, _ = hf_generate(hf, ids, [image])
    from PIL import ImageOps
    other = ImageOps.invert(image)            # same size, so the same prompt ids
    assert hf_generate(hf, ids, [other])[0] != tokens
    model = hf[0]
    with torch.no_grad():      # 1D positions: each token its index, all three sections alike
        pos = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
        out = hf[1](images=[image], return_tensors="pt")
        logits = model(input_ids=torch.tensor([ids]), pixel_values=out["pixel_values"],
                       image_grid_thw=out["image_grid_thw"], position_ids=pos).logits[0, -1]
        ref = model(input_ids=torch.tensor([ids]), pixel_values=out["pixel_values"],
                    image_grid_thw=out["image_grid_thw"],
                    mm_token_type_ids=(torch.tensor([ids]) == model.config.image_token_id).int()
                    ).logits[0, -1]
    assert int(ref.argmax()) == tokens[0]
    assert float((logits - ref).abs().max()) > 0.1


def test_mrope_positions_equal_get_rope_index(ckpt, hf, processor):
    parts, sizes = CASES["two images"]
    processed = [preprocess_image(im, processor) for im in case_images(sizes, first_seed=0)]
    mm, pos, full = check_mrope_positions(ckpt, hf, processed, prompt_ids(hf, parts, processed))
    # a chunk's positions are the same rows of the whole prompt's
    pos2, rows2, triples2, _ = mm.rope_positions(7, 40)
    assert np.array_equal(pos2, pos[7:47]) and np.array_equal(triples2, full[7:47][rows2])


# ---- caches and scheduling

def test_prefix_cache_keys_hold_the_image(ckpt, hf, processor):
    """Same image and text: the second request's prompt blocks come from the cache; a
    different image (one pixel changed) with the same text: no block is shared past the
    image's first block, and its tokens are its own (transformers' for that image)."""
    parts, sizes = CASES["one image"]
    image = sample_image(*sizes[0], seed=5)
    other = one_pixel_changed(image)
    a = [preprocess_image(image, processor)]
    b = [preprocess_image(image, processor)]        # decoded again: the same content
    c = [preprocess_image(other, processor)]
    assert a[0].content_hash == b[0].content_hash != c[0].content_hash
    ids = prompt_ids(hf, parts, a)
    check_prefix_cache_keys(ckpt, hf, ids, a, b, c, hf_generate(hf, ids, [other]))


def test_encoder_cache_serves_repeated_images(ckpt, hf, processor):
    """Without prefix caching the second request computes the image tokens again, from the
    encoder cache."""
    parts, sizes = CASES["one image"]
    processed = [preprocess_image(sample_image(*sizes[0], seed=5), processor)]
    ids = prompt_ids(hf, parts, processed)
    engine = make_engine(ckpt, enable_prefix_caching=False)
    first = run(engine, ids, processed, request_id="a")
    again = run(engine, ids, [preprocess_image(sample_image(*sizes[0], seed=5), processor)],
                request_id="b")
    assert again.output_token_ids == first.output_token_ids
    assert engine.runner.vision.num_encoded == 1 and engine.runner.vision.cache.hits == 1


def test_encoder_cache_is_bounded_lru(ckpt):
    from engine.vision.encoder_cache import EncoderCache
    cache = EncoderCache(max_bytes=3 * 400)
    for key in range(3):
        cache.put(key, np.zeros(100, np.float32))
    assert cache.get(0) is not None                     # 0 is now the most recent
    cache.put(3, np.zeros(100, np.float32))
    assert list(cache.entries) == [2, 0, 3]             # 1 was the least recently used
    cache.put(4, np.zeros(100, np.float32), pinned={2})
    assert list(cache.entries) == [2, 3, 4] and cache.num_bytes == 1200


def test_encoder_budget_per_step(ckpt, hf, processor):
    """With an encoder budget below two images, a prompt with two images encodes them in two
    steps: the chunk stops before the second image; the tokens are unchanged."""
    parts, sizes = CASES["two images"]
    processed = [preprocess_image(im, processor) for im in case_images(sizes)]
    ids = prompt_ids(hf, parts, processed)
    free = run(make_engine(ckpt, max_num_batched_tokens=256), ids, processed)
    engine = make_engine(ckpt, max_num_batched_tokens=256)
    budget = engine.scheduler.encoder_budget
    budget.max_encoder_tokens = max(p.num_tokens for p in processed)
    seq = engine.add_request("r", ids, __import__("engine").SamplingParams(
        max_tokens=GEN, temperature=0, ignore_eos=True), images=processed)
    engine.step()
    second = seq.mm.images[1]
    assert seq.num_computed_tokens == second.offset     # cut just before the second image
    assert engine.runner.vision.num_encoded == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.vision.num_encoded == 2 and budget.num_cut == 1
    assert seq.output_token_ids == free.output_token_ids


def test_admission_errors(ckpt, hf, processor):
    image = preprocess_image(sample_image(40, 56), processor)
    ids = prompt_ids(hf, ["Hi", None], [image])
    engine = make_engine(ckpt)
    with pytest.raises(ValueError, match="image tokens but no images"):
        engine.add_request("x", ids, __import__("engine").SamplingParams())
    with pytest.raises(ValueError, match="1 runs of image tokens for 2 images"):
        engine.add_request("y", ids, __import__("engine").SamplingParams(), images=[image] * 2)


def test_backend_without_vision_ops_is_refused(ckpt):
    """Loading refuses a backend whose class leaves gelu or encoder_attention to the op table's
    base class, naming the missing ones; the CPU backend has both (the CUDA one:
    tests/test_cuda_host.py)."""
    from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, missing_ops
    from pyx.cpu_backend import CpuBackend
    check_backends_refused(Qwen2_5_VLForConditionalGeneration, ckpt, [
        (BareBackend(), "the bare backend has no gelu and encoder_attention ops"),
        (GeluOnlyBackend(), "has no encoder_attention op, which the vision")])
    assert missing_ops(CpuBackend) == []

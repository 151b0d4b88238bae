"""Gemma 3 with images (issue 33) on a tiny random Gemma3ForConditionalGeneration written by
transformers (tests/gemma3_vision_checkpoint.py): the image processor's pixels, the SigLIP tower
and projector's outputs, the prompt text's image expansion, greedy tokens for prompts with one
and two images against transformers' generate (which passes token_type_ids, so the image tokens
attend to each other both ways), the whole-image chunking rule, and the prefix cache keyed by
image content. Each feature is shown to matter: tokens change with the bidirectional mask off,
with another image, and when an image is split across chunks."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint  # noqa: E402
from vision_checkpoint import sample_image  # noqa: E402
from vision_oracle import (  # noqa: E402
    BareBackend, check_backends_refused, greedy_with_trust, make_engine, messages,
    one_pixel_changed, run)

GEN = 12

# (message parts: text, or None for an image; image sizes)
CASES = {
    "one image": (["Describe", None], [(40, 30)]),
    "two images": (["Compare the two images:", None, None], [(30, 40), (40, 30)]),
}
# seeds whose prompts' tokens change within GEN when the image mask is off
SEEDS = {"one image": [1], "two images": [2, 1]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3v"))


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


def hf_inputs(hf, parts, images):
    """transformers' processor outputs for one user message: the text expanded, pixel values,
    token_type_ids."""
    proc = hf[1]
    text = proc.apply_chat_template(messages(parts), tokenize=False, add_generation_prompt=True)
    return proc(text=text, images=images, return_tensors="pt")


def case(name):
    parts, sizes = CASES[name]
    return parts, [sample_image(*s, seed=seed) for s, seed in zip(sizes, SEEDS[name])]


def hf_generate(hf, inputs, n: int = GEN, bidirectional: bool = True):
    """transformers' greedy tokens and how many are trusted (top-two gap over TIE)."""
    inputs = dict(inputs)
    if not bidirectional:
        inputs.pop("token_type_ids")
    return greedy_with_trust(hf[0], n, **inputs)


# ---- preprocessing, the prompt and the vision tower

@pytest.mark.parametrize("size, mode", [((40, 30), "RGB"), ((23, 17), "RGBA"), ((9, 9), "L"),
                                        ((300, 20), "P"), ((32, 32), "RGB")])
def test_pixels_equal_hf_processor(hf, processor, size, mode):
    """Resize, rescale, normalise: the same bits as transformers' Gemma3ImageProcessorPil; the
    patches are its pixel values cut in the Conv2d's kernel order."""
    image = sample_image(*size, seed=3, mode=mode)
    ref = hf[1].image_processor(images=[image], return_tensors="np")["pixel_values"][0]
    mine = processor.preprocess(image)
    C, H, W = ref.shape
    p = processor.patch_size
    patches = ref.reshape(C, H // p, p, W // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, C * p * p)
    assert np.array_equal(mine.pixel_values, patches)
    assert mine.num_tokens == 16 and mine.grid_thw == (1, 4, 4)


def test_encoder_matches_hf(ckpt, hf, processor, vision):
    from engine.loader.safetensors import load_safetensors
    from engine.models.gemma3_vl import _checkpoint_names
    from engine.vision.gemma3_encoder import Gemma3VisionEncoder
    from pyx.cpu_backend import CpuBackend
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    encoder = Gemma3VisionEncoder(vision, weights, CpuBackend())
    for size in [(40, 30), (23, 17)]:
        image = sample_image(*size, seed=1)
        pixels = hf[1].image_processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            ref = hf[0].model.get_image_features(pixels).pooler_output[0].numpy()
        mine = encoder.encode(processor.preprocess(image).pixel_values, (1, 4, 4))
        np.testing.assert_allclose(mine, ref, atol=5e-5 * np.abs(ref).max())


def test_prompt_text_expansion_equals_hf_processor(ckpt, hf):
    """The server's prompt (template rendered, each <start_of_image> expanded in the text with
    its newlines, then tokenized) is transformers' processor's input_ids; expanding after
    tokenizing would not be (the newlines merge with their neighbours)."""
    from engine.text.tokenizer import Tokenizer
    from engine.models.model_config import ModelConfig
    from server.media import text_expander
    tok = Tokenizer.from_pretrained(ckpt)
    vision = ModelConfig.from_pretrained(ckpt).vision
    for name in CASES:
        parts, images = case(name)
        ids = tok.encode_chat(messages(parts), rewrite=text_expander(vision, tok))
        assert ids == hf_inputs(hf, parts, images)["input_ids"][0].tolist()
    plain = tok.encode_chat(messages(CASES["one image"][0]))
    boi = plain.index(vision.boi_token_id)
    naive = plain[:boi] + tok.encode("\n\n", add_special_tokens=False) + [vision.boi_token_id] \
        + [vision.image_token_id] * 16 + [vision.eoi_token_id] \
        + tok.encode("\n\n", add_special_tokens=False) + plain[boi + 1:]
    assert naive != ids


# ---- generation against transformers

def engine_prompt(hf, processor, parts, images):
    ids = hf_inputs(hf, parts, images)["input_ids"][0].tolist()
    return ids, [processor.preprocess(im) for im in images]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("budget", [2048, 20])
def test_greedy_matches_hf_generate(ckpt, hf, processor, name, budget):
    """The engine's greedy tokens are transformers' (up to its first near-tie), the prompt in one
    step, or in chunks of at most 20 tokens (which stop before a 16-token image they would cut)."""
    parts, images = case(name)
    inputs = hf_inputs(hf, parts, images)
    tokens, trusted = hf_generate(hf, inputs)
    assert trusted >= 8, f"reference near-tie at token {trusted}"
    ids, processed = engine_prompt(hf, processor, parts, images)
    engine = make_engine(ckpt, max_num_batched_tokens=budget)
    seq = run(engine, ids, processed, GEN)
    assert seq.output_token_ids[:trusted] == tokens[:trusted]
    assert engine.runner.vision.num_encoded == len(images)
    if budget < len(ids):
        assert engine.scheduler.encoder_budget.num_cut >= 1


def test_features_change_the_tokens(hf):
    """The test above can fail: transformers' tokens differ without the bidirectional image
    mask, and with another image."""
    from PIL import ImageOps
    for name in CASES:
        parts, images = case(name)
        tokens, _ = hf_generate(hf, hf_inputs(hf, parts, images))
        assert hf_generate(hf, hf_inputs(hf, parts, images), bidirectional=False)[0] != tokens
        other = [ImageOps.invert(images[0])] + images[1:]
        assert hf_generate(hf, hf_inputs(hf, parts, other))[0] != tokens


@pytest.mark.parametrize("name", list(CASES))
def test_bidirectional_overlay_is_what_matches(ckpt, hf, processor, name, monkeypatch):
    """With the overlay doing nothing the engine's tokens are transformers' causal ones
    (token_type_ids left out), not its bidirectional ones."""
    parts, images = case(name)
    inputs = hf_inputs(hf, parts, images)
    ids, processed = engine_prompt(hf, processor, parts, images)
    engine = make_engine(ckpt)
    monkeypatch.setattr(engine.model._image_blocks, "apply", lambda *args: None)
    seq = run(engine, ids, processed, GEN)
    causal, trusted = hf_generate(hf, inputs, bidirectional=False)
    assert seq.output_token_ids[:trusted] == causal[:trusted]
    assert seq.output_token_ids != hf_generate(hf, inputs)[0]


def test_images_stay_whole_in_chunks(ckpt, hf, processor, caplog):
    """A chunk never ends inside an image: with a budget of 20 tokens the first chunk stops
    before the image, the next computes it whole. With the rule off, the runner refuses the
    step that would split it (the request fails, it is not answered wrongly)."""
    parts, images = case("one image")
    ids, processed = engine_prompt(hf, processor, parts, images)
    engine = make_engine(ckpt, max_num_batched_tokens=20)
    seq = engine.add_request("r", ids, __import__("engine").SamplingParams(
        max_tokens=GEN, temperature=0, ignore_eos=True), images=processed)
    engine.step()
    image = seq.mm.images[0]
    assert seq.num_computed_tokens == image.offset
    engine.step()
    assert seq.num_computed_tokens >= image.end
    engine = make_engine(ckpt, max_num_batched_tokens=20)
    engine.scheduler.encoder_budget.whole_images = False
    seq = run(engine, ids, processed, GEN)
    assert seq.is_finished and seq.output_token_ids == []
    assert "a prefill chunk ends inside image 0" in caplog.text


def test_step_too_small_for_an_image_or_fp8_cache(ckpt):
    with pytest.raises(ValueError, match="an image is 16 tokens"):
        make_engine(ckpt, max_num_batched_tokens=12, max_num_seqs=4)
    with pytest.raises(ValueError, match="an FP8 KV cache is not supported"):
        make_engine(ckpt, kv_cache_dtype="fp8")


# ---- the prefix cache

def test_prefix_cache_keys_hold_the_image(ckpt, hf, processor):
    """Same image and text: the second request's prompt blocks come from the cache; the same
    image and other text after it: a hit that ends inside the image, whose remaining tokens
    still see the whole image (transformers' tokens); one pixel changed: no block past the
    image's first is shared, and the tokens are transformers'."""
    parts, images = case("one image")
    other = one_pixel_changed(images[0])
    ids, a = engine_prompt(hf, processor, parts, images)
    b = [processor.preprocess(images[0])]
    c = [processor.preprocess(other)]
    assert a[0].content_hash == b[0].content_hash != c[0].content_hash
    engine = make_engine(ckpt)
    first = run(engine, ids, a, GEN, request_id="a")
    again = run(engine, ids, b, GEN, request_id="b")
    image = first.mm.images[0]
    bs = engine.block_pool.block_size
    assert again.num_cached_tokens == (len(ids) - 1) // bs * bs > image.offset
    assert again.output_token_ids == first.output_token_ids
    longer = parts + ["Then say which one is brighter."]
    ids2, d = engine_prompt(hf, processor, longer, images)
    inside = run(engine, ids2, d, GEN, request_id="d")
    assert image.offset < inside.num_cached_tokens < image.end
    tokens, trusted = hf_generate(hf, hf_inputs(hf, longer, images))
    assert trusted >= 8 and inside.output_token_ids[:trusted] == tokens[:trusted]
    changed_seq = run(engine, ids, c, GEN, request_id="c")
    assert changed_seq.num_cached_tokens == image.offset // bs * bs
    tokens, trusted = hf_generate(hf, hf_inputs(hf, parts, [other]))
    assert changed_seq.output_token_ids[:trusted] == tokens[:trusted]


def test_backend_without_tower_ops_is_refused(ckpt):
    """Loading refuses a backend whose class leaves an op the SigLIP tower needs to the op
    table's base class, naming the missing ones (CUDA has them: tests/test_cuda_host.py; the
    tower and overlay on CUDA: tests/gpu/test_cuda_vision.py)."""
    from engine.models.gemma3_vl import Gemma3ForConditionalGeneration

    class NoLayerNorm(BareBackend):
        def encoder_attention(self, out, q, k, v, cu_seqlens, scale):
            pass
    check_backends_refused(Gemma3ForConditionalGeneration, ckpt, [
        (BareBackend(), "the bare backend has no encoder_attention and layer_norm and "
                        "fused_add_layer_norm ops"),
        (NoLayerNorm(), "has no layer_norm and fused_add_layer_norm ops, which the SigLIP")])


# ---- the hub's files

# google/gemma-3-4b-it's config.json: text_config relies on Gemma3TextConfig's defaults
HUB_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "mm_tokens_per_image": 256, "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_hub_config_reads_as_transformers():
    from transformers import Gemma3Config
    from engine.models.model_config import ModelConfig
    c = ModelConfig.from_dict(HUB_CONFIG)
    ref = Gemma3Config(**HUB_CONFIG)
    t = ref.text_config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size,
            c.query_pre_attn_scalar, c.rms_norm_eps, c.tie_word_embeddings) == (
        t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.vocab_size,
        t.query_pre_attn_scalar, t.rms_norm_eps, t.tie_word_embeddings)
    assert c.sliding_windows == [t.sliding_window if k == "sliding_attention" else 0
                                 for k in t.layer_types]
    assert (c.rope.rope_type, c.rope.factor, c.rope.theta, c.local_rope.theta) == (
        "linear", 8.0, 1e6, 1e4)
    v = c.vision
    assert (v.hidden_size, v.num_layers, v.num_heads, v.image_size, v.patch_size,
            v.mm_tokens_per_image, v.pool, v.text_hidden_size, v.image_token_id) == (
        1152, 27, 16, 896, 14, 256, 4, 2560, ref.image_token_id)


def test_checkpoint_names():
    """The hub's files, transformers 5's in-memory names and its saves all map to one set."""
    from engine.models.gemma3_vl import _checkpoint_names
    names = {"language_model.model.layers.0.mlp.up_proj.weight":
             "model.layers.0.mlp.up_proj.weight",
             "language_model.lm_head.weight": "lm_head.weight",
             "vision_tower.vision_model.post_layernorm.bias": "vision_tower.post_layernorm.bias",
             "model.language_model.norm.weight": "model.norm.weight",
             "model.vision_tower.encoder.layers.0.mlp.fc1.bias":
                 "vision_tower.encoder.layers.0.mlp.fc1.bias",
             "model.multi_modal_projector.mm_soft_emb_norm.weight":
                 "multi_modal_projector.mm_soft_emb_norm.weight",
             "multi_modal_projector.mm_input_projection_weight":
                 "multi_modal_projector.mm_input_projection_weight"}
    weights = dict.fromkeys(names)
    _checkpoint_names(weights)
    assert sorted(weights) == sorted(names.values())


# ---- the overlay against a dense float64 mask

@pytest.mark.parametrize("window, softcap, paged", [(0, 0.0, False), (5, 0.0, False),
                                                    (5, 3.0, False), (0, 0.0, True),
                                                    (0, 3.0, True), (5, 3.0, True)])
def test_overlay_equals_dense_masked_attention(window, softcap, paged):
    """Image rows recomputed from a paged cache (blocks out of order, GQA 4:2): each query at p
    in an image [start, end) sees keys (p - W, end) (all of [0, end) without a window), as a
    dense masked softmax in float64 says; text rows are left alone. One image starts in an
    earlier step (its first rows are cached, a prefix-cache hit inside it). paged: with a
    backend's paged op taking the full-attention layers (as on CUDA), here the CPU's."""
    from engine.vision.gemma3_attention import ImageBlockAttention, ImageSpan
    rng = np.random.default_rng(0)
    Hq, Hkv, D, bs = 4, 2, 8, 4
    seq_len, computed = 30, 10                  # rows 10..29 this step
    images = [(7, 15), (20, 26)]                # the first started before this step
    blocks = rng.permutation(16)[:8]
    k_cache = rng.standard_normal((16, bs, Hkv, D)).astype(np.float32)
    v_cache = rng.standard_normal((16, bs, Hkv, D)).astype(np.float32)
    T = seq_len - computed
    q = rng.standard_normal((T, Hq * D)).astype(np.float32)
    attn = rng.standard_normal((T, Hq * D)).astype(np.float32)
    before = attn.copy()
    spans = [ImageSpan(0, max(a, computed) - computed, max(a, computed), e) for a, e in images]

    class Batch:
        vision = type("V", (), {"spans": spans})()
        block_tables = blocks[None, :].astype(np.int32)
    from pyx.cpu_backend import CpuBackend
    overlay = ImageBlockAttention(np, CpuBackend() if paged else None)
    overlay.apply(Batch, q, attn, k_cache, v_cache, 0.3, window, softcap)

    K = k_cache[blocks].reshape(-1, Hkv, D)[:seq_len].astype(np.float64)
    V = v_cache[blocks].reshape(-1, Hkv, D)[:seq_len].astype(np.float64)
    image_rows = set()
    for a, e in images:
        for p in range(max(a, computed), e):
            j = np.arange(seq_len)
            mask = j < e
            if window:
                mask &= j > p - window
            row = p - computed
            image_rows.add(row)
            for h in range(Hq):
                s = K[:, h // 2] @ q[row, h * D:(h + 1) * D].astype(np.float64) * 0.3
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(np.where(mask, s, -np.inf) - s[mask].max())
                want = (w / w.sum()) @ V[:, h // 2]
                np.testing.assert_allclose(attn[row, h * D:(h + 1) * D], want, atol=2e-5)
    text_rows = [r for r in range(T) if r not in image_rows]
    assert np.array_equal(attn[text_rows], before[text_rows])

"""Vision encoders on CUDA (issue 33): the gelu and encoder_attention ops (cuda/vision.cu) against
the CPU backend's (pyx/cpu_vision.py), and tiny Qwen2.5-VL, Qwen3-VL, Mistral 3 and Gemma 3
checkpoints (tests/vision_checkpoint.py, tests/qwen3_vl_checkpoint.py,
tests/mistral3_checkpoint.py, tests/gemma3_vision_checkpoint.py) whose vision towers and greedy
tokens on CUDA equal the CPU's for messages with images; Gemma 3's image-attention overlay
(engine/vision/gemma3_attention.py) on device arrays against the same overlay in NumPy.

Ops: inputs rounded to the activation dtype (f32, bf16, f16), the CPU op on the same values in
f32, tolerances as tests/gpu/test_cuda_ops.py (outputs poisoned with NaN first). GELU also on
the negative tail, where 1 + erf(x) would cancel to zero; attention over segment layouts a ViT
makes (one image, many windows with one cut by the image's edge, uneven lengths with an empty
and a one-row segment, one segment past many key tiles, 600 segments of 0 to 3 rows) and the
head dims real towers use (64, 80 = Qwen2.5-VL's 1280 / 16, 128, and 256, the kernel's widest);
and at a real image's size in Qwen2.5-VL's heads.

Models: the tower's embeddings (and Qwen3-VL's DeepStack features) on CUDA against the same
tower on the CPU; greedy tokens of the CUDA engine (f32 and bf16 activations, chunked prefill
that cuts the image's run, decode through CUDA graphs) against the CPU engine's, compared up to
transformers' first near-tie at that precision (the CPU engine equals transformers there:
tests/test_vision.py, tests/test_vision_qwen3.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_ops import ACT, TOL, assert_close, dtype_name, nan_dev, rand, to_dev, to_host

# ---- gelu


@pytest.mark.parametrize("shape", [(7, 33), (64, 1280)])   # single elements, then 16-byte packs
def test_gelu(cuda, cpu, shape):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(shape[1])
    x = rand(rng, shape, dt, scale=3.0)
    want = np.empty(shape, np.float32)
    cpu.gelu(x.astype(np.float32), want)
    out = nan_dev(cuda, shape, ACT[dt])
    cuda.gelu(to_dev(cuda, x), out)
    assert_close(to_host(cuda, out), want, TOL[dt], f"gelu {dt} {shape}")
    inplace = to_dev(cuda, x)                 # out may be x
    cuda.gelu(inplace, inplace)
    assert np.array_equal(to_host(cuda, inplace), to_host(cuda, out))


def test_gelu_negative_tail(cuda_f32, cpu):
    """Each element to 1e-5 relative down to x = -12 (values near -1e-32): 0.5 x (1 + erf(x /
    sqrt 2)) would give 0 from about x = -5.5 on."""
    x = -np.linspace(0.0, 12.0, 4096, dtype=np.float32).reshape(32, 128)
    want = np.empty_like(x)
    cpu.gelu(x, want)
    out = nan_dev(cuda_f32, x.shape, np.float32)
    cuda_f32.gelu(to_dev(cuda_f32, x), out)
    got = to_host(cuda_f32, out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-37)


# ---- encoder_attention

LAYOUTS = {
    "one image": [300],
    "windows": [64] * 9 + [40],                 # Qwen2.5-VL's windows, the last cut by the edge
    "uneven": [1, 17, 0, 64, 3, 130, 33],       # an empty segment and a one-row one among them
    "long": [1100],                             # past many key tiles and query tiles
    "tiny": [i % 4 for i in range(600)],        # 600 segments of 0 to 3 rows: the tile walk
}


def attention_inputs(rng, lengths, H, D, dt):
    N = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = rand(rng, (N, H, D), dt, scale=2.0)     # peaked softmax rows, as trained towers have
    k, v = rand(rng, (N, H, D), dt), rand(rng, (N, H, D), dt)
    return q, k, v, cu


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("D", [64, 80, 128, 256])
def test_encoder_attention(cuda, cpu, layout, D):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(D)
    H = 3
    q, k, v, cu = attention_inputs(rng, LAYOUTS[layout], H, D, dt)
    scale = D ** -0.5
    want = np.full(q.shape, np.nan, np.float32)
    cpu.encoder_attention(want, *(a.astype(np.float32) for a in (q, k, v)), cu, scale)
    out = nan_dev(cuda, q.shape, ACT[dt])
    cuda.encoder_attention(out, to_dev(cuda, q), to_dev(cuda, k), to_dev(cuda, v),
                           to_dev(cuda, cu), scale)
    assert_close(to_host(cuda, out), want, TOL[dt], f"encoder_attention {layout} D={D} {dt}")


@pytest.mark.parametrize("layout", ["windows", "whole"])
def test_encoder_attention_qwen2_5_vl_size(cuda_bf16, cpu, layout):
    """A 896 x 896 image's 4096 patches in Qwen2.5-VL's heads (16 of 80): its 64 windows of 64
    rows, and the full-attention blocks' one segment."""
    rng = np.random.default_rng(7)
    lengths = [64] * 64 if layout == "windows" else [4096]
    q, k, v, cu = attention_inputs(rng, lengths, 16, 80, "bf16")
    want = np.empty(q.shape, np.float32)
    cpu.encoder_attention(want, *(a.astype(np.float32) for a in (q, k, v)), cu, 80 ** -0.5)
    out = nan_dev(cuda_bf16, q.shape, ACT["bf16"])
    cuda_bf16.encoder_attention(out, to_dev(cuda_bf16, q), to_dev(cuda_bf16, k),
                                to_dev(cuda_bf16, v), to_dev(cuda_bf16, cu), 80 ** -0.5)
    assert_close(to_host(cuda_bf16, out), want, TOL["bf16"], f"encoder_attention {layout}")


def test_encoder_attention_segments_are_separate(cuda_f32, cpu):
    """The comparison above can fail: the same rows as one segment give other outputs."""
    rng = np.random.default_rng(1)
    q, k, v, cu = attention_inputs(rng, LAYOUTS["windows"], 2, 80, "f32")
    whole = np.array([0, q.shape[0]], np.int32)
    outs = []
    for segments in (cu, whole):
        out = nan_dev(cuda_f32, q.shape, np.float32)
        cuda_f32.encoder_attention(out, to_dev(cuda_f32, q), to_dev(cuda_f32, k),
                                   to_dev(cuda_f32, v), to_dev(cuda_f32, segments), 80 ** -0.5)
        outs.append(to_host(cuda_f32, out))
    assert np.abs(outs[0] - outs[1]).max() > 0.1


def test_encoder_attention_bad_shapes_raise(cuda_bf16):
    b = cuda_bf16
    q = to_dev(b, np.zeros((8, 2, 512), ACT["bf16"]))
    cu = to_dev(b, np.array([0, 8], np.int32))
    with pytest.raises(ValueError, match="encoder_attention: the kernel takes head_dim <= 256"):
        b.encoder_attention(q, q, q, q, cu, 0.1)
    q = to_dev(b, np.zeros((8, 2, 64), ACT["bf16"]))
    k = to_dev(b, np.zeros((7, 2, 64), ACT["bf16"]))
    with pytest.raises(ValueError, match="encoder_attention: need out, q, k, v of one shape"):
        b.encoder_attention(q, q, k, k, cu, 0.1)
    with pytest.raises(ValueError, match="gelu: x has dtype float32"):
        b.gelu(to_dev(b, np.zeros((2, 8), np.float32)), to_dev(b, np.zeros((2, 8), np.float32)))


# ---- the towers and the engine on tiny checkpoints

IMAGE_SIZES = [(40, 56), (23, 17), (48, 48)]
# The towers' embeddings against the CPU's. bf16: the CPU backend with each op's activations
# rounded to bf16 gives 4e-3 to 5e-3 on these images (tests/test_vision_act_dtype.py).
TOWER_TOL = {"f32": 1e-3, "bf16": 3e-2}
CASES = {
    "one image": (["What is in this picture?", None, " Describe it."], [(40, 56)]),
    "two images": ([None, "Compare the two images:", None, "which one is brighter?"],
                   [(23, 31), (48, 40)]),
}
# Tokens compared up to transformers' first top-two log-prob gap under this, per activation
# dtype: f32 differs from the CPU by summation order, bf16 by its rounding (test_cuda_model.py).
# At least MIN_COMPARED of them: the gaps of these prompts, on the CPU, are 0.007 and more, all
# ten tokens in f32; under 0.05 as early as the second token, so bf16 has no minimum (its
# numerics are the tower test's and test_cuda_model.py's; here it runs the whole path).
TIE = {"f32": 1e-3, "bf16": 0.05}
MIN_COMPARED = {"f32": 6, "bf16": 0}
GEN = 10


def tower_weights(ckpt) -> dict:
    """The checkpoint's tensors under the names the towers read (visual.*)."""
    from engine.loader.safetensors import load_safetensors
    from engine.models.qwen2_5_vl import _checkpoint_names
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    return weights


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (checkpoint, (transformers model, image processor, tokenizer), our processor,
    tower class)."""
    torch = pytest.importorskip("torch")
    made = {}

    def get(family: str):
        if family in made:
            return made[family]
        import transformers
        from qwen3_vl_checkpoint import tiny_qwen3_vl_checkpoint
        from vision_checkpoint import tiny_vl_checkpoint

        from engine.models.model_config import ModelConfig
        from engine.vision.config import ImageProcessorConfig
        from engine.vision.qwen2_5_vl_encoder import Qwen25VisionEncoder
        from engine.vision.qwen3_vl_encoder import Qwen3VisionEncoder
        root = tmp_path_factory.mktemp(family)
        if family == "qwen2_5_vl":
            ckpt, hf_class, tower = (tiny_vl_checkpoint(root),
                                     transformers.Qwen2_5_VLForConditionalGeneration,
                                     Qwen25VisionEncoder)
        else:
            moe = family == "qwen3_vl_moe"
            ckpt = tiny_qwen3_vl_checkpoint(root, moe=moe)
            hf_class = (transformers.Qwen3VLMoeForConditionalGeneration if moe
                        else transformers.Qwen3VLForConditionalGeneration)
            tower = Qwen3VisionEncoder
        model = hf_class.from_pretrained(ckpt, dtype=torch.float32).eval()
        hf = (model, transformers.Qwen2VLImageProcessorPil.from_pretrained(ckpt),
              transformers.AutoTokenizer.from_pretrained(ckpt))
        processor = ImageProcessorConfig.from_pretrained(ckpt,
                                                         ModelConfig.from_pretrained(ckpt).vision)
        made[family] = ckpt, hf, processor, tower
        return made[family]
    return get


FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]


@pytest.mark.parametrize("family", FAMILIES[:2])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_tower_matches_cpu(families, make_cuda, cpu, family, dt):
    from vision_checkpoint import sample_image

    from engine.models.model_config import ModelConfig
    from engine.vision.preprocess import preprocess_image
    ckpt, _, processor, tower_class = families(family)
    vision = ModelConfig.from_pretrained(ckpt).vision
    cuda = make_cuda(dt)
    towers = [tower_class(vision, tower_weights(ckpt), b) for b in (cpu, cuda)]
    for size in IMAGE_SIZES:
        image = preprocess_image(sample_image(*size, seed=1), processor)
        want = towers[0].encode(image.pixel_values, image.grid_thw)
        got = to_host(cuda, towers[1].encode(image.pixel_values, image.grid_thw))
        assert got.dtype == np.float32 and got.shape == want.shape
        assert_close(got, want, TOWER_TOL[dt], f"{family} tower {dt} image {size}")


def hf_margins(hf, ids, images, n: int = GEN):
    """transformers' greedy tokens and each step's top-two log-prob gap."""
    import torch
    model, ip, _ = hf
    out = ip(images=images, return_tensors="pt")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        g = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                           pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                           max_new_tokens=n, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    margins = []
    for s in g.scores:
        top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return g.sequences[0, len(ids):].tolist(), np.array(margins)


def engine_tokens(ckpt, ids, processed, **config):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from vision_oracle import run
    # four sequences at most: few decode graphs to capture
    engine = LLMEngine(EngineConfig(model=ckpt, kv_cache_memory_mb=16, async_scheduling=False,
                                    max_num_batched_tokens=32, max_num_seqs=4, **config))
    seq = run(engine, ids, processed, n=GEN)
    assert engine.runner.vision.num_encoded == len(processed)   # once each, chunks or not
    return list(seq.output_token_ids)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_cpu(families, family, case):
    from vision_checkpoint import sample_image
    from vision_oracle import prompt_ids

    from engine.vision.preprocess import preprocess_image
    ckpt, hf, processor, _ = families(family)
    parts, sizes = CASES[case]
    images = [sample_image(*s, seed=i + 5) for i, s in enumerate(sizes)]
    processed = [preprocess_image(im, processor) for im in images]
    ids = prompt_ids(hf, parts, processed)
    reference, margins = hf_margins(hf, ids, images)
    cpu = engine_tokens(ckpt, ids, processed, backend="cpu")
    trusted = int(np.argmax(margins < 1e-4)) if (margins < 1e-4).any() else GEN
    assert cpu[:trusted] == reference[:trusted], "the CPU engine parts from transformers"
    for dt in ("f32", "bf16"):
        got = engine_tokens(ckpt, ids, processed, backend="cuda", dtype=dt)
        low = np.flatnonzero(margins < TIE[dt])
        n = int(low[0]) if low.size else GEN
        assert n >= MIN_COMPARED[dt], f"{family} {case}: margins {np.round(margins, 3)}"
        assert got[:n] == cpu[:n], (f"{family} {case} {dt}: cuda {got} vs cpu {cpu}, equal up "
                                    f"to token {n}; margins {np.round(margins, 3).tolist()}")


# ---- Mistral 3: the Pixtral tower and projector, plain RoPE in the language model

@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    """(checkpoint, (transformers model, image processor, tokenizer), our processor)."""
    torch = pytest.importorskip("torch")
    import transformers
    from mistral3_checkpoint import tiny_mistral3_checkpoint

    from engine.models.model_config import ModelConfig
    from engine.vision.families import image_processor
    ckpt = tiny_mistral3_checkpoint(tmp_path_factory.mktemp("mistral3"))
    hf = (transformers.Mistral3ForConditionalGeneration.from_pretrained(
              ckpt, dtype=torch.float32).eval(),
          transformers.PixtralImageProcessorPil.from_pretrained(ckpt),
          transformers.AutoTokenizer.from_pretrained(ckpt))
    return ckpt, hf, image_processor(ckpt, ModelConfig.from_pretrained(ckpt).vision)


def mistral3_weights(ckpt) -> dict:
    from engine.loader.safetensors import load_safetensors
    from engine.models.mistral3 import _checkpoint_names
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    return weights


@pytest.mark.parametrize("hidden_act", ["silu", "gelu"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_pixtral_tower_matches_cpu(mistral3, make_cuda, cpu, dt, hidden_act):
    """The tower's rows (break rows zero) on CUDA against the CPU's; gelu: the tiny checkpoint's
    MLP run as a gelu one (the tower's other branch)."""
    import dataclasses

    from vision_checkpoint import sample_image

    from engine.models.model_config import ModelConfig
    from engine.vision.families import preprocess
    from engine.vision.pixtral_encoder import PixtralVisionEncoder
    ckpt, _, processor = mistral3
    vision = dataclasses.replace(ModelConfig.from_pretrained(ckpt).vision, hidden_act=hidden_act)
    cuda = make_cuda(dt)
    towers = [PixtralVisionEncoder(vision, mistral3_weights(ckpt), b) for b in (cpu, cuda)]
    for size in IMAGE_SIZES:
        image = preprocess(sample_image(*size, seed=1), processor)
        want = towers[0].encode(image.pixel_values, image.grid_thw)
        got = to_host(cuda, towers[1].encode(image.pixel_values, image.grid_thw))
        assert got.dtype == np.float32 and got.shape == want.shape
        assert not got[~want.any(1)].any(), "a break row is not zero"
        assert_close(got, want, TOWER_TOL[dt], f"pixtral tower {hidden_act} {dt} image {size}")


def mistral3_margins(hf, ids, images, n: int = GEN):
    """transformers' greedy tokens and each step's top-two log-prob gap."""
    import torch
    from test_vision_mistral3 import hf_pixels
    input_ids = torch.tensor([ids])
    out = hf_pixels(hf, images)
    with torch.no_grad():
        g = hf[0].generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
                           max_new_tokens=n, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    margins = []
    for s in g.scores:
        top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return g.sequences[0, len(ids):].tolist(), np.array(margins)


@pytest.mark.parametrize("case", list(CASES))
def test_mistral3_greedy_matches_cpu(mistral3, case):
    from test_vision_mistral3 import prompt_ids
    from vision_checkpoint import sample_image

    from engine.vision.families import preprocess
    ckpt, hf, processor = mistral3
    parts, sizes = CASES[case]
    images = [sample_image(*s, seed=i + 5) for i, s in enumerate(sizes)]
    processed = [preprocess(im, processor) for im in images]
    ids = prompt_ids(hf, parts, processed)
    reference, margins = mistral3_margins(hf, ids, images)
    cpu = engine_tokens(ckpt, ids, processed, backend="cpu")
    trusted = int(np.argmax(margins < 1e-4)) if (margins < 1e-4).any() else GEN
    assert cpu[:trusted] == reference[:trusted], "the CPU engine parts from transformers"
    for dt in ("f32", "bf16"):
        got = engine_tokens(ckpt, ids, processed, backend="cuda", dtype=dt)
        low = np.flatnonzero(margins < TIE[dt])
        n = int(low[0]) if low.size else GEN
        assert n >= MIN_COMPARED[dt], f"mistral3 {case}: margins {np.round(margins, 3)}"
        assert got[:n] == cpu[:n], (f"mistral3 {case} {dt}: cuda {got} vs cpu {cpu}, equal up "
                                    f"to token {n}; margins {np.round(margins, 3).tolist()}")


# ---- Gemma 3: the SigLIP tower and projector, the image tokens' bidirectional overlay

@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(checkpoint, (transformers model, processor), our processor)."""
    torch = pytest.importorskip("torch")
    import transformers
    from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint

    from engine.models.model_config import ModelConfig
    from engine.vision.families import image_processor
    ckpt = tiny_gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3v"))
    hf = (transformers.Gemma3ForConditionalGeneration.from_pretrained(
              ckpt, dtype=torch.float32).eval(),
          transformers.AutoProcessor.from_pretrained(ckpt))
    return ckpt, hf, image_processor(ckpt, ModelConfig.from_pretrained(ckpt).vision)


def gemma3_weights(ckpt) -> dict:
    from engine.loader.safetensors import load_safetensors
    from engine.models.gemma3_vl import _checkpoint_names
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    return weights


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_siglip_tower_matches_cpu(gemma3, make_cuda, cpu, dt):
    from vision_checkpoint import sample_image

    from engine.models.model_config import ModelConfig
    from engine.vision.gemma3_encoder import Gemma3VisionEncoder
    ckpt, _, processor = gemma3
    vision = ModelConfig.from_pretrained(ckpt).vision
    cuda = make_cuda(dt)
    towers = [Gemma3VisionEncoder(vision, gemma3_weights(ckpt), b) for b in (cpu, cuda)]
    for size in IMAGE_SIZES:
        pixels = processor.preprocess(sample_image(*size, seed=1)).pixel_values
        want = towers[0].encode(pixels, (1, 4, 4))
        got = to_host(cuda, towers[1].encode(pixels, (1, 4, 4)))
        assert got.dtype == np.float32 and got.shape == want.shape
        assert_close(got, want, TOWER_TOL[dt], f"siglip tower {dt} image {size}")


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (0, 3.0), (5, 0.0), (5, 3.0)])
def test_image_overlay_matches_cpu(cuda, window, softcap, paged):
    """The overlay over a device cache and activations in the backend's dtype (blocks out of
    order, GQA 4:2, an image begun in an earlier step) against the float32 overlay in NumPy on
    the same values (itself against a dense mask: tests/test_gemma3_vision.py); text rows
    untouched. paged: the full-attention layers through the paged op, as the model runs them
    on CUDA."""
    from engine.vision.gemma3_attention import ImageBlockAttention, ImageSpan
    dt = dtype_name(cuda)
    rng = np.random.default_rng(0)
    Hq, Hkv, D, bs, T = 4, 2, 64, 16, 40
    caches = [rand(rng, (16, bs, Hkv, D), dt) for _ in range(2)]
    q, attn = rand(rng, (T, Hq * D), dt), rand(rng, (T, Hq * D), dt)
    tables = rng.permutation(16).astype(np.int32)[None, :8]
    spans = [ImageSpan(0, 0, 60, 75), ImageSpan(0, 20, 80, 100)]

    def batch(block_tables):
        return type("B", (), {"vision": type("V", (), {"spans": spans})(),
                              "block_tables": block_tables})
    want = attn.astype(np.float32)
    ImageBlockAttention(np).apply(batch(tables), q.astype(np.float32), want,
                                  *(c.astype(np.float32) for c in caches), 0.125, window, softcap)
    got = to_dev(cuda, attn)
    overlay = ImageBlockAttention(cuda.xp, cuda if paged else None)
    overlay.apply(batch(to_dev(cuda, tables)), to_dev(cuda, q), got,
                  *(to_dev(cuda, c) for c in caches), 0.125, window, softcap)
    got = to_host(cuda, got)
    image_rows, text_rows = np.r_[0:15, 20:40], np.r_[15:20]
    assert_close(got[image_rows], want[image_rows], TOL[dt], f"overlay {dt} W={window}")
    assert np.array_equal(got[text_rows].view(np.uint8), attn[text_rows].view(np.uint8))


def gemma3_margins(hf, parts, images, n: int = GEN):
    """transformers' greedy tokens, each step's top-two log-prob gap, and the prompt's ids."""
    import torch
    from test_gemma3_vision import hf_inputs
    inputs = dict(hf_inputs(hf, parts, images))
    with torch.no_grad():
        g = hf[0].generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    ids = inputs["input_ids"][0].tolist()
    margins = []
    for s in g.scores:
        top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return g.sequences[0, len(ids):].tolist(), np.array(margins), ids


@pytest.mark.parametrize("case", ["one image", "two images"])
def test_gemma3_greedy_matches_cpu(gemma3, case):
    """Chunks of 32 tokens (an image is never cut: each 16-token image finishes in its
    chunk), the overlay on every step that holds image rows, decodes through CUDA graphs."""
    from test_gemma3_vision import case as gemma3_case
    ckpt, hf, processor = gemma3
    parts, images = gemma3_case(case)
    reference, margins, ids = gemma3_margins(hf, parts, images)
    processed = [processor.preprocess(im) for im in images]
    cpu = engine_tokens(ckpt, ids, processed, backend="cpu")
    trusted = int(np.argmax(margins < 1e-4)) if (margins < 1e-4).any() else GEN
    assert cpu[:trusted] == reference[:trusted], "the CPU engine parts from transformers"
    for dt in ("f32", "bf16"):
        got = engine_tokens(ckpt, ids, processed, backend="cuda", dtype=dt)
        low = np.flatnonzero(margins < TIE[dt])
        n = int(low[0]) if low.size else GEN
        assert n >= MIN_COMPARED[dt], f"gemma3 {case}: margins {np.round(margins, 3)}"
        assert got[:n] == cpu[:n], (f"gemma3 {case} {dt}: cuda {got} vs cpu {cpu}, equal up "
                                    f"to token {n}; margins {np.round(margins, 3).tolist()}")

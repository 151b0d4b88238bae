"""Qwen3-VL through the engine (issue 33), dense and MoE, on tiny random checkpoints written by
transformers (tests/qwen3_vl_checkpoint.py): the image processor's pixels, the vision tower's
embeddings and DeepStack features, greedy tokens for prompts with one and two images against
transformers' generate, the interleaved M-RoPE sections and positions against transformers', the
prefix cache keyed by image content, the MoE experts in both stacked layouts; and that the
comparisons can fail: transformers' own tokens change with DeepStack off or M-RoPE off."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from qwen3_vl_checkpoint import tiny_qwen3_vl_checkpoint, to_hub_expert_layout  # noqa: E402
from vision_checkpoint import sample_image  # noqa: E402
from vision_oracle import (  # noqa: E402
    CASES, BareBackend, case_images, check_backends_refused, check_greedy_case,
    check_mrope_positions, check_prefix_cache_keys, hf_generate, make_engine, one_pixel_changed,
    prompt_ids, run)

from engine.vision.config import ImageProcessorConfig  # noqa: E402
from engine.vision.preprocess import preprocess_image  # noqa: E402


def _hf_classes(moe: bool):
    import transformers
    return (transformers.Qwen3VLMoeForConditionalGeneration if moe
            else transformers.Qwen3VLForConditionalGeneration)


@pytest.fixture(scope="module", params=["dense", "moe"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """kind -> (checkpoint, (transformers model, image processor, tokenizer), our processor)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

            from engine.models.model_config import ModelConfig
            ckpt = tiny_qwen3_vl_checkpoint(tmp_path_factory.mktemp(f"qwen3vl_{kind}"),
                                            moe=kind == "moe")
            model = _hf_classes(kind == "moe").from_pretrained(ckpt, dtype=torch.float32).eval()
            hf = (model, Qwen2VLImageProcessorPil.from_pretrained(ckpt),
                  AutoTokenizer.from_pretrained(ckpt))
            processor = ImageProcessorConfig.from_pretrained(
                ckpt, ModelConfig.from_pretrained(ckpt).vision)
            cache[kind] = ckpt, hf, processor
        return cache[kind]
    return get


# ---- preprocessing and the vision tower

@pytest.mark.parametrize("size, mode", [((40, 56), "RGB"), ((23, 17), "RGBA"), ((300, 20), "P"),
                                        ((200, 150), "RGB")])
def test_pixels_equal_hf_processor(loaded, size, mode):
    """Qwen3-VL's processor config (mean and std 0.5, pixel limits as size's shortest_edge and
    longest_edge) read as transformers reads it: the same bits."""
    _, hf, processor = loaded("dense")
    image = sample_image(*size, seed=3, mode=mode)
    ref = hf[1](images=[image], return_tensors="np")
    mine = preprocess_image(image, processor)
    assert mine.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert np.array_equal(mine.pixel_values, ref["pixel_values"])


@pytest.mark.parametrize("act, mlp_rows", [("gelu_pytorch_tanh", None), ("gelu_pytorch_tanh", 7),
                                           ("gelu", 7)])
def test_encoder_and_deepstack_match_hf(loaded, tmp_path, monkeypatch, act, mlp_rows):
    """The merger's embeddings and each DeepStack feature, for grids of several shapes against
    the 4x4 learned position grid (interpolated up and down); the blocks' MLP with either GELU
    a vision_config may name, and in passes of a few rows (as a large image's)."""
    import json
    import shutil

    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    from engine.models.qwen2_5_vl import _checkpoint_names
    from engine.vision import qwen3_vl_encoder
    from engine.vision.qwen3_vl_encoder import Qwen3VisionEncoder
    from pyx.cpu_backend import CpuBackend
    if mlp_rows:
        monkeypatch.setattr(qwen3_vl_encoder, "MLP_ROWS", mlp_rows)
    ckpt, hf, _ = loaded("dense")
    if act != "gelu_pytorch_tanh":
        ckpt = shutil.copytree(ckpt, tmp_path / act)
        with open(ckpt / "config.json") as f:
            cfg = json.load(f)
        cfg["vision_config"]["hidden_act"] = act
        with open(ckpt / "config.json", "w") as f:
            json.dump(cfg, f)
        hf = (_hf_classes(False).from_pretrained(ckpt, dtype=torch.float32).eval(), hf[1])
    weights = load_safetensors(str(ckpt), progress=False)
    _checkpoint_names(weights)
    vision = ModelConfig.from_pretrained(str(ckpt)).vision
    assert vision.hidden_act == act
    encoder = Qwen3VisionEncoder(vision, weights, CpuBackend())
    H = vision.out_hidden_size
    for size in [(40, 56), (23, 17), (48, 48), (12, 40)]:
        out = hf[1](images=[sample_image(*size, seed=1)], return_tensors="pt")
        with torch.no_grad():
            ref = hf[0].model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        mine = encoder.encode(out["pixel_values"].numpy(),
                              tuple(out["image_grid_thw"][0].tolist()))
        parts = [ref.pooler_output[0]] + [f[0] for f in ref.deepstack_features]
        assert mine.shape == (parts[0].shape[0], 3 * H)
        for j, part in enumerate(parts):
            part = part.numpy()
            np.testing.assert_allclose(mine[:, j * H:(j + 1) * H], part,
                                       atol=5e-5 * np.abs(part).max(), err_msg=f"part {j}")


# ---- generation against transformers

@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf_generate(loaded, kind, name):
    """Chunked prefill (chunks of 32 tokens cut the images' runs), then decodes: transformers'
    tokens up to its first near-tie; each image encoded once."""
    ckpt, hf, processor = loaded(kind)
    check_greedy_case(ckpt, hf, lambda im: preprocess_image(im, processor), name)


def _last_logits(hf, ids, image, **kw):
    model = hf[0]
    out = hf[1](images=[image], return_tensors="pt")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=input_ids, pixel_values=out["pixel_values"],
                     image_grid_thw=out["image_grid_thw"],
                     mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                     **kw).logits[0, -1]


@pytest.mark.parametrize("feature", ["deepstack", "mrope"])
def test_features_change_transformers_tokens(loaded, kind, feature):
    """The comparisons above can fail: transformers' next-token logits move with DeepStack off
    (its features not added), and with M-RoPE off (every token's three positions its index)."""
    _, hf, processor = loaded(kind)
    parts, sizes = CASES["one image"]
    image = sample_image(*sizes[0], seed=5)
    ids = prompt_ids(hf, parts, [preprocess_image(image, processor)])
    ref = _last_logits(hf, ids, image)
    language_model = hf[0].model.language_model
    if feature == "deepstack":
        language_model._deepstack_process = lambda hidden, mask, embeds: hidden
        try:
            off = _last_logits(hf, ids, image)
        finally:
            del language_model._deepstack_process
    else:
        pos = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
        off = _last_logits(hf, ids, image, position_ids=pos)
    assert float((off - ref).abs().max()) > 0.1


def test_mrope_sections_are_interleaved_as_transformers(loaded):
    """Each rotary frequency's position (t, h or w) as Qwen3VLTextRotaryEmbedding recomposes
    them: a frequency table holding 0, 1, 2 for t, h, w comes out as our section map."""
    from engine.models.model_config import ModelConfig
    from engine.models.qwen2_5_vl import mrope_sections
    ckpt, hf, _ = loaded("dense")
    vision = ModelConfig.from_pretrained(ckpt).vision
    rotary = hf[0].model.language_model.rotary_emb
    half = sum(vision.mrope_section)
    marks = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, half).clone()
    recomposed = rotary.recomposition_frequencies(marks)[0, 0, :half].long().numpy()
    assert np.array_equal(mrope_sections(vision), recomposed)
    assert len(set(recomposed[:3])) == 3            # interleaved, not in runs


def test_mrope_positions_equal_get_rope_index(loaded):
    ckpt, hf, processor = loaded("dense")
    parts, sizes = CASES["two images"]
    processed = [preprocess_image(im, processor) for im in case_images(sizes, first_seed=0)]
    check_mrope_positions(ckpt, hf, processed, prompt_ids(hf, parts, processed))


# ---- caches

def test_prefix_cache_keys_hold_the_image(loaded):
    """Same image and text: the second request's prompt blocks come from the cache; one pixel
    changed: nothing past the image's first block is shared, and the tokens are
    transformers' for that image."""
    ckpt, hf, processor = loaded("dense")
    parts, sizes = CASES["one image"]
    image = sample_image(*sizes[0], seed=5)
    other = one_pixel_changed(image)
    a = [preprocess_image(image, processor)]
    b = [preprocess_image(image, processor)]
    c = [preprocess_image(other, processor)]
    ids = prompt_ids(hf, parts, a)
    check_prefix_cache_keys(ckpt, hf, ids, a, b, c, hf_generate(hf, ids, [other]))


# ---- MoE experts

def test_stacked_experts_in_both_layouts():
    """The hub's files stack experts as gate_up (E, H, 2I) and down (E, I, H), transformers 5
    saves (E, 2I, H) and (E, H, I): both give the same per-expert tensors; shapes that fit
    neither are refused by name."""
    from engine.models.qwen3_vl import _stacked_experts
    rng = np.random.default_rng(0)
    E, H, I = 3, 12, 5
    gate_up = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    down = rng.standard_normal((E, H, I)).astype(np.float32)
    p = "model.layers.0.mlp.experts."
    ours = {p + "gate_up_proj": gate_up, p + "down_proj": down}
    hub = {p + "gate_up_proj": gate_up.transpose(0, 2, 1).copy(),
           p + "down_proj": down.transpose(0, 2, 1).copy()}
    _stacked_experts(ours)
    _stacked_experts(hub)
    assert sorted(ours) == sorted(hub) and len(ours) == 3 * E
    for name in ours:
        assert np.array_equal(ours[name], hub[name]), name
    assert np.array_equal(ours[p + "1.up_proj.weight"], gate_up[1, I:])
    with pytest.raises(ValueError, match="does not match"):
        _stacked_experts({p + "gate_up_proj": gate_up, p + "down_proj": down[:, :, :4]})


def test_moe_checkpoint_in_the_hubs_layout(tmp_path):
    """A MoE checkpoint whose files stack the experts as the hub's do: the engine's tokens are
    still transformers' (which reads that layout too)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    from engine.models.model_config import ModelConfig
    ckpt = tiny_qwen3_vl_checkpoint(tmp_path / "hub", moe=True)
    to_hub_expert_layout(ckpt)
    from safetensors import safe_open
    with safe_open(f"{ckpt}/model.safetensors", "np") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() \
            == [4, 32, 96]
    hf = (_hf_classes(True).from_pretrained(ckpt, dtype=torch.float32).eval(),
          Qwen2VLImageProcessorPil.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt))
    processor = ImageProcessorConfig.from_pretrained(ckpt, ModelConfig.from_pretrained(ckpt).vision)
    parts, sizes = CASES["one image"]
    image = sample_image(*sizes[0], seed=5)
    processed = [preprocess_image(image, processor)]
    ids = prompt_ids(hf, parts, processed)
    tokens, trusted = hf_generate(hf, ids, [image])
    assert trusted >= 6
    assert run(make_engine(ckpt), ids, processed).output_token_ids[:trusted] == tokens[:trusted]


# ---- refusals

def test_bad_vision_configs_are_named(loaded):
    import json

    from engine.models.model_config import ModelConfig
    ckpt, _, _ = loaded("dense")
    with open(f"{ckpt}/config.json") as f:
        cfg = json.load(f)
    for change, message in [({"deepstack_visual_indexes": [0, 4]}, r"deepstack_visual_indexes "
                             r"\[4\] are not blocks of the 4-block"),
                            ({"num_position_embeddings": 15}, "15 is not a square grid"),
                            ({"hidden_act": "relu"}, "vision hidden_act 'relu' is not supported")]:
        bad = {**cfg, "vision_config": {**cfg["vision_config"], **change}}
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(bad)


def test_backend_without_vision_ops_is_refused(loaded):
    """As for Qwen2.5-VL (tests/test_vision.py): a backend lacking the tower's ops is refused at
    load, naming them."""
    from engine.models.qwen3_vl import Qwen3VLForConditionalGeneration
    ckpt, _, _ = loaded("dense")
    check_backends_refused(Qwen3VLForConditionalGeneration, ckpt, [
        (BareBackend(), "the bare backend has no gelu and encoder_attention ops")])

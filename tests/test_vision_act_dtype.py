"""The vision towers (Qwen2.5-VL's, Qwen3-VL's, Mistral 3's Pixtral) in a bfloat16 activation
dtype, as the CUDA backend runs them, checked on the CPU (the kernels themselves:
tests/gpu/test_cuda_vision.py).

Bf16Ops stands in for the CUDA backend's dtype rules: every activation an op takes or writes is
bfloat16 (float32 only for linear's out, the RoPE table and vectors), which it asserts; it
computes each op with the CPU backend in float32 and rounds what the op writes to bfloat16. So
a tower buffer left in float32, or an op fed the wrong dtype, fails here; and the towers' outputs
stay near the float32 ones by bfloat16 rounding (the tolerance the GPU test uses too). Also
engine/vision/act_arrays.py's moves: the plain NumPy statements on float32, ml_dtypes' rounding
on bfloat16.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

from vision_checkpoint import sample_image  # noqa: E402

from engine.vision import act_arrays  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
# the op table's argument names, for the ops the towers call
PARAMS = {
    "linear": ("x", "weight", "bias", "out"),
    "rms_norm": ("x", "weight", "eps", "out"),
    "fused_add_rms_norm": ("x", "residual", "weight", "eps"),
    "layer_norm": ("x", "weight", "bias", "eps", "out"),
    "fused_add_layer_norm": ("x", "residual", "weight", "bias", "eps"),
    "rotary_embedding": ("positions", "q", "k", "cos_sin_cache", "head_dim", "is_neox"),
    "silu_and_mul": ("x", "out"),
    "gelu_tanh_and_mul": ("x", "out"),
    "gelu": ("x", "out"),
    "encoder_attention": ("out", "q", "k", "v", "cu_seqlens", "scale"),
}
FLOAT32_ALLOWED = {("linear", "out"), ("rotary_embedding", "cos_sin_cache")}
TOWER_TOL = 3e-2       # as tests/gpu/test_cuda_vision.py's bf16 towers (measured here: 5e-3)


class StrictNumpy:
    """NumPy as CuPy treats bfloat16: no function of it computes on, copies or casts a bfloat16
    array (ascontiguousarray of one already contiguous returns it, as CuPy does, with no
    kernel; empty_like allocates only). Arrays move through their bits instead
(engine/vision/act_arrays.py). Methods and operators of the arrays are not watched."""

    def __getattr__(self, name):
        f = getattr(np, name)
        if not callable(f) or isinstance(f, type):
            return f

        def call(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, np.ndarray) and a.dtype == BF16 and name != "empty_like" and not (
                        name == "ascontiguousarray" and a.flags.c_contiguous):
                    raise AssertionError(f"xp.{name} on a bfloat16 array {a.shape}: CuPy has "
                                         "no kernel for it")
            return f(*args, **kwargs)
        return call


class Bf16Ops:
    name = "bf16-sim"
    xp = StrictNumpy()
    act_dtype = BF16

    def __init__(self):
        from pyx.cpu_backend import CpuBackend
        self.cpu = CpuBackend()
        self.calls = set()

    def asarray(self, a):
        return np.ascontiguousarray(a)

    def place_weight(self, a, role=None):
        a = np.asarray(a)
        return np.ascontiguousarray(a.astype(BF16 if a.ndim == 2 else F32))

    def __getattr__(self, op):
        if op not in PARAMS:
            raise AttributeError(op)
        return lambda *args: self._run(op, args)

    def _run(self, op, args):
        self.calls.add(op)
        widened, back = [], []
        for name, a in zip(PARAMS[op], args):
            if isinstance(a, np.ndarray) and a.dtype in (F32, BF16) and name != "weight":
                if a.ndim >= 2 and a.dtype != BF16 and (op, name) not in FLOAT32_ALLOWED:
                    raise AssertionError(f"{op}: {name} is {a.dtype} {a.shape}, activations "
                                         "must be bfloat16")
                if a.dtype == BF16:
                    w = a.astype(F32)
                    back.append((a, w))
                    a = w
            widened.append(a)
        getattr(self.cpu, op)(*widened)
        for a, w in back:      # what the op wrote, rounded (its inputs round back to themselves)
            a[...] = w.astype(BF16)


def tower_weights(ckpt) -> dict:
    """The checkpoint's tensors under the names the towers read (visual.*)."""
    from engine.loader.safetensors import load_safetensors
    from engine.models.qwen2_5_vl import _checkpoint_names
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    return weights


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    from qwen3_vl_checkpoint import tiny_qwen3_vl_checkpoint
    from vision_checkpoint import tiny_vl_checkpoint

    from engine.models.model_config import ModelConfig
    from engine.vision.config import ImageProcessorConfig
    from engine.vision.qwen2_5_vl_encoder import Qwen25VisionEncoder
    from engine.vision.qwen3_vl_encoder import Qwen3VisionEncoder
    made = {}
    for family, make, tower in [("qwen2_5_vl", tiny_vl_checkpoint, Qwen25VisionEncoder),
                                ("qwen3_vl", tiny_qwen3_vl_checkpoint, Qwen3VisionEncoder)]:
        ckpt = make(tmp_path_factory.mktemp(family))
        config = ModelConfig.from_pretrained(ckpt)
        made[family] = ckpt, config.vision, tower, ImageProcessorConfig.from_pretrained(
            ckpt, config.vision)
    return made


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_runs_in_bfloat16(towers, family):
    from engine.vision.preprocess import preprocess_image
    from pyx.cpu_backend import CpuBackend
    ckpt, vision, tower_class, processor = towers[family]
    ops = Bf16Ops()
    f32 = tower_class(vision, tower_weights(ckpt), CpuBackend())
    bf16 = tower_class(vision, tower_weights(ckpt), ops)
    for size in [(40, 56), (23, 17)]:
        image = preprocess_image(sample_image(*size, seed=1), processor)
        want = f32.encode(image.pixel_values, image.grid_thw)
        got = bf16.encode(image.pixel_values, image.grid_thw)
        assert got.dtype == F32 and got.shape == want.shape
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-4 < err < TOWER_TOL, f"{family} {size}: relative error {err:.3g}"
    assert {"gelu", "encoder_attention"} <= ops.calls


def test_act_arrays_moves():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    values = rng.standard_normal((3, 10)).astype(np.float32)
    rows = np.array([4, 0, 2])
    for dtype in (F32, BF16):
        dst = x.astype(dtype)
        act_arrays.set_rows(np, dst, rows, values)
        want = x.astype(dtype)
        want[rows] = values.astype(dtype)
        assert np.array_equal(dst.view(np.uint8), want.view(np.uint8)), dtype

        dst = x.astype(dtype)
        act_arrays.add_rows(np, dst, rows, values)
        want = x.astype(dtype)
        want[rows] = (want[rows].astype(np.float32) + values).astype(dtype)
        assert np.array_equal(dst.view(np.uint8), want.view(np.uint8)), dtype

        src = rng.standard_normal((6, 20)).astype(dtype)
        dst = np.zeros((6, 10), dtype)
        act_arrays.copy(np, dst, src[:, 5:15])
        assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(src[:, 5:15]).view(np.uint8))
    assert act_arrays.rounded(np, x, F32) is x
    assert np.array_equal(act_arrays.rounded(np, x, BF16).view(np.uint16),
                          x.astype(BF16).view(np.uint16))
    with pytest.raises(ValueError, match="copy: float32 into bfloat16"):
        act_arrays.copy(np, np.zeros((2, 2), BF16), np.zeros((2, 2), F32))


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    from mistral3_checkpoint import tiny_mistral3_checkpoint

    from engine.models.model_config import ModelConfig
    from engine.vision.families import image_processor
    ckpt = tiny_mistral3_checkpoint(tmp_path_factory.mktemp("mistral3"))
    vision = ModelConfig.from_pretrained(ckpt).vision
    return ckpt, vision, image_processor(ckpt, vision)


def mistral3_weights(ckpt) -> dict:
    from engine.loader.safetensors import load_safetensors
    from engine.models.mistral3 import _checkpoint_names
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    return weights


@pytest.mark.parametrize("hidden_act", ["silu", "gelu"])
def test_pixtral_tower_runs_in_bfloat16(mistral3, hidden_act):
    """Mistral 3's tower and projector in bfloat16 near the float32 ones; the break rows stay
    zero. gelu: the tiny checkpoint's MLP as a gelu one (the tower's other branch)."""
    import dataclasses

    from engine.vision.families import preprocess
    from engine.vision.pixtral_encoder import PixtralVisionEncoder
    from pyx.cpu_backend import CpuBackend
    ckpt, vision, processor = mistral3
    vision = dataclasses.replace(vision, hidden_act=hidden_act)
    ops = Bf16Ops()
    f32 = PixtralVisionEncoder(vision, mistral3_weights(ckpt), CpuBackend())
    bf16 = PixtralVisionEncoder(vision, mistral3_weights(ckpt), ops)
    for size in [(40, 56), (23, 17)]:
        image = preprocess(sample_image(*size, seed=1), processor)
        want = f32.encode(image.pixel_values, image.grid_thw)
        got = bf16.encode(image.pixel_values, image.grid_thw)
        assert got.dtype == F32 and got.shape == want.shape
        assert not got[~want.any(1)].any()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-4 < err < TOWER_TOL, f"pixtral {hidden_act} {size}: relative error {err:.3g}"
    assert {"gelu", "encoder_attention"} <= ops.calls



@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint

    from engine.models.model_config import ModelConfig
    from engine.vision.families import image_processor
    ckpt = tiny_gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3v"))
    vision = ModelConfig.from_pretrained(ckpt).vision
    return ckpt, vision, image_processor(ckpt, vision)


def gemma3_weights(ckpt) -> dict:
    from engine.loader.safetensors import load_safetensors
    from engine.models.gemma3_vl import _checkpoint_names
    weights = load_safetensors(ckpt, progress=False)
    _checkpoint_names(weights)
    return weights


def test_siglip_tower_runs_in_bfloat16(gemma3):
    """Gemma 3's SigLIP tower and projector in bfloat16 near the float32 ones."""
    from engine.vision.gemma3_encoder import Gemma3VisionEncoder
    from pyx.cpu_backend import CpuBackend
    ckpt, vision, processor = gemma3
    ops = Bf16Ops()
    f32 = Gemma3VisionEncoder(vision, gemma3_weights(ckpt), CpuBackend())
    bf16 = Gemma3VisionEncoder(vision, gemma3_weights(ckpt), ops)
    for size in [(40, 30), (23, 17)]:
        pixels = processor.preprocess(sample_image(*size, seed=1)).pixel_values
        want = f32.encode(pixels, (1, 4, 4))
        got = bf16.encode(pixels, (1, 4, 4))
        assert got.dtype == F32 and got.shape == want.shape
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-4 < err < TOWER_TOL, f"siglip {size}: relative error {err:.3g}"
    assert {"layer_norm", "fused_add_layer_norm", "gelu_tanh_and_mul",
            "encoder_attention"} <= ops.calls


@pytest.mark.parametrize("window", [0, 5])
def test_image_overlay_in_bfloat16(window):
    """Gemma 3's image-attention overlay on a bfloat16 cache and activations (as CUDA runs it):
    its image rows are the float32 overlay's on the same values, rounded to bfloat16 (the
    float32 overlay against a dense mask: tests/test_gemma3_vision.py); the text rows
    untouched."""
    from engine.vision.gemma3_attention import ImageBlockAttention, ImageSpan
    rng = np.random.default_rng(0)
    Hq, Hkv, D, bs, T = 4, 2, 8, 4, 20
    caches = [rng.standard_normal((16, bs, Hkv, D)).astype(BF16) for _ in range(2)]
    q = rng.standard_normal((T, Hq * D)).astype(BF16)
    attn = rng.standard_normal((T, Hq * D)).astype(BF16)

    class Batch:
        vision = type("V", (), {"spans": [ImageSpan(0, 0, 10, 15), ImageSpan(0, 10, 20, 26)]})()
        block_tables = rng.permutation(16)[None, :8]
    want = attn.astype(F32)
    ImageBlockAttention(np).apply(Batch, q.astype(F32), want, *(c.astype(F32) for c in caches),
                                  0.3, window, 0.0)
    got = attn.copy()
    ImageBlockAttention(StrictNumpy()).apply(Batch, q, got, *caches, 0.3, window, 0.0)
    assert got.dtype == BF16
    image_rows = np.r_[0:5, 10:16]
    text_rows = np.r_[5:10, 16:20]
    assert np.array_equal(got[text_rows].view(np.uint16), attn[text_rows].view(np.uint16))
    assert not np.array_equal(got[image_rows], attn[image_rows]), "no image row rewritten"
    assert np.array_equal(got[image_rows].view(np.uint16),
                          want[image_rows].astype(BF16).view(np.uint16))

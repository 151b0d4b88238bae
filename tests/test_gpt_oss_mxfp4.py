"""GPT-OSS MXFP4 checkpoints (quant_method "mxfp4", the layout of every released GPT-OSS):
engine/loader/quant_mxfp4.py dequantizes the experts at load as transformers does.

A tiny GPT-OSS written by transformers (tests/checkpoints.py) has its experts replaced by MXFP4
blocks and scales quantized here, and config.json given the released quantization_config.
transformers loads that file on the CPU by dequantizing it (without the `kernels` package and
Triton it falls back to dequantize=True: checked below), and Taper's greedy tokens and prefill
logits equal its own, through the model harness and the whole engine. The same checkpoint with
its nibbles swapped, or its scales one off, moves transformers' logits far past the harness's
tolerance: a reader with the wrong nibble order or exponent bias fails the comparison.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from hf_oracle import assert_matches, load_hf
from model_cases import GEN, Cases, assert_model_forward_matches, prompts_for

pytestmark = pytest.mark.timeout(300)

# the released GPT-OSS config.json's quantization_config
RELEASED_QUANTIZATION = {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                    "model.layers.*.mlp.router",
                                                    "model.embed_tokens", "lm_head"],
                         "quant_method": "mxfp4"}
_POSITIVE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float expert tensor (E, in, out) -> (blocks (E, out, in/32, 16), scales (E, out, in/32))
    uint8: each block of 32 inputs scaled by the power of two that brings its largest magnitude
    to 6 or under, each value rounded to the nearest E2M1 code; the even element in the low
    nibble, a code's bit 3 its sign, the scale's exponent biased by 127."""
    E, n_in, n_out = w.shape
    x = np.ascontiguousarray(w.transpose(0, 2, 1), dtype=np.float32).reshape(E, n_out, -1, 32)
    amax = np.abs(x).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scaled = x / np.ldexp(np.float32(1), exp)[..., None]
    mag = np.abs(np.abs(scaled)[..., None] - _POSITIVE).argmin(axis=-1).astype(np.uint8)
    codes = mag | np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def write_mxfp4(src: str, dst: str, edit_blocks=lambda b: b, edit_scales=lambda s: s) -> str:
    """dst: the float checkpoint in src with its experts' gate_up_proj / down_proj as MXFP4
    (edited by edit_blocks / edit_scales) and the released quantization_config."""
    from safetensors.numpy import load_file, save_file
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"] = edit_blocks(blocks)
        tensors[name + "_scales"] = edit_scales(scales)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = RELEASED_QUANTIZATION
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def _swap_nibbles(b):
    return ((b >> 4) | (b << 4)).astype(np.uint8)


VARIANTS = {"mxfp4": {}, "swapped_nibbles": dict(edit_blocks=_swap_nibbles),
            "scale_bias_126": dict(edit_scales=lambda s: (s + 1).astype(np.uint8))}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    cases = Cases(root, {"gpt_oss": (dict(arch="gpt_oss"), None)})
    for name, edits in VARIANTS.items():
        cases.dirs[name] = write_mxfp4(cases.dir("gpt_oss"), os.path.join(root, name), **edits)
    return cases


@pytest.fixture(scope="module")
def backend():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


def test_transformers_dequantizes_on_this_cpu(cases):
    """The reference is transformers' own dequantization: its MXFP4 kernels are absent here, so
    it loads the experts as float, and as the quantized values (not the float originals)."""
    from safetensors.numpy import load_file

    from engine.loader.quant_mxfp4 import dequantize_mxfp4
    model = load_hf(cases.dir("mxfp4"))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32
    t = load_file(os.path.join(cases.dir("mxfp4"), "model.safetensors"))
    p = "model.layers.0.mlp.experts."
    for proj in ("gate_up_proj", "down_proj"):
        want = dequantize_mxfp4(t[p + proj + "_blocks"], t[p + proj + "_scales"], np.float32)
        np.testing.assert_array_equal(getattr(experts, proj).detach().numpy(), want)
    original = load_file(os.path.join(cases.dir("gpt_oss"), "model.safetensors"))
    assert np.abs(original[p + "down_proj"] - experts.down_proj.detach().numpy()).max() > 1e-3


@pytest.mark.filterwarnings("ignore:overflow")     # 6 * 2**127 is inf, as in transformers
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16", np.float16])
def test_dequantize_equals_transformers_on_every_code(dtype):
    """Every byte value under scales from the smallest (2**-127) to 2**127: bit-identical to
    transformers' convert_moe_packed_tensors."""
    import ml_dtypes
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.loader.quant_mxfp4 import dequantize_mxfp4
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    blocks.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 4), dtype=np.uint8)
    scales[0, :, 0], scales[1, :, 0], scales[2, :, 0] = 0, 254, 127
    torch_dtype = {np.float32: torch.float32, "bfloat16": torch.bfloat16,
                   np.float16: torch.float16}[dtype]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch_dtype).float().numpy()
    got = dequantize_mxfp4(blocks, scales, np_dtype)
    assert got.dtype == np.dtype(np_dtype) and got.shape == (3, 128, 5)
    np.testing.assert_array_equal(got.astype(np.float32), want)


def test_kernel_threads_and_nan_scale_keep_transformers_values():
    """Odd shapes split over threads give the single-thread values, and E8M0's NaN scale (255)
    is 2**128 as transformers' ldexp reads it (0.5 * 2**128 finite, a zero code zero, not
    the NaN of 0 * inf)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pyx.mxfp4 import dequantize
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (5, 37, 3, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (5, 37, 3), dtype=np.uint8)
    scales[1, 2, 0], blocks[1, 2, 0, 0] = 255, 0x10      # codes 0 and 1 under the NaN scale
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
    one = dequantize(blocks, scales, np.float32, num_threads=1)
    np.testing.assert_array_equal(one, want)
    np.testing.assert_array_equal(dequantize(blocks, scales, np.float32, num_threads=3), one)
    assert (one[1, 0, 2], one[1, 1, 2]) == (0, 2.0 ** 127)
    with pytest.raises(ValueError, match="int8"):
        dequantize(blocks, scales, np.int8, "experts.down_proj")


def test_wrong_nibble_order_or_scale_bias_moves_transformers_logits(cases):
    """The checkpoint read with its nibbles swapped, or each exponent one too large (a bias of
    126), moves transformers' prefill logits far past the harness test's tolerance, so a Taper
    reading either way would fail test_model_forward_matches_hf."""
    for name in ("swapped_nibbles", "scale_bias_126"):
        model = load_hf(cases.dir(name))
        for prompt, r in zip(prompts_for(), cases.ref("mxfp4")):
            tol = 1e-4 * max(1.0, np.abs(r[2]).max())
            with torch.no_grad():
                moved = model(torch.tensor([prompt])).logits[0, -1].numpy()
            assert np.abs(moved - r[2]).max() > 100 * tol, name


def test_model_forward_matches_hf(cases, backend):
    """Taper's model alone on the MXFP4 file: prefill logits (prompt chunks of 9 beside other
    prompts' decodes) and greedy tokens equal transformers' on the same file."""
    assert_model_forward_matches(cases, backend, "mxfp4", chunk=9)


def test_engine_matches_hf(cases):
    from engine import LLM, SamplingParams
    llm = LLM(cases.dir("mxfp4"), block_size=8, num_kv_blocks=48, prefill_chunk_size=16,
              max_num_batched_tokens=32)
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=GEN,
                                                      ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, cases.ref("mxfp4"))):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label=f"mxfp4 prompt {i}")


def test_experts_take_the_loaders_dtype(cases, backend):
    """--dtype bf16: the dequantized experts are bf16 like the other matrices (the released
    checkpoints' dtype with auto)."""
    import ml_dtypes
    from safetensors.numpy import load_file

    from engine.loader.quant_formats import convert_quantized
    t = load_file(os.path.join(cases.dir("mxfp4"), "model.safetensors"))
    weights = {n: (w.astype(ml_dtypes.bfloat16) if w.dtype == np.float32 and w.ndim >= 2 else w)
               for n, w in t.items()}
    convert_quantized(weights, RELEASED_QUANTIZATION)
    w = weights["model.layers.1.mlp.experts.down_proj"]
    assert w.dtype == np.dtype(ml_dtypes.bfloat16) and w.shape == (4, 64, 96)
    assert not any(n.endswith(("_blocks", "_scales")) for n in weights)


def _pair(blocks_shape=(2, 8, 3, 16), scales_shape=(2, 8, 3), blocks_dtype=np.uint8):
    p = "model.layers.0.mlp.experts.down_proj"
    return {"model.embed_tokens.weight": np.zeros((4, 96), np.float32),
            p + "_blocks": np.zeros(blocks_shape, blocks_dtype),
            p + "_scales": np.zeros(scales_shape, np.uint8)}


@pytest.mark.parametrize("weights,message", [
    (_pair(blocks_shape=(2, 8, 3, 15)), r"down_proj_blocks: shape \(2, 8, 3, 15\)"),
    (_pair(blocks_shape=(2, 8, 48)), r"down_proj_blocks: shape \(2, 8, 48\)"),
    (_pair(scales_shape=(2, 8, 4)), r"down_proj_scales: shape \(2, 8, 4\).*\(2, 8, 3\)"),
    (_pair(blocks_dtype=np.int8), "uint8"),
    ({k: v for k, v in _pair().items() if not k.endswith("_scales")}, "without their scales"),
    ({k: v for k, v in _pair().items() if not k.endswith("_blocks")}, "no \\*_blocks"),
    ({**_pair(), "model.layers.1.mlp.experts.down_proj_scales": np.zeros((2, 8, 3), np.uint8)},
     "layers.1.mlp.experts.down_proj_scales: MXFP4 scales without their blocks"),
])
def test_malformed_blocks_and_scales_are_named(weights, message):
    from engine.loader.quant_formats import convert_quantized
    with pytest.raises(ValueError, match=message):
        convert_quantized(dict(weights), RELEASED_QUANTIZATION)


def test_memory_shortfall_is_named(monkeypatch):
    """The packed bytes passed the loader's check; the dequantized experts are checked again."""
    from engine.loader import quant_mxfp4
    monkeypatch.setattr(quant_mxfp4, "mem_available_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match="MXFP4 experts needs 0.00 GB"):
        quant_mxfp4.convert_mxfp4(_pair(), RELEASED_QUANTIZATION)
    monkeypatch.setattr(quant_mxfp4, "mem_available_bytes", lambda: 6144)   # 2*8*96 f32: fits
    quant_mxfp4.convert_mxfp4(_pair(), RELEASED_QUANTIZATION)

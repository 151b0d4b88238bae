"""GPTQ, AWQ and compressed-tensors pack-quantized int4 (W4A16) checkpoints: formats, kernels,
tiny-256 models.

Independent references:
- compressed-tensors checkpoints are quantized, packed and saved by the compressed-tensors library
  itself (ModelCompressor, pinned in requirements-test.txt), and the oracle's weights are the
  library's own decompression of the compressed model.
- GPTQ and AWQ checkpoints are packed by `pack_gptq` / `pack_awq` below, written from the formats'
  published descriptions (AutoGPTQ's and AutoAWQ's pack loops: a slice per nibble, not the
  loader's broadcast unpacking; GPTQModel and AutoAWQ do not install here without a newer or CUDA
  torch). Literal words decoded by hand pin those descriptions first.
- Kernels: float64 x @ dequant(W).T with dequant(W) = scale * (code - zero) computed here.
- Models: transformers' greedy tokens on the float checkpoint with every projection replaced by
  its dequantized weights; comparison stops at the oracle's first top-two gap under 0.05.
The last tests show that the checks fail when the AWQ column order is not undone, or GPTQ's
stored zero - 1 is read as the zero.
"""
import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from engine.loader.quant_formats import convert_quantized
from pyx.weights.int4 import Int4Part, Int4Weight
from hf_oracle import assert_matches, hf_greedy, load_hf
from pyx.cpu_backend import CpuBackend, isa_supported
from pyx.int4 import int4_dequantize, int4_linear

ISAS = [i for i in ("scalar", "avx2", "avx512") if isa_supported(i)]
TINY_256 = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=512)
PROMPT = [5, 17, 300, 42, 8, 99, 256, 3, 77, 150, 12, 480, 33, 201, 7, 64, 410, 9, 128, 250]
MARGIN = 0.05
# Seed and scale picked so that every format's oracle has >= 6 tokens before a near-tie and no
# repetition loop (with scale 2 the continuations are one token repeated).
CHECKPOINT = dict(seed=4, scale=4.0, **TINY_256)
PROJ = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
ACCUM_RTOL = 2e-6   # float32 accumulation over <= 768 terms, relative to sum |x * w|;
#                     measured <= 4.3e-8 on every ISA


def u32(*words):
    return np.array(words, np.uint32).view(np.int32)


def dequant64(codes, scales, zeros, g):
    """(N, K) float64: scale * (code - zero), one scale and zero per g elements of a row."""
    return np.repeat(scales.astype(np.float64), g, 1) * (codes - np.repeat(zeros, g, 1))


# ---- packers written from the formats' descriptions

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ from_linear: nibble i <- column order[i]


def pack_gptq(codes, zeros, fmt):
    """codes (N, K), zeros (N, K/G) -> qweight (K/8, N), qzeros (K/G, N/8) as AutoGPTQ packs:
    word row r of qweight |= code of k = 8r + i << 4i; qzeros along N alike, storing zero - 1 in
    the v1 "gptq" format."""
    ck, zk = codes.T.astype(np.uint32), zeros.T.astype(np.int64)
    qweight = np.zeros((ck.shape[0] // 8, ck.shape[1]), np.uint32)
    for i in range(8):
        qweight |= ck[i::8] << np.uint32(4 * i)
    if fmt == "gptq":
        assert zk.min() >= 1 and zk.max() <= 16, "v1 cannot store a zero outside 1..16"
        zk = zk - 1
    qzeros = np.zeros((zk.shape[0], zk.shape[1] // 8), np.uint32)
    for i in range(8):
        qzeros |= (zk[:, i::8] & 15).astype(np.uint32) << np.uint32(4 * i)
    return qweight.view(np.int32), qzeros.view(np.int32)


def pack_awq(codes, zeros):
    """codes (N, K), zeros (N, K/G) -> qweight (K, N/8), qzeros (K/G, N/8) as AutoAWQ packs."""
    ck, zk = codes.T.astype(np.uint32), zeros.T.astype(np.uint32)
    qweight = np.zeros((ck.shape[0], ck.shape[1] // 8), np.uint32)
    qzeros = np.zeros((zk.shape[0], zk.shape[1] // 8), np.uint32)
    for i, col in enumerate(AWQ_PACK_ORDER):
        qweight |= ck[:, col::8] << np.uint32(4 * i)
        qzeros |= zk[:, col::8] << np.uint32(4 * i)
    return qweight.view(np.int32), qzeros.view(np.int32)


def rtn(w, g, sym):
    """Round-to-nearest per group of g along rows, scales rounded to f16 first (as stored):
    asymmetric as AutoAWQ's pseudo_quantize (zero = -round(min / scale)), symmetric as GPTQ's
    (zero 8, scale 2 max|w| / 15). Returns codes (N, K) uint8, scales (N, K/g) f16, zeros."""
    n, k = w.shape
    grp = w.astype(np.float64).reshape(n, k // g, g)
    if sym:
        scale = (2 * np.abs(grp).max(-1) / 15).astype(np.float16)
        zero = np.full(scale.shape, 8.0)
    else:
        lo, hi = grp.min(-1), grp.max(-1)
        scale = ((hi - lo) / 15).astype(np.float16)
        zero = np.clip(-np.round(lo / scale.astype(np.float64)), 0, 15)
    s64 = scale.astype(np.float64)[..., None]
    codes = np.clip(np.round(grp / s64) + zero[..., None], 0, 15).astype(np.uint8)
    return codes.reshape(n, k), scale, zero


# ---- the formats' words, decoded by hand

def test_gptq_words_decode_by_hand():
    # K = 32, N = 8, one group. qweight word (0, 0) = 0x76543210: nibble i (bits 4i..4i+3) is i,
    # so column 0 has codes 0..7 at k = 0..7; word (1, 0) = 0xFEDCBA98 gives k = 8..15 codes
    # 8..15. qzeros word 0x00000007: column 0's nibble is 7 -> zero 8 (v1 adds one), columns 1..7
    # have nibble 0 -> zero 1. Scales are 1.
    qweight = np.zeros((4, 8), np.int32)
    qweight[0, 0], qweight[1, 0] = u32(0x76543210, 0xFEDCBA98)
    weights = {"l.qweight": qweight, "l.qzeros": u32(0x7).reshape(1, 1),
               "l.scales": np.ones((1, 8), np.float16), "l.g_idx": np.zeros(32, np.int32)}
    convert_quantized(weights, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                "desc_act": False, "sym": False})
    w = weights["l.weight"].dequantize()
    assert w.shape == (8, 32)
    np.testing.assert_array_equal(w[0], np.r_[np.arange(16) - 8, np.full(16, -8)])
    np.testing.assert_array_equal(w[1:], -1)


def test_gptq_v1_zero_nibble_15_reads_as_16():
    # v1 stores zero - 1 per nibble, read back plus one per nibble (vLLM's GPTQ kernels do the
    # same), so nibble 15 is zero 16, not 0 with a carry into the next column.
    weights = {"l.qweight": np.zeros((4, 8), np.int32), "l.qzeros": u32(0x0000000F).reshape(1, 1),
               "l.scales": np.ones((1, 8), np.float16)}
    convert_quantized(weights, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                "desc_act": False, "sym": False})
    w = weights["l.weight"].dequantize()
    np.testing.assert_array_equal(w[0], -16)
    np.testing.assert_array_equal(w[1], -1)


def test_awq_words_decode_by_hand():
    # K = 32, N = 8. qweight word (0, 0) = 0x76543210: nibble i holds column [0,2,4,6,1,3,5,7][i]
    # with value i, so row k = 0 of columns 0..7 reads 0, 4, 1, 5, 2, 6, 3, 7. Zeros 0, scales 1.
    qweight = np.zeros((32, 1), np.int32)
    qweight[0, 0] = u32(0x76543210)[0]
    weights = {"l.qweight": qweight, "l.qzeros": np.zeros((1, 1), np.int32),
               "l.scales": np.ones((1, 8), np.float16)}
    convert_quantized(weights, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                "zero_point": True, "version": "gemm"})
    w = weights["l.weight"].dequantize()
    np.testing.assert_array_equal(w[:, 0], [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(w[:, 1:], 0)


def test_compressed_tensors_words_decode_by_hand():
    # weight_packed (8, 4): K = 32. Word (0, 0) = 0x76543210: codes k = 0..7 are 0..7, i.e. signed
    # values -8..-1 (stored plus 8); the other words are 0 (value -8). weight_zero_point (1, 1) =
    # 0x0000000A packs N along the word: row 0's zero nibble is 10 (signed 2), rows 1..7 have 0
    # (signed -8). W = scale * (q - zp): row 0 = [-10..-3, then -10], rows 1..7 = 0.
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    packed = np.zeros((8, 4), np.int32)
    packed[0, 0] = u32(0x76543210)[0]
    zp = u32(0xA).reshape(1, 1)
    lib = unpack_from_int32(torch.from_numpy(packed), 4, torch.Size([8, 32])).numpy()
    assert lib[0, :8].tolist() == list(range(-8, 0)) and (lib[0, 8:] == -8).all()
    lib_zp = unpack_from_int32(torch.from_numpy(zp), 4, torch.Size([8, 1]), packed_dim=0).numpy()
    assert lib_zp[:, 0].tolist() == [2] + [-8] * 7
    weights = {"l.weight_packed": packed, "l.weight_scale": np.ones((8, 1), np.float32),
               "l.weight_zero_point": zp, "l.weight_shape": np.array([8, 32])}
    convert_quantized(weights, ct_config(symmetric=False, strategy="channel"))
    w = weights["l.weight"].dequantize()
    np.testing.assert_array_equal(w[0], np.r_[np.arange(-10, -2), np.full(24, -10)])
    np.testing.assert_array_equal(w[1:], 0)


def ct_config(symmetric=True, strategy="group", group_size=128, num_bits=4, fmt="pack-quantized",
              **extra):
    weights = {"num_bits": num_bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size if strategy == "group" else None, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "format": fmt, **extra}}}


# ---- canonical layout and kernels

def random_part(rng, n, k, g):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (n, k // g)) * rng.choice([-1, 1], (n, k // g)))
    zeros = rng.integers(0, 17, (n, k // g)).astype(np.float32)   # 16: a GPTQ v1 zero
    return codes, scales.astype(np.float32), zeros


def test_canonical_nibble_positions_are_pinned():
    codes = np.zeros((1, 64), np.uint8)
    for p in (0, 5, 16, 21, 32, 63):
        codes[:] = 0
        codes[0, p] = 9
        qs = Int4Part.from_codes(codes, np.ones((1, 1)), np.zeros((1, 1)), 64).qs
        byte, shift = (p // 32) * 16 + p % 16, 4 * ((p % 32) // 16)
        expect = np.zeros(32, np.uint8)
        expect[byte] = 9 << shift
        np.testing.assert_array_equal(qs[0], expect)


def test_packing_from_words_equals_packing_the_unpacked_codes():
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2 ** 32, (5, 96), dtype=np.uint64).astype(np.uint32)
    codes = np.stack([(words >> np.uint32(4 * i)) & 15 for i in range(8)], -1).reshape(5, 768)
    ones = np.ones((5, 6), np.float32)
    np.testing.assert_array_equal(Int4Part.from_words(words.view(np.int32), ones, ones, 128).qs,
                                  Int4Part.from_codes(codes, ones, ones, 128).qs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("g", [32, 128, 768])
def test_dequantize_every_isa_is_exact(isa, g):
    rng = np.random.default_rng(g)
    codes, scales, zeros = random_part(rng, 9, 768, g)
    p = Int4Part.from_codes(codes, scales, zeros, g)
    np.testing.assert_array_equal(p.codes(), codes)
    # scale * (code - zero) in float64 is exact; rounded to float32 it is the kernels' product
    want = dequant64(codes, scales, zeros, g).astype(np.float32)
    got = int4_dequantize(isa, p.qs, p.scales, p.zeros, g, num_threads=3)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("g,k", [(32, 256), (128, 256), (256, 256), (128, 768)])
def test_linear_every_isa(isa, T, g, k):
    rng = np.random.default_rng(T * 1000 + g + k)
    n, col, ldo = 13, 3, 20                      # 13 rows: a short tile; columns 3..15 of 20
    codes, scales, zeros = random_part(rng, n, k, g)
    p = Int4Part.from_codes(codes, scales, zeros, g)
    x = rng.standard_normal((T, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if T % 2 else None
    out = np.full((T, ldo), np.nan, np.float32)
    int4_linear(isa, x, p.qs, p.scales, p.zeros, g, bias, out, col, 2)
    w = dequant64(codes, scales, zeros, g)
    ref = x.astype(np.float64) @ w.T + (0 if bias is None else bias)
    bound = ACCUM_RTOL * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(out[:, col:col + n] - ref) <= bound)
    assert np.isnan(out[:, :col]).all() and np.isnan(out[:, col + n:]).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [3, 80])
def test_cpu_linear_fused_parts_both_paths(isa, T, monkeypatch):
    """Three parts (group sizes 128, 256, 128 stay separate when fused), through CpuBackend.linear:
    the int4 kernel at T = 3, dequantize + dense GEMM at T = 80 (past every ISA's GEMV_MAX_T),
    with panels forced small so the copy of a panel's columns into out is exercised."""
    import pyx.cpu_int4 as ci
    monkeypatch.setattr(ci, "PANEL_BYTES", 32 * 256 * 4)
    rng = np.random.default_rng(T)
    k, parts, refs = 256, [], []
    for n, g in [(40, 128), (24, 256), (36, 128)]:
        codes, scales, zeros = random_part(rng, n, k, g)
        parts.append(Int4Weight([Int4Part.from_codes(codes, scales, zeros, g)], k))
        refs.append(dequant64(codes, scales, zeros, g))
    w = Int4Weight.concat(parts)
    assert [p.group_size for p in w.parts] == [128, 256, 128] and w.shape == (100, k)
    x = rng.standard_normal((T, k)).astype(np.float32)
    bias = rng.standard_normal(100).astype(np.float32)
    out = np.zeros((T, 100), np.float32)
    CpuBackend(isa=isa, num_threads=2).linear(x, w, bias, out)
    ref64 = np.concatenate(refs)
    ref = x.astype(np.float64) @ ref64.T + bias
    bound = ACCUM_RTOL * (np.abs(x.astype(np.float64)) @ np.abs(ref64).T) + 1e-6
    assert np.all(np.abs(out - ref) <= bound)


# ---- converters against the packers

def quantized_layer(rng, method, n, k, g, sym, fmt="gptq"):
    """Tensors of one layer named "l" and its float64 dequantization."""
    w = rng.standard_normal((n, k))
    codes, scales, zeros = rtn(w, k if g == -1 else g, sym)
    if method == "gptq":
        qweight, qzeros = pack_gptq(codes, zeros, fmt)
        gi = np.arange(k, dtype=np.int32) // (k if g == -1 else g)
        tensors = {"l.qweight": qweight, "l.qzeros": qzeros, "l.scales": scales.T.copy(),
                   "l.g_idx": gi}
    else:
        qweight, qzeros = pack_awq(codes, zeros)
        tensors = {"l.qweight": qweight, "l.qzeros": qzeros, "l.scales": scales.T.copy()}
    return tensors, dequant64(codes, scales, zeros, k if g == -1 else g)


def gptq_config(sym, g, fmt="gptq", **extra):
    return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": sym,
            "checkpoint_format": fmt, **extra}


def awq_config(g, **extra):
    return {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
            "version": "gemm", **extra}


@pytest.mark.parametrize("method,sym,g,fmt", [
    ("gptq", True, 128, "gptq"), ("gptq", False, 128, "gptq"), ("gptq", False, 64, "gptq_v2"),
    ("gptq", True, -1, "gptq"), ("awq", False, 128, None), ("awq", False, -1, None)])
def test_converters_match_the_packers(method, sym, g, fmt):
    rng = np.random.default_rng(abs(g) + sym)
    tensors, ref = quantized_layer(rng, method, 48, 256, g, sym, fmt)
    raw = dict(tensors)
    convert_quantized(tensors, gptq_config(sym, g, fmt) if method == "gptq" else awq_config(g))
    (name, w), = tensors.items()
    assert name == "l.weight" and isinstance(w, Int4Weight) and w.shape == (48, 256)
    np.testing.assert_array_equal(w.dequantize(), ref.astype(np.float32))
    # the checkpoint's own tensors ride along for the GPU repack
    (src,) = w.sources
    assert src.name == "l" and src.shape == (48, 256)
    assert all(src.tensors[s.split(".")[1]] is t for s, t in raw.items())


# ---- tiny-256 models

@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("f32"), "llama", **CHECKPOINT)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "llama", dtype="bfloat16",
                           **CHECKPOINT)


def write_gptq_awq(float_dir, out_dir, method, sym, g, fmt="gptq"):
    """A GPTQ/AWQ checkpoint of float_dir's weights (RTN per group, packed by the packers above);
    returns it and {projection name: dequantized float32 (N, K)} for the oracle."""
    floats = load_file(os.path.join(float_dir, "model.safetensors"))
    tensors, deq = {}, {}
    for name, w in floats.items():
        if not PROJ.fullmatch(name):
            tensors[name] = w
            continue
        prefix, k = name[:-len(".weight")], w.shape[1]
        gg = k if g == -1 else g
        codes, scales, zeros = rtn(w, gg, sym)
        if method == "gptq":
            tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = pack_gptq(codes, zeros, fmt)
            tensors[f"{prefix}.g_idx"] = np.arange(k, dtype=np.int32) // gg
        else:
            tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = pack_awq(codes, zeros)
        tensors[f"{prefix}.scales"] = np.ascontiguousarray(scales.T)
        deq[name] = dequant64(codes, scales, zeros, gg).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(float_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (gptq_config(sym, g, fmt) if method == "gptq"
                                     else awq_config(g))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(out_dir), deq


def ct_group(targets, symmetric, strategy, group_size=128):
    args = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy}
    if strategy == "group":
        args["group_size"] = group_size
    return {"targets": targets, "weights": args}


def write_compressed(bf16_dir, out_dir, groups):
    """bf16_dir quantized (RTN min/max per group or channel) and saved by compressed-tensors' own
    ModelCompressor in pack-quantized format; returns it and {projection: float32 weight} from
    the library's own decompression of the compressed model."""
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]),
                              show_progress=False)
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            args, w = m.quantization_scheme.weights, m.weight.data
            grp = (w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group"
                   else w[:, None, :])
            scale, zp = calculate_qparams(grp.amin(-1), grp.amax(-1), args)
            m.weight_scale.data.copy_(scale)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    compressor.decompress_model(model)
    deq = {n: p.detach().float().numpy() for n, p in model.named_parameters() if PROJ.fullmatch(n)}
    return str(out_dir), deq


def oracle(float_dir, deq):
    hf = load_hf(float_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in deq:
                p.copy_(torch.from_numpy(deq[name]))
    assert sum(PROJ.fullmatch(n) is not None for n, _ in hf.named_parameters()) == len(deq)
    return hf


def taper_greedy(model_dir, n=24, **config):
    llm = LLM(model_dir, num_kv_blocks=32, **config)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out[0].token_ids


GPTQ_AWQ_CASES = {"gptq-v1-sym-g128": ("gptq", True, 128, "gptq"),
                  "gptq-v1-asym-g128": ("gptq", False, 128, "gptq"),
                  "gptq-v2-asym-g128": ("gptq", False, 128, "gptq_v2"),
                  "gptq-v1-sym-channel": ("gptq", True, -1, "gptq"),
                  "awq-g128": ("awq", False, 128, "gptq"),
                  "awq-channel": ("awq", False, -1, "gptq")}


@pytest.mark.parametrize("case", list(GPTQ_AWQ_CASES))
def test_gptq_awq_model_greedy_matches_transformers(float_dir, tmp_path, case):
    qdir, deq = write_gptq_awq(float_dir, tmp_path / case, *GPTQ_AWQ_CASES[case])
    reference = hf_greedy(oracle(float_dir, deq), PROMPT, 24, tie=MARGIN)
    assert_matches(taper_greedy(qdir), reference, label=case)


@pytest.mark.parametrize("isa", ISAS)
def test_gptq_model_every_isa_with_prefill_through_the_gemm_path(float_dir, tmp_path, monkeypatch,
                                                                 isa):
    """The 20-token prefill goes through dequantize + dense GEMM, decode through the int4 kernel."""
    import pyx.cpu_int4 as ci
    monkeypatch.setitem(ci.GEMV_MAX_T, isa, 8)
    qdir, deq = write_gptq_awq(float_dir, tmp_path / "q", "gptq", False, 128, "gptq")
    reference = hf_greedy(oracle(float_dir, deq), PROMPT, 24, tie=MARGIN)
    assert_matches(taper_greedy(qdir, kernels=f"cpu_isa={isa}"), reference, label=isa)


@pytest.mark.parametrize("symmetric,strategy", [(True, "group"), (False, "group"),
                                                (True, "channel"), (False, "channel")])
def test_compressed_tensors_model_greedy_matches_transformers(bf16_dir, tmp_path, symmetric,
                                                              strategy):
    ct_dir, deq = write_compressed(bf16_dir, tmp_path / "ct",
                                   {"group_0": ct_group(["Linear"], symmetric, strategy)})
    with open(os.path.join(ct_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] == symmetric
    reference = hf_greedy(oracle(bf16_dir, deq), PROMPT, 24, tie=MARGIN)
    assert_matches(taper_greedy(ct_dir), reference, label=f"{symmetric}-{strategy}")


def test_compressed_tensors_mixed_layouts_fuse_as_separate_parts(bf16_dir, tmp_path,
                                                                 monkeypatch):
    """k_proj per channel (asymmetric) by a regex target, every other Linear in groups of 64: the
    fused q/k/v weight keeps three parts, and the model still matches."""
    ct_dir, deq = write_compressed(bf16_dir, tmp_path / "ct", {
        "group_0": ct_group(["re:.*k_proj$"], False, "channel"),
        "group_1": ct_group(["Linear"], True, "group", 64)})
    fused, concat = [], Int4Weight.concat
    monkeypatch.setattr(Int4Weight, "concat", staticmethod(lambda ws: fused.append(concat(ws))
                                                            or fused[-1]))
    tokens = taper_greedy(ct_dir)
    layouts = [[p.group_size for p in w.parts] for w in fused]
    assert layouts == [[64, 256, 64], [64], [64, 256, 64], [64]]    # per layer: qkv, gate_up
    reference = hf_greedy(oracle(bf16_dir, deq), PROMPT, 24, tie=MARGIN)
    assert_matches(tokens, reference, label="mixed")


def test_the_oracle_sees_quantization(float_dir, tmp_path):
    """4-bit weights move transformers' logits by far more than the margin, so matching the
    oracle is evidence about the quantized path."""
    _, deq = write_gptq_awq(float_dir, tmp_path / "q", "gptq", False, 128, "gptq")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        floats = load_hf(float_dir)(ids).logits[0, -1]
        q4 = oracle(float_dir, deq)(ids).logits[0, -1]
    assert float((floats - q4).abs().max()) > 10 * MARGIN


# ---- the checks can fail

def test_awq_order_not_undone_changes_values_and_tokens(float_dir, tmp_path, monkeypatch):
    import engine.loader.quant_int4 as loader
    qdir, deq = write_gptq_awq(float_dir, tmp_path / "awq", "awq", False, 128)
    reference = hf_greedy(oracle(float_dir, deq), PROMPT, 24, tie=MARGIN)
    monkeypatch.setattr(loader, "AWQ_REVERSE_ORDER", list(range(8)))
    tensors, ref = quantized_layer(np.random.default_rng(1), "awq", 48, 256, 128, False)
    convert_quantized(tensors, awq_config(128))
    assert np.abs(tensors["l.weight"].dequantize() - ref).max() > 1.0
    tokens = taper_greedy(qdir)
    assert tokens[:reference[1]] != reference[0][:reference[1]]


def test_gptq_v1_zeros_read_as_v2_change_values():
    tensors, ref = quantized_layer(np.random.default_rng(2), "gptq", 48, 256, 128, False, "gptq")
    convert_quantized(tensors, gptq_config(False, 128, "gptq_v2"))
    diff = tensors["l.weight"].dequantize() - ref
    assert np.abs(diff).max() > 0.01


# ---- unsupported variants are start-up errors that name them

@pytest.mark.parametrize("qc,match", [
    (gptq_config(False, 128, desc_act=True), "desc_act"),
    ({**gptq_config(False, 128), "bits": 8}, "bits=8"),
    (gptq_config(False, 128, "marlin"), "marlin"),
    (gptq_config(False, 128, dynamic={"-:.*": {}}), "dynamic"),
    ({**awq_config(128), "version": "gemv"}, "gemv"),
    ({**awq_config(128), "bits": 3}, "bits=3"),
])
def test_unsupported_gptq_awq_variants(qc, match):
    method = qc["quant_method"]
    tensors, _ = quantized_layer(np.random.default_rng(3), method, 16, 256, 128, False)
    with pytest.raises(ValueError, match=match):
        convert_quantized(tensors, qc)


def test_act_order_g_idx_is_refused_and_per_channel_desc_act_accepted():
    rng = np.random.default_rng(4)
    tensors, _ = quantized_layer(rng, "gptq", 16, 256, 128, False)
    tensors["l.g_idx"] = tensors["l.g_idx"][::-1].copy()
    with pytest.raises(ValueError, match="act-order g_idx"):
        convert_quantized(tensors, gptq_config(False, 128))
    tensors, ref = quantized_layer(rng, "gptq", 16, 256, -1, True)
    convert_quantized(tensors, gptq_config(True, -1, desc_act=True))
    np.testing.assert_array_equal(tensors["l.weight"].dequantize(), ref.astype(np.float32))


@pytest.mark.parametrize("qc,match", [
    (ct_config(num_bits=8), "num_bits 8"),
    (ct_config(fmt="naive-quantized"), "naive-quantized"),
    (ct_config(fmt="marlin-24"), "marlin-24"),
    (ct_config(strategy="tensor"), "strategy 'tensor'"),
    (ct_config(input_activations={"num_bits": 8, "type": "int"}), "input_activations"),
    ({**ct_config(), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
])
def test_unsupported_compressed_tensors_variants(qc, match):
    with pytest.raises(ValueError, match=match):
        convert_quantized({"l.weight_packed": np.zeros((8, 32), np.int32)}, qc)


def test_desc_act_checkpoint_fails_at_startup(float_dir, tmp_path):
    qdir, _ = write_gptq_awq(float_dir, tmp_path / "q", "gptq", False, 128)
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["desc_act"] = True
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="desc_act=true"):
        LLM(qdir, num_kv_blocks=32)


def test_load_safetensors_can_keep_stored_scales(tmp_path):
    from engine.loader.safetensors import load_safetensors
    scales = np.array([[1 + 2 ** -10, 3.0]], np.float16)    # 1 + 2^-10 is not a bf16
    save_file({"l.scales": scales, "l.w": np.ones((2, 2), np.float16)},
              str(tmp_path / "model.safetensors"))
    kept = load_safetensors(str(tmp_path), dtype="bf16", progress=False, quantized=True)
    assert kept["l.scales"].dtype == np.float16 and kept["l.w"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(kept["l.scales"], scales)
    rounded = load_safetensors(str(tmp_path), dtype="bf16", progress=False)["l.scales"]
    assert rounded.astype(np.float32)[0, 0] != np.float32(scales[0, 0])

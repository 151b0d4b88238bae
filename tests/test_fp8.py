"""FP8 (OCP e4m3): weight checkpoints (quant_method fp8 block-wise, compressed-tensors
float-quantized) and the FP8 KV cache, on the CPU backend.

Oracles: ml_dtypes.float8_e4m3fn for the code <-> value conversions (all 256 codes); float64
dequantize-then-matmul (tests/reference.py) for the weight kernel on every ISA (the FP8 cache ops
are in test_backend_ops.py); and at model level transformers itself -- on the dequantized weights
for FP8 checkpoints (written here with safetensors' own F8_E4M3 support), and with its K/V rounded
through torch's float8_e4m3fn (registered as an attention function) for the FP8 KV cache. Each
model test also shows that what it checks changes transformers' answer, so it can fail.
"""
import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch

import reference as ref
from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf
from pyx.cpu_backend import CpuBackend, isa_supported

E4M3 = ml_dtypes.float8_e4m3fn
ISAS = ["scalar", "avx2", "avx512"]
TINY_256 = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=512)
PROMPT = [5, 17, 300, 42, 8, 99, 256, 3, 77, 150, 12, 480]
GEN = 24
MARGIN = 0.05
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def backend_for(isa, **kw):
    if not isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    return CpuBackend(isa=isa, **kw)


def same_values(a, b):
    """Bitwise equal floats, NaN where the other is NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32),
                                                               b[~nan].view(np.uint32))


# ---- e4m3 conversions


@pytest.mark.parametrize("isa", ISAS)
def test_decode_all_codes_matches_ml_dtypes(isa):
    from pyx.fp8 import decode
    backend_for(isa)
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(E4M3).astype(np.float32)
    assert np.isnan(want).sum() == 2 and want[0x7e] == 448 and want[1] == 2.0 ** -9  # NaN, max, subnormal
    assert same_values(decode(codes, isa), want)
    assert same_values(decode(np.tile(codes, 3)[5:700], isa), np.tile(want, 3)[5:700])  # vector tails
    assert same_values(ref.e4m3_decode(codes), want)


def encode_inputs():
    grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    mids = (grid[:-1] + grid[1:]) / 2                       # exact ties, subnormal ones included
    rng = np.random.default_rng(0)
    spread = np.concatenate([rng.standard_normal(4000) * s for s in (1e-4, 1e-2, 1, 30, 300)])
    special = [448, 449, 463.9, 464, 464.1, 470, 1e9, np.inf, 2.0 ** -10, 2.0 ** -10 * 1.0001, 0.0]
    x = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), spread,
                        special]).astype(np.float32)
    return np.concatenate([x, -x])


def test_encode_rounds_to_nearest_even_and_saturates():
    from pyx.fp8 import encode
    x = encode_inputs()
    got = encode(x)
    # ml_dtypes rounds to nearest even but overflows to NaN; the cache saturates at +-448
    want = np.clip(x, -448, 448).astype(E4M3).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ref.e4m3_encode(x), want)
    assert encode(np.float32([464, 470, np.inf, -np.inf])).tolist() == [0x7e, 0x7e, 0x7e, 0xfe]
    ties = np.float32([2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10])  # halfway between subnormals
    assert encode(ties).tolist() == [0, 2, 2]
    assert encode(np.float32([np.nan]))[0] & 0x7f == 0x7f


# ---- FP8 block linear


def random_fp8(rng, n, k, block):
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7f) == 0x7f] = 0x38  # no NaN weights
    bn, bk = block
    scale = rng.uniform(0.01, 0.1, (-(-n // bn), -(-k // bk))).astype(np.float32)
    return codes, scale


LINEAR_CASES = [  # (T, K, N, (bn, bk))
    (1, 256, 256, (128, 128)), (3, 384, 128, (128, 128)), (4, 300, 64, (32, 128)),
    (5, 256, 384, (128, 128)), (8, 512, 96, (32, 64)), (17, 777, 65, (1, 777)),
    (64, 1000, 130, (2, 100)), (2, 37, 13, (1, 37)), (9, 48, 40, (40, 48)), (33, 96, 48, (16, 5)),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,K,N,block", LINEAR_CASES)
def test_fp8_linear_matches_dequantize_then_matmul(isa, T, K, N, block):
    from pyx.weights.fp8 import Fp8Weight
    be = backend_for(isa, num_threads=2)
    rng = np.random.default_rng(T * 1000 + K + N)
    codes, scale = random_fp8(rng, N, K, block)
    w = Fp8Weight(codes, scale, block)
    x = rng.standard_normal((T, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if T % 2 else None
    out = np.full((T, N), np.nan, np.float32)
    be.linear(x, w, bias, out)
    want = ref.linear(x, ref.fp8_block_dequantize(codes, scale, block), bias)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(w.dequantize(), ref.fp8_block_dequantize(codes, scale, block),
                               rtol=1e-7)


def test_fp8_weights_fuse_and_reject_bad_shapes():
    from pyx.weights.fp8 import Fp8Weight
    from pyx.fp8 import fp8_linear
    rng = np.random.default_rng(3)
    parts = [Fp8Weight(*random_fp8(rng, n, 256, (128, 128)), (128, 128)) for n in (256, 128, 128)]
    fused = Fp8Weight.concat(parts)
    assert fused.shape == (512, 256) and fused.scale.shape == (4, 2)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    out = np.empty((6, 512), np.float32)
    be = CpuBackend()
    be.linear(x, fused, None, out)
    cols = []
    for p in parts:
        o = np.empty((6, p.shape[0]), np.float32)
        be.linear(x, p, None, o)
        cols.append(o)
    np.testing.assert_allclose(out, np.concatenate(cols, 1), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="same K, block"):
        Fp8Weight.concat([parts[0], Fp8Weight(*random_fp8(rng, 128, 256, (1, 256)), (1, 256),
                                              "channel")])
    with pytest.raises(ValueError, match="fp8_linear"):
        fp8_linear("scalar", x, parts[0].weight, parts[0].scale[:1], (128, 128), None,
                   np.empty((6, 256), np.float32))
    with pytest.raises(ValueError, match="fp8_linear"):
        fp8_linear("scalar", x[:, :100], parts[0].weight, parts[0].scale, (128, 128), None,
                   np.empty((6, 256), np.float32))


# ---- FP8 checkpoints, written here: block-wise (quant_method fp8) and compressed-tensors


def quantize_blocks(w, bn, bk):
    """Per (bn x bk) block: scale = amax / 448, codes = e4m3(w / scale). Returns (codes, scale)."""
    n, k = w.shape
    blocks = w.reshape(n // bn, bn, k // bk, bk)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    q = np.clip(blocks / scale[:, None, :, None], -448, 448).reshape(n, k)
    return q.astype(np.float32).astype(E4M3), scale


def dequantize_blocks(codes, scale, bn, bk):
    s = np.repeat(np.repeat(scale, bn, 0), bk, 1)
    return (codes.astype(np.float32) * s).astype(np.float32)


def f8_tensor(codes):
    return torch.from_numpy(np.ascontiguousarray(codes).view(np.uint8)).view(torch.float8_e4m3fn)


def write_quantized(src, dst, quantize, quantization_config, skip=()):
    """dst: src's config (+ quantization_config) and tensors, each projection (but `skip`) replaced
    by quantize(name, weight) -> {name: tensor}. Returns {name: dequantized weight} for the oracle."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors, dequantized = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        prefix = name[:-len(".weight")]
        if name.endswith(".weight") and prefix.endswith(PROJ) and prefix not in skip:
            out, deq = quantize(prefix, t.numpy())
            tensors.update(out)
            dequantized[name] = deq
        else:
            tensors[name] = t
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dequantized


def oracle_with(model_dir, dequantized):
    hf = load_hf(model_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(torch.from_numpy(dequantized[name]))
    return hf


def greedy(llm, prompt=PROMPT, n=GEN):
    from engine import SamplingParams
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return list(out[0].token_ids)


BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.down_proj"]}


def block_quantize(prefix, w):
    codes, scale = quantize_blocks(w, 128, 128)
    return ({prefix + ".weight": f8_tensor(codes),
             prefix + ".weight_scale_inv": torch.from_numpy(scale)},
            dequantize_blocks(codes, scale, 128, 128))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("q3"), "qwen3", scale=4.0, **TINY_256)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ll"), "llama", scale=4.0, seed=3, **TINY_256)


@pytest.fixture(scope="module")
def block_fp8(qwen3_dir, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("q3fp8"))
    deq = write_quantized(qwen3_dir, dst, block_quantize, BLOCK_QC,
                          skip=("model.layers.1.mlp.down_proj",))
    return dst, deq


def test_block_fp8_checkpoint_greedy_matches_transformers(qwen3_dir, block_fp8):
    from engine import LLM
    dst, deq = block_fp8
    oracle = oracle_with(qwen3_dir, deq)
    reference = hf_greedy(oracle, PROMPT, GEN, tie=MARGIN)
    assert_matches(greedy(LLM(dst, num_kv_blocks=32)), reference, label="fp8 block")
    # the quantization is visible to the oracle: it changes transformers' logits
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        diff = (load_hf(qwen3_dir)(ids).logits[0, -1] - oracle(ids).logits[0, -1]).abs().max()
    assert float(diff) > 2 * MARGIN


def test_block_fp8_loader_keeps_codes_and_float_layers(block_fp8):
    from engine.loader.quant_formats import convert_quantized
    from engine.loader.safetensors import load_safetensors
    from pyx.weights.fp8 import Fp8Weight
    dst, deq = block_fp8
    for dtype in ("auto", "bf16"):
        weights = load_safetensors(dst, dtype=dtype, progress=False, quantized=True)
        convert_quantized(weights, BLOCK_QC)
        w = weights["model.layers.0.mlp.down_proj.weight"]
        assert isinstance(w, Fp8Weight) and w.shape == (256, 768) and w.block == (128, 128)
        assert w.weight.dtype == np.uint8 and w.scale.dtype == np.float32 and w.scale.shape == (2, 6)
        np.testing.assert_array_equal(w.dequantize(), deq["model.layers.0.mlp.down_proj.weight"])
        assert isinstance(weights["model.layers.1.mlp.down_proj.weight"], np.ndarray)  # not converted
        assert not any(n.endswith("weight_scale_inv") for n in weights)


def test_per_tensor_fp8_with_static_input_scales():
    """quant_method fp8 without weight_block_size (vLLM's original FP8 checkpoints): one
    weight_scale per tensor, static input_scale kept on the weight."""
    from engine.loader.quant_formats import convert_quantized
    codes = small_fp8_dict()["model.layers.0.mlp.up_proj.weight"]
    weights = {"model.layers.0.mlp.up_proj.weight": codes,
               "model.layers.0.mlp.up_proj.weight_scale": np.float32(0.25),
               "model.layers.0.mlp.up_proj.input_scale": np.float32(0.5)}
    convert_quantized(weights, {"quant_method": "fp8", "activation_scheme": "static"})
    w = weights.pop("model.layers.0.mlp.up_proj.weight")
    assert not weights and w.kind == "channel" and w.input_scale.tolist() == [0.5]
    np.testing.assert_array_equal(w.dequantize(), codes.astype(np.float32) * 0.25)


def channel_quantize(prefix, w, static=False):
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = (amax / 448).astype(np.float32)
    codes = np.clip(w / scale, -448, 448).astype(np.float32).astype(E4M3)
    out = {prefix + ".weight": f8_tensor(codes),
           prefix + ".weight_scale": torch.from_numpy(scale).to(torch.bfloat16).float()}
    if static:
        out[prefix + ".input_scale"] = torch.tensor([0.05])
    deq = (codes.astype(np.float32) * out[prefix + ".weight_scale"].numpy()).astype(np.float32)
    return out, deq


def compressed_qc(static):
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token",
            "dynamic": not static, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "float-quantized", "input_activations": acts,
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "dynamic": False, "symmetric": True}}}}


@pytest.mark.parametrize("static", [False, True])
def test_compressed_tensors_fp8_greedy_matches_transformers(llama_dir, tmp_path, static, caplog):
    from engine import LLM
    deq = write_quantized(llama_dir, str(tmp_path), lambda p, w: channel_quantize(p, w, static),
                          compressed_qc(static))
    if static:  # same weights as the dynamic case: only check the input scales are taken
        with caplog.at_level("INFO", logger="taper.loader"):
            llm = LLM(str(tmp_path), num_kv_blocks=32)
        assert "ignores them" in caplog.text
        return
    reference = hf_greedy(oracle_with(llama_dir, deq), PROMPT, GEN, tie=MARGIN)
    assert_matches(greedy(LLM(str(tmp_path), num_kv_blocks=32)), reference, label="compressed fp8")


def test_convert_compressed_fp8_strategies():
    from engine.loader.quant_fp8 import convert_compressed_fp8
    from pyx.weights.fp8 import Fp8Weight
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    codes, scale = quantize_blocks(w, 128, 128)
    scheme = {"targets": ["re:.*self_attn.*"],
              "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                          "block_structure": [128, 128]}}
    weights = {"model.layers.0.self_attn.o_proj.weight": codes,
               "model.layers.0.self_attn.o_proj.weight_scale": scale,
               "model.layers.0.mlp.up_proj.weight": codes,
               "model.layers.0.mlp.up_proj.weight_scale": np.float32([[0.5]])}
    convert_compressed_fp8(weights, {"ignore": []}, scheme)
    fw = weights["model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(fw, Fp8Weight) and fw.kind == "block"
    np.testing.assert_array_equal(fw.dequantize(), dequantize_blocks(codes, scale, 128, 128))
    assert weights["model.layers.0.mlp.up_proj.weight"] is codes  # not targeted by this group
    tensor = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    convert_compressed_fp8(weights, {}, tensor)
    up = weights["model.layers.0.mlp.up_proj.weight"]
    assert up.kind == "channel" and up.scale.shape == (256, 1) and np.all(up.scale == 0.5)


# ---- unsupported variants: start-up errors that name them


def small_fp8_dict():
    codes, scale = quantize_blocks(np.random.default_rng(1).standard_normal((256, 256)), 128, 128)
    return {"model.layers.0.mlp.up_proj.weight": codes,
            "model.layers.0.mlp.up_proj.weight_scale_inv": scale}


@pytest.mark.parametrize("change, message", [
    (lambda qc, w: qc.update(fmt="e5m2"), "e5m2"),
    (lambda qc, w: w.update({"model.layers.0.mlp.up_proj.weight":
                             w["model.layers.0.mlp.up_proj.weight"].astype(np.float32)
                             .astype(ml_dtypes.float8_e5m2)}), "e5m2"),
    (lambda qc, w: qc.update(activation_scheme="static"), "static"),
    (lambda qc, w: qc.update(weight_block_size=[96, 128]), "does not divide"),
    (lambda qc, w: w.pop("model.layers.0.mlp.up_proj.weight_scale_inv"), "weight_scale_inv"),
    (lambda qc, w: qc.update(modules_to_not_convert=["up_proj"]), "modules_to_not_convert"),
])
def test_unsupported_fp8_variants_fail_at_start_up(change, message):
    from engine.loader.quant_formats import convert_quantized
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}
    weights = small_fp8_dict()
    change(qc, weights)
    with pytest.raises(ValueError, match=message):
        convert_quantized(weights, qc)


@pytest.mark.parametrize("change, message", [
    (lambda s: s["weights"].update(num_bits=4), "4-bit float"),
    (lambda s: s["weights"].update(strategy="group"), "strategy 'group'"),
    (lambda s: s.update(input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
     "8-bit int"),
    (lambda s: s.update(input_activations={"num_bits": 8, "type": "float", "dynamic": False}),
     "input_scale"),
])
def test_unsupported_compressed_fp8_variants(change, message):
    from engine.loader.quant_fp8 import convert_compressed_fp8
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    change(scheme)
    weights = small_fp8_dict()
    weights["model.layers.0.mlp.up_proj.weight_scale"] = np.full((256, 1), 0.01, np.float32)
    with pytest.raises(ValueError, match=message):
        convert_compressed_fp8(weights, {}, scheme)


# ---- FP8 KV cache: model level


def fake_quantized_attention(scales):
    """A transformers attention function that rounds K and V through torch's float8_e4m3fn with
    per-layer, per-KV-head scales ({layer: (k (Hkv,), v (Hkv,))}), then runs SDPA: the oracle for
    an FP8 KV cache (stored = x / scale saturated to 448, read back x scale)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rnd(x, s):
        s = torch.from_numpy(np.asarray(s, np.float32)).view(1, -1, 1, 1)
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s

    def attention(module, query, key, value, *args, **kwargs):
        ks, vs = scales[module.layer_idx]
        return sdpa_attention_forward(module, query, rnd(key, ks), rnd(value, vs), *args, **kwargs)
    return attention


def hf_fp8kv(model_dir, scales):
    from transformers import AttentionInterface, AutoModelForCausalLM
    AttentionInterface.register("taper_test_fp8kv", fake_quantized_attention(scales))
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="taper_test_fp8kv").eval()


def prefill_logits(model, kv_dtype):
    from engine.runner.forward_batch import ForwardBatch
    L = len(PROMPT)
    shape = model.kv_cache_shape(2, 16)
    kv = [(np.zeros(shape, kv_dtype), np.zeros(shape, kv_dtype)) for _ in range(model.num_layers)]
    batch = ForwardBatch(np.array(PROMPT, np.int32), np.arange(L, dtype=np.int32),
                         np.arange(16, 16 + L, dtype=np.int32), np.array([0, L], np.int32),
                         np.array([L], np.int32), np.array([[1]], np.int32),
                         np.array([L - 1], np.int32))
    return model.forward(batch, kv)[0]


def test_fp8_kv_cache_greedy_matches_transformers_with_fp8_kv(llama_dir):
    from engine import LLM
    ones = {i: (np.ones(2), np.ones(2)) for i in range(2)}
    reference = hf_greedy(hf_fp8kv(llama_dir, ones), PROMPT, GEN, tie=MARGIN)
    llm = LLM(llama_dir, num_kv_blocks=32, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv_caches[0][0].dtype == np.uint8
    assert_matches(greedy(llm), reference, label="fp8 kv")
    # the FP8 cache is visible: float KV gives other tokens within the trusted range, and other
    # logits from Taper's own model
    float_tokens = hf_greedy(load_hf(llama_dir), PROMPT, GEN, tie=MARGIN)[0]
    assert float_tokens[:reference[1]] != reference[0][:reference[1]]
    model = llm.engine.model
    diff = np.abs(prefill_logits(model, np.uint8) - prefill_logits(model, np.float32)).max()
    assert 1e-3 < diff < 1.0


def test_fp8_kv_cache_uses_checkpoint_scales(llama_dir, tmp_path):
    """k_scale / v_scale from the checkpoint (per tensor in layer 0, per KV head in layer 1, under
    two of the names checkpoints use) reach the cache ops: Taper follows transformers rounding K/V
    with the same scales, whose tokens differ from those with scale 1.0."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine import LLM
    # calibration-like values (|K|, |V| reach about 4-5 here: amax / 448 ~ 0.01)
    scales = {0: (np.float32([0.0123, 0.0123]), np.float32([0.0097, 0.0097])),
              1: (np.float32([0.0111, 0.0139]), np.float32([0.0089, 0.0105]))}
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0123)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.0097)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.from_numpy(scales[1][0])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.from_numpy(scales[1][1])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(llama_dir, "config.json"), tmp_path)
    reference = hf_greedy(hf_fp8kv(llama_dir, scales), PROMPT, GEN, tie=MARGIN)
    ones = {i: (np.ones(2), np.ones(2)) for i in range(2)}
    unscaled = hf_greedy(hf_fp8kv(llama_dir, ones), PROMPT, GEN, tie=MARGIN)[0]
    assert unscaled[:reference[1]] != reference[0][:reference[1]]
    llm = LLM(str(tmp_path), num_kv_blocks=32, kv_cache_dtype="fp8")
    attn = [layer.attention for layer in llm.engine.model.layers]
    np.testing.assert_array_equal(attn[1].k_scale, scales[1][0])
    np.testing.assert_array_equal(attn[0].v_scale, scales[0][1])
    assert_matches(greedy(llm), reference, label="fp8 kv, checkpoint scales")
    # a float KV cache ignores the scales
    float_kv = LLM(str(tmp_path), num_kv_blocks=32)
    assert greedy(float_kv, n=8) == greedy(LLM(llama_dir, num_kv_blocks=32), n=8)


def test_kv_scale_names_and_bad_values():
    from engine.models.kv_scales import take_kv_scales
    a0, a1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    w = {a0 + "k_proj.k_scale": np.float32(2), a0 + "v_proj.v_scale": np.float32([3]),
         a1 + "kv_scale": np.float32(5)}
    k, v = take_kv_scales(w, 0, 2)
    assert k.tolist() == [2, 2] and v.tolist() == [3, 3]
    k, v = take_kv_scales(w, 1, 2)
    assert k.tolist() == v.tolist() == [5, 5] and not w
    assert take_kv_scales({}, 0, 2) is None
    with pytest.raises(ValueError, match="one per KV head"):
        take_kv_scales({a0 + "k_scale": np.ones(3), a0 + "v_scale": np.ones(3)}, 0, 2)
    with pytest.raises(ValueError, match="positive"):
        take_kv_scales({a0 + "k_scale": np.zeros(1), a0 + "v_scale": np.ones(1)}, 0, 2)
    with pytest.raises(ValueError, match="but not"):
        take_kv_scales({a0 + "k_scale": np.ones(1)}, 0, 2)


def test_fp8_kv_block_bytes_and_bf16_on_cpu(llama_dir):
    from engine import LLM
    from engine.models.model_config import ModelConfig
    from engine.runner.model_runner import ModelRunner
    mc = ModelConfig.from_pretrained(llama_dir)
    assert ModelRunner.kv_bytes_per_block(mc, 16, "fp8") * 4 == ModelRunner.kv_bytes_per_block(mc, 16)
    llm = LLM(llama_dir, kv_cache_memory_mb=1, kv_cache_dtype="fp8")
    assert llm.engine.block_pool.num_blocks == 2**20 // ModelRunner.kv_bytes_per_block(mc, 16, "fp8")
    with pytest.raises(ValueError, match="bf16 KV cache is not yet supported"):
        LLM(llama_dir, num_kv_blocks=8, kv_cache_dtype="bf16")

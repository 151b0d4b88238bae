"""ggml's K quants (Q2_K..Q6_K) and the Q8_K activation format in pyx/quant_k.c.

1. Quantization is compared byte for byte with llama.cpp's own quantizer (ggml_quantize_chunk,
   no importance matrix; fixtures from tests/data/make_quant_k_fixtures.py, inputs rebuilt here
   bit-exactly from their recipe and checked against the recorded sha256).
2. Dequantization equals the gguf package's NumPy dequantizer exactly, on our blocks and on
   random bytes (every bit pattern of every field, not only the ones our quantizer writes).
3. `linear` on every ISA this CPU has, against float64 x @ dequantize(W).T. The kernel quantizes
   each activation row to Q8_K (per 256 elements, d = amax/127, |x - d*q| <= d/2), so the error
   is bounded by sum over blocks of amax/254 * sum |W|; and against the same float64 product on
   the Q8_K-rounded activations, where only float32 accumulation is left (rtol 1e-5). ISA paths
   agree with the scalar one to 1e-5 relative (they do the integer work exactly and the float
   work in the same order, so in practice they are bit-identical). With kernels act_split=on
   it writes each row as two Q8_K rows, hi = Q8_K(x) and lo = Q8_K(x - hi) (|x - hi - lo| <=
   amax/254^2) and dots the weights with both: the same checks with that bound, which the one-row
   arithmetic misses.
4. The checks can fail: one corrupted scale byte changes the dequantized weights, breaks byte
   identity with llama.cpp and moves `linear` outside its tolerance.
"""
import importlib.util
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from pyx.cpu_backend import (CpuBackend, dequantize, dequantize_weight, isa_supported,
                              quant_block_size, quant_gemv_max_t, quantize)
from pyx.weights.ggml import QuantizedWeight

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FIXTURES = os.path.join(DATA, "quant_k")
WEIGHT_TYPES = {"q2_K": QT.Q2_K, "q3_K": QT.Q3_K, "q4_K": QT.Q4_K, "q5_K": QT.Q5_K,
                "q6_K": QT.Q6_K}
ALL_TYPES = {**WEIGHT_TYPES, "q8_K": QT.Q8_K}
BLOCK_BYTES = {"q2_K": 84, "q3_K": 110, "q4_K": 144, "q5_K": 176, "q6_K": 210, "q8_K": 292}
# byte offsets of the f16 super-block scales (d, and dmin where the type has one)
HALF_FIELDS = {"q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,)}
# a byte holding (part of) the first group's scale
SCALE_BYTE = {"q2_K": 0, "q3_K": 96, "q4_K": 4, "q5_K": 4, "q6_K": 192}
ISAS = [isa for isa in ("scalar", "avx2", "avx512") if isa_supported(isa)]
# More token rows than every type's and ISA's quant_gemv_max_t: `linear` multiplies float32 panels
# of dequantize(W) with the float32 x (no Q8_K rounding), held to float64 within k unit roundoffs
# of float32 accumulation.
PANEL_T = 33


def takes_float32(name, isa, T) -> bool:
    """Whether `linear` multiplies float32 dequantize(W) for T rows (else the Q8_K loop)."""
    return T > quant_gemv_max_t(int(WEIGHT_TYPES[name]), isa)


def _load_fixture_script():
    spec = importlib.util.spec_from_file_location(
        "make_quant_k_fixtures", os.path.join(DATA, "make_quant_k_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only numpy at module level
    return module


mk = _load_fixture_script()


@pytest.fixture(scope="module")
def inputs():
    recorded = np.load(os.path.join(FIXTURES, "inputs.npz"))
    out = {}
    for recipe in mk.RECIPES:
        x = mk.make_inputs(recipe)
        assert mk.sha256(x) == str(recorded[f"sha256_{recipe}"]), \
            f"recipe {recipe!r} no longer rebuilds the fixture inputs bit-exactly"
        out[recipe] = x
    return out


def identical_blocks(ours, ref, name):
    """(identical, total) block counts of two (rows, row_bytes) arrays."""
    a, b = ours.reshape(-1, BLOCK_BYTES[name]), ref.reshape(-1, BLOCK_BYTES[name])
    same = (a == b).all(axis=1)
    return int(same.sum()), same.size


def random_blocks(name, rows, k, seed):
    """Random bytes with finite f16 super-block scales in [-2, 2] (weight types)."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    b = rng.integers(0, 256, (rows, nb, BLOCK_BYTES[name]), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        h = rng.uniform(-2, 2, (rows, nb)).astype(np.float16)
        b[:, :, off:off + 2] = h.view(np.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, -1)


def test_block_sizes():
    for name, t in ALL_TYPES.items():
        assert quant_block_size(t) == (256, BLOCK_BYTES[name])


# ---- 1. quantization: byte identity with llama.cpp


@pytest.mark.parametrize("name", list(ALL_TYPES))
def test_quantize_matches_llama_cpp(name, inputs):
    fixtures = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    same = total = 0
    bad = []
    for recipe, x in inputs.items():
        ours = quantize(ALL_TYPES[name], x)
        s, n = identical_blocks(ours, fixtures[f"blocks_{recipe}"], name)
        same, total = same + s, total + n
        if s != n:
            bad.append(f"{recipe}: {n - s}/{n}")
    assert same / total >= 0.999, f"{name}: {same}/{total} blocks byte-identical ({bad})"


# ---- 2. dequantization: exactly gguf's


@pytest.mark.parametrize("name", list(WEIGHT_TYPES))
def test_dequantize_matches_gguf(name, inputs):
    t = WEIGHT_TYPES[name]
    blocks = [quantize(t, x) for x in inputs.values()] + [random_blocks(name, 16, 768, 7)]
    for b in blocks:
        ours = dequantize(t, b, 768)
        theirs = gguf_dequantize(b, t).reshape(ours.shape)
        np.testing.assert_array_equal(ours, theirs)
        for isa in ISAS[1:]:   # the SIMD dequantizers of the batched decode and prefill paths
            np.testing.assert_array_equal(dequantize(t, b, 768, isa), theirs, err_msg=isa)


def test_q8_K_dequantize_and_bsums(inputs):
    for x in inputs.values():
        b = quantize(QT.Q8_K, x).reshape(-1, 292)
        d = b[:, :4].copy().view(np.float32)
        qs = b[:, 4:260].view(np.int8).astype(np.int32)
        bsums = b[:, 260:].copy().view(np.int16)
        np.testing.assert_array_equal(bsums, qs.reshape(-1, 16, 16).sum(-1))
        assert np.abs(qs).max() <= 127
        np.testing.assert_array_equal(dequantize(QT.Q8_K, b, 256), d * qs.astype(np.float32))


# ---- 3. linear on the packed blocks, every ISA


def q8_K_once(x):
    """x quantized to Q8_K and back, in float32 as the kernel computes it (ggml's rounding)."""
    return dequantize(QT.Q8_K, quantize(QT.Q8_K, x), x.shape[1])


def q8_K_round(x, parts=1):
    """The activations as the kernel sees them (float64): Q8_K(x); with parts=2, hi = Q8_K(x)
    plus lo = Q8_K of the float32 residual x - hi."""
    hi = q8_K_once(x)
    if parts == 1:
        return hi.astype(np.float64)
    return hi.astype(np.float64) + q8_K_once(x - hi).astype(np.float64)


def q8_K_bound(x, w, parts=1):
    """Worst-case |x @ w.T - Q8_K(x) @ w.T|: per 256-block |x - d q| <= d/2 = amax/254 (with
    1e-4 slack for the float rounding of d and of the products). parts=2: the residual's amax
    is at most amax/254, so hi + lo leave amax/254^2."""
    T, K = x.shape
    half_step = np.abs(x.reshape(T, K // 256, 256)).max(-1) / 254.0 ** parts * (1 + 1e-4)
    wsum = np.abs(w.reshape(w.shape[0], K // 256, 256)).sum(-1)                      # (N, nb)
    return half_step @ wsum.T


def run_linear(isa, name, blocks, k, x, bias=None, parts=1):
    """parts=2: a backend built with kernels act_split=on. quant_prefill=f32: beyond
    quant_gemv_max_t rows these tests hold the float32 panels; the int8 prefill that replaces
    them by default on AVX-512 gives the Q8_K loop's bits (tests/test_quant_gemm.py)."""
    w = QuantizedWeight.of(WEIGHT_TYPES[name], blocks, k)
    out = np.full((x.shape[0], blocks.shape[0]), np.nan, np.float32)
    kernels = {"act_split": "on" if parts == 2 else "off", "quant_prefill": "f32"}
    CpuBackend(isa=isa, kernels=kernels).linear(x, w, bias, out)
    return out


def linear_case(name, T, K, N, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, rng.integers(0, K, 3)] *= 20  # activation outliers: coarse Q8_K steps in their blocks
    if seed % 2:  # half the cases: our quantizer's blocks; the others: random bytes
        blocks = quantize(WEIGHT_TYPES[name], rng.standard_normal((N, K)).astype(np.float32))
    else:
        blocks = random_blocks(name, N, K, seed)
    return x, blocks


@pytest.mark.parametrize("name", list(WEIGHT_TYPES))
@pytest.mark.parametrize("K", [256, 768])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("parts", [1, 2])
def test_linear_every_isa(name, T, K, parts):
    N = 67
    x, blocks = linear_case(name, T, K, N, seed=T * 1000 + K + len(name) + int(WEIGHT_TYPES[name]))
    w = dequantize(WEIGHT_TYPES[name], blocks, K).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    xq = q8_K_round(x, parts)
    on_q8 = xq @ w.T
    scale = np.abs(xq) @ np.abs(w).T  # what float32 accumulation error is relative to
    bound = q8_K_bound(x.astype(np.float64), w, parts) + 1e-5 * scale
    scalar = run_linear("scalar", name, blocks, K, x, parts=parts)
    abs_scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
    for isa in ISAS:
        out = scalar if isa == "scalar" else run_linear(isa, name, blocks, K, x, parts=parts)
        assert np.isfinite(out).all()
        if takes_float32(name, isa, T):   # float32 activations: no Q8_K bound applies
            assert (np.abs(out - exact) <= K * 2.0 ** -24 * abs_scale + 1e-6).all(), isa
            continue
        assert (np.abs(out - exact) <= bound).all(), f"{isa}: outside the Q8_K bound"
        assert (np.abs(out - on_q8) <= 1e-5 * scale).all(), f"{isa}: beyond f32 accumulation"
        assert (np.abs(out - scalar) <= 1e-5 * scale).all(), f"{isa} differs from scalar"


@pytest.mark.parametrize("name", list(WEIGHT_TYPES))
def test_one_q8_K_row_misses_the_two_row_bound(name):
    """The default (one Q8_K row, ggml's arithmetic) is outside the bound that
    act_split=on is held to, so test_linear_every_isa[parts=2] fails without it."""
    T, K, N = 2, 768, 67
    x, blocks = linear_case(name, T, K, N, seed=11 + int(WEIGHT_TYPES[name]))
    w = dequantize(WEIGHT_TYPES[name], blocks, K).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    tol = q8_K_bound(x, w, parts=2) + 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    for isa in ISAS:
        assert not (np.abs(run_linear(isa, name, blocks, K, x) - exact) <= tol).all(), isa
    for isa in ISAS:
        assert (np.abs(run_linear(isa, name, blocks, K, x, parts=2) - exact) <= tol).all(), isa


@pytest.mark.parametrize("name", list(WEIGHT_TYPES))
@pytest.mark.parametrize("T,N", [(PANEL_T, 67), (100, 600), (16, 600)])
def test_linear_panel_path_every_isa(name, T, N):
    """Prefill (T > every quant_gemv_max_t), and 16 rows where an ISA takes the batched decode's
    float32 chunks (quant_linear_chunks): float32 panels of dequantize(W) times the float32 x, with a
    bias, on every ISA, against float64 within float32 accumulation (K = 4864 spans 19 blocks,
    ffn_down's rows; N = 600 makes two 8 MB panels there)."""
    K = 4864
    x, blocks = linear_case(name, T, K, N, seed=T + N + int(WEIGHT_TYPES[name]))
    bias = np.random.default_rng(N).standard_normal(N).astype(np.float32)
    w = dequantize(WEIGHT_TYPES[name], blocks, K).astype(np.float64)
    exact = x.astype(np.float64) @ w.T + bias
    tol = K * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w).T + np.abs(bias)) + 1e-6
    for isa in [i for i in ISAS if takes_float32(name, i, T)]:
        out = run_linear(isa, name, blocks, K, x, bias)
        assert np.isfinite(out).all()
        err = np.abs(out - exact)
        assert (err <= tol).all(), f"{isa}: max err/tol {np.max(err / tol):.3g}"


@pytest.mark.parametrize("isa", ISAS)
def test_linear_bias_and_fused_parts(isa):
    """Two types stacked along N (as a fused GGUF weight) with a bias: each part writes its
    column slice."""
    rng = np.random.default_rng(5)
    K = 512
    x = rng.standard_normal((4, K)).astype(np.float32)
    a = quantize(QT.Q4_K, rng.standard_normal((20, K)).astype(np.float32))
    b = quantize(QT.Q6_K, rng.standard_normal((12, K)).astype(np.float32))
    w = QuantizedWeight.concat([QuantizedWeight.of(QT.Q4_K, a, K),
                                QuantizedWeight.of(QT.Q6_K, b, K)])
    bias = rng.standard_normal(32).astype(np.float32)
    out = np.zeros((4, 32), np.float32)
    CpuBackend(isa=isa).linear(x, w, bias, out)
    wd = dequantize_weight(w).astype(np.float64)
    xq = q8_K_round(x)
    np.testing.assert_allclose(out, xq @ wd.T + bias, rtol=0,
                               atol=1e-5 * (np.abs(xq) @ np.abs(wd).T).max())


# ---- 4. the checks can fail


@pytest.mark.parametrize("name", list(WEIGHT_TYPES))
def test_corrupted_scale_is_caught(name, inputs):
    t = WEIGHT_TYPES[name]
    fixtures = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    ref = fixtures["blocks_normal"]
    bad = quantize(t, inputs["normal"])
    bad[0, SCALE_BYTE[name]] ^= 0x01  # row 0, super-block 0: the first group's scale LSB
    # dequantize sees it, in the first group only (16 elements, or 32 for Q4_K/Q5_K)
    diff = np.nonzero(dequantize(t, bad, 768) != dequantize(t, ref, 768))
    assert set(diff[0]) == {0} and 0 < len(diff[1]) and diff[1].max() < 32
    # the byte comparison sees it
    same, total = identical_blocks(bad, ref, name)
    assert same == total - 1 and same / total < 0.999
    # and linear lands outside the accumulation tolerance of the true weights' product
    x = np.zeros((1, 768), np.float32)
    x[0, :32] = np.linspace(1, 2, 32, dtype=np.float32)  # weight on the corrupted group
    w = dequantize(t, ref, 768).astype(np.float64)
    xq = q8_K_round(x)
    out = run_linear(ISAS[-1], name, bad, 768, x)
    err, tol = np.abs(out - xq @ w.T)[0], 1e-5 * (np.abs(xq) @ np.abs(w).T)[0]
    assert err[0] > 10 * tol[0]  # the least significant scale bit, still 10x the tolerance
    assert (err[1:] <= tol[1:]).all()

"""The int8 prefill GEMMs of the K types (pyx/quant_gemm.c) and of the legacy types
(pyx/quant_gemm_legacy.c), kernels quant_prefill=int8.

Beyond quant_gemv_max_t token rows on AVX-512, `linear` on a Q2_K..Q6_K weight quantizes the
activations to Q8_K (two rows per token under act_split) and multiplies them with the unpacked
weights in int8 tiles of 4 weight rows x 4 activation rows. Its integer sums are exact and its
float steps are vec_dot's, per pair and in vec_dot's block order, so it must equal the scalar
vec_dot reference bit for bit: here the same rows one at a time through the scalar ISA (T = 1 is
always the vec_dot loop). Shapes are odd on purpose: T and N not multiples of the tile (4) nor
of the weight panel (16), K of one to nine super-blocks, a bias, and a fused weight whose parts
write column slices (ldo > N).

The legacy types (Q4_0 .. Q8_0, from int8_min_t rows on AVX512_VNNI; by default and with
act_split's two rows only up to quant_gemv_max_t, the loop's range; at every T under
quant_prefill=int8_all) quantize the activations to
Q8_0 / Q8_1 and must equal the AVX-512 vec_dot loop bit for bit: its float order (8 FMA lanes per
block, even and odd blocks apart, one reduction) is not the scalar body's, so the reference is
that loop, one row per call with quant_prefill=f32 (T = 1 never leaves it). K is any multiple of
32 here: one block, odd block counts (the vec_dot's AVX2 tail) and even ones.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pyx.cpu_backend import (CpuBackend, isa_supported, quant_gemv_max_t, quant_prefill_int8,
                              quantize)
from pyx.weights.ggml import QuantizedWeight

TYPES = {"q2_K": QT.Q2_K, "q3_K": QT.Q3_K, "q4_K": QT.Q4_K, "q5_K": QT.Q5_K, "q6_K": QT.Q6_K}
LEGACY = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q8_0": QT.Q8_0}

pytestmark = pytest.mark.skipif(
    not isa_supported("avx512") or not quant_prefill_int8(int(QT.Q4_K), "avx512"),
    reason="the int8 prefill runs on AVX-512 only")


def linear(w, x, bias=None, isa="avx512", **kernels):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    CpuBackend(isa=isa, num_threads=2, kernels=kernels).linear(x, w, bias, out)
    return out


def scalar_rows(w, x, bias=None, act_split="off"):
    """The reference: scalar vec_dot, one token row per call."""
    return np.concatenate([linear(w, x[t:t + 1], bias, "scalar", act_split=act_split)
                           for t in range(x.shape[0])])


def case(qtype, T, K, N, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[:, rng.integers(0, K, 2)] *= 8          # outlier columns: scales far from each other
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, rng.integers(0, K, 3)] *= 20
    bias = rng.standard_normal(N).astype(np.float32)
    return QuantizedWeight.of(qtype, quantize(qtype, w), K), x, bias


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("T,K,N", [(0, 256, 5), (37, 768, 67), (70, 2304, 33)])
@pytest.mark.parametrize("act_split", ["off", "on"])
def test_int8_prefill_equals_scalar_vec_dot(name, T, K, N, act_split):
    """T = 0 stands for the type's smallest int8 T (4 or 33: quant_k.c, int8_min_t)."""
    qtype = TYPES[name]
    T = T or quant_prefill_int8(int(qtype), "avx512")
    assert T >= quant_prefill_int8(int(qtype), "avx512") > 0   # the int8 path, not the loop
    w, x, bias = case(qtype, T, K, N, seed=T + K + N + int(qtype))
    ref = scalar_rows(w, x, bias, act_split)
    out = linear(w, x, bias, act_split=act_split)
    assert np.isfinite(out).all()
    bad = np.argwhere(out != ref)
    assert not len(bad), (f"{len(bad)} of {out.size} differ, first {bad[:3].tolist()}, "
                          f"max {np.abs(out - ref).max():.3g}")


def test_fused_parts_write_their_columns():
    """Q4_K and Q6_K stacked along N (a fused GGUF weight, each part with ldo = 29)."""
    rng = np.random.default_rng(3)
    T, K = 21, 512
    a = quantize(QT.Q4_K, rng.standard_normal((18, K)).astype(np.float32))
    b = quantize(QT.Q6_K, rng.standard_normal((11, K)).astype(np.float32))
    w = QuantizedWeight.concat([QuantizedWeight.of(QT.Q4_K, a, K),
                                QuantizedWeight.of(QT.Q6_K, b, K)])
    x = rng.standard_normal((T, K)).astype(np.float32)
    bias = rng.standard_normal(29).astype(np.float32)
    assert np.array_equal(linear(w, x, bias), scalar_rows(w, x, bias))


def test_quant_prefill_f32_keeps_the_float32_panels():
    """The switch: quant_prefill=f32 multiplies float32 activations (no Q8_K rounding), so its
    results are not the vec_dot loop's; int8 gives exactly those."""
    w, x, bias = case(QT.Q4_K, 40, 768, 24, seed=9)
    ref = scalar_rows(w, x, bias)
    assert np.array_equal(linear(w, x, bias, quant_prefill="int8"), ref)
    f32 = linear(w, x, bias, quant_prefill="f32")
    assert not np.array_equal(f32, ref)
    assert np.allclose(f32, ref, rtol=0, atol=0.05 * np.abs(ref).max())


def avx512_rows(w, x, bias=None, act_split="off"):
    """The legacy types' reference: the AVX-512 vec_dot loop, one token row per call."""
    return np.concatenate([linear(w, x[t:t + 1], bias, act_split=act_split, quant_prefill="f32")
                           for t in range(x.shape[0])])


def legacy_min_t(qtype):
    min_t = quant_prefill_int8(int(qtype), "avx512")
    if not min_t:
        pytest.skip("the legacy int8 prefill needs AVX512_VNNI")
    return min_t


@pytest.mark.parametrize("name", list(LEGACY))
@pytest.mark.parametrize("T,K,N,act_split", [
    (0, 32, 5, "off"), (37, 96, 67, "off"), (9, 864, 18, "off"), (70, 2304, 33, "off"),
    (0, 32, 5, "on"), (0, 96, 67, "on"), (4, 864, 18, "on"), (4, 2304, 33, "on")])
def test_legacy_int8_prefill_equals_avx512_vec_dot(name, T, K, N, act_split):
    """T = 0 stands for the type's smallest int8 T; act_split=on only up to the loop's range."""
    qtype = LEGACY[name]
    min_t = legacy_min_t(qtype)
    T = T or min_t
    assert T >= min_t
    assert act_split == "off" or T <= quant_gemv_max_t(int(qtype), "avx512")
    w, x, bias = case(qtype, T, K, N, seed=T + K + N + int(qtype))
    ref = avx512_rows(w, x, bias, act_split)
    out = linear(w, x, bias, act_split=act_split, quant_prefill="int8_all")
    assert np.isfinite(out).all()
    bad = np.argwhere(out != ref)
    assert not len(bad), (f"{len(bad)} of {out.size} differ, first {bad[:3].tolist()}, "
                          f"max {np.abs(out - ref).max():.3g}")


@pytest.mark.parametrize("name", ["q8_0", "q4_1"])
@pytest.mark.parametrize("prefill,act_split", [("int8", "off"), ("int8", "on"),
                                               ("int8_all", "on")])
def test_legacy_beyond_the_loop_keep_the_float32_paths(name, prefill, act_split):
    """Past quant_gemv_max_t, by default (quant_prefill=int8) and with act_split's two rows: the
    float32 chunks (T = 5) and panels (T = 40) with the float32 activations, as
    quant_prefill=f32, not the loop's bits; up to it (T = 4) the int8 GEMM, the loop's bits."""
    qtype = LEGACY[name]
    legacy_min_t(qtype)
    max_t = quant_gemv_max_t(int(qtype), "avx512")
    for T in (max_t, max_t + 1, 40):
        w, x, bias = case(qtype, T, 864, 37, seed=T)
        out = linear(w, x, bias, act_split=act_split, quant_prefill=prefill)
        loop = avx512_rows(w, x, bias, act_split)
        if T <= max_t:
            assert np.array_equal(out, loop)
            continue
        assert np.array_equal(out, linear(w, x, bias, act_split=act_split, quant_prefill="f32"))
        assert not np.array_equal(out, loop)


def test_legacy_fused_parts_write_their_columns():
    """Q8_0 and Q5_1 (activations Q8_0 and Q8_1) stacked along N, each part with ldo = 23."""
    legacy_min_t(QT.Q5_1)
    rng = np.random.default_rng(4)
    T, K = 19, 160
    a = quantize(QT.Q8_0, rng.standard_normal((14, K)).astype(np.float32))
    b = quantize(QT.Q5_1, rng.standard_normal((9, K)).astype(np.float32))
    w = QuantizedWeight.concat([QuantizedWeight.of(QT.Q8_0, a, K),
                                QuantizedWeight.of(QT.Q5_1, b, K)])
    x = rng.standard_normal((T, K)).astype(np.float32)
    bias = rng.standard_normal(23).astype(np.float32)
    assert np.array_equal(linear(w, x, bias, quant_prefill="int8_all"), avx512_rows(w, x, bias))

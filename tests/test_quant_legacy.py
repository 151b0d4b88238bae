"""ggml's legacy block types Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (pyx/quant_legacy.c).

Quantize is pinned byte for byte to the gguf package (what a GGUF file written by llama.cpp's
tools holds), dequantize bit for bit. `linear` runs on every ISA path this CPU has and is held to
two references: float64 x @ dequantize(W).T within a worst-case bound on what quantizing x to
8 bits adds (derived at `activation_error_bound`), and float64 on an emulation of that activation
quantization, where only float32 accumulation is left. With kernels act_split=on each row is
written as two 8-bit rows (hi = Q8(x), lo = Q8(x - hi)): the same checks with the two-row bound
and emulation, which the default one-row arithmetic misses. Beyond `quant_gemv_max_t(type, isa)`
token rows (prefill; batched decode from 5 rows under AVX-512) `linear` multiplies float32
dequantize(W) with the float32 x instead, and is held to float64 x @ dequantize(W).T within
float32 accumulation alone. The last tests show the checks can fail.
"""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, quants

from pyx.cpu_backend import (CpuBackend, dequantize, isa_supported, quant_block_size,
                              quant_gemv_max_t, quantize)
from pyx.weights.ggml import QuantizedWeight

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]
WITH_MIN = {QT.Q4_1, QT.Q5_1}       # blocks (d, m, ...) that dot with Q8_1 activations
NIBBLES = {QT.Q4_0: 2, QT.Q4_1: 4, QT.Q5_0: 6, QT.Q5_1: 8}    # offset of qs in the block
QH = {QT.Q5_0: 2, QT.Q5_1: 4}                                   # offset of qh
ISAS = [i for i in ("scalar", "avx2", "avx512") if isa_supported(i)]
QK = 32
ACCUM_RTOL = 2e-6   # float32 accumulation over <= 24 blocks, relative to the sum of |terms|;
#                     measured <= 4e-8
F32_PREFILL = {"quant_prefill": "f32"}   # as run_linear (below)
PANEL_T = 33   # past every type's and ISA's quant_gemv_max_t: the float32 panel + GEMM path


def takes_panels(qtype, isa, T) -> bool:
    return T > quant_gemv_max_t(int(qtype), isa)


def f32_rtol(k):
    """Worst-case float32 accumulation error of a k-term dot product relative to the sum of
    |terms| (k unit roundoffs), for the panel path where nothing else is rounded."""
    return k * 2.0 ** -24


def ids(types):
    return [t.name for t in types]


def test_block_sizes_match_gguf():
    for t in TYPES:
        assert quant_block_size(int(t)) == GGML_QUANT_SIZES[t]
    # Q8_1 is ggml's current (f16 d, f16 s, 32 int8) = 36 bytes; gguf's table still lists the old
    # f32 layout (40). It is an activation format only and never appears in a file.
    assert quant_block_size(int(QT.Q8_1)) == (32, 36)


# ---- quantize / dequantize against gguf


def awkward_rows(k):
    """Rows that exercise the quantizers' edge cases, each a multiple of 32 long."""
    rng = np.random.default_rng(7)
    nb = k // QK
    rows = {
        "zeros": np.zeros(k),                          # d = 0 -> id = 0; Q4_0 stores d = -0.0
        "neg_zeros": -np.zeros(k),
        "constant": np.full(k, 3.0),                   # Q4_1/Q5_1: max == min
        "outlier": rng.standard_normal(k) * 0.01,      # one block scale dominated by 1e4
        "negative": -np.abs(rng.standard_normal(k)),   # max-magnitude value negative -> d > 0
        "tiny": rng.standard_normal(k) * 1e-6,         # d is an f16 subnormal
        "f16_overflow": rng.standard_normal(k) * 1e6,  # d rounds to f16 inf, as gguf's does
    }
    rows["outlier"][5] = 1e4
    # magnitude ties: the first of +5 / -5 sets the sign of d
    ties = rng.uniform(-4, 4, k)
    ties[0::QK], ties[3::QK] = 5.0, -5.0
    ties[QK::2 * QK], ties[QK + 3::2 * QK] = -5.0, 5.0
    rows["ties"] = ties
    # half-integers where x * id lands exactly on a rounding boundary: Q4_0/Q5_0 get d = -1
    # (or +-0.5) from the +-8 in each block, Q4_1 d = 1, Q8_0 round-half-away cases at id = 1
    halves = rng.integers(-16, 17, k) / 2.0
    halves[0::QK], halves[1::QK] = 8.0, -8.0
    rows["halves"] = halves
    q8 = rng.integers(-254, 255, k) / 2.0
    q8[0::QK] = 127.0
    rows["q8_halves"] = q8
    assert all(r.shape == (k,) for r in rows.values()) and nb >= 1
    return np.stack(list(rows.values())).astype(np.float32)


def data_cases():
    rng = np.random.default_rng(0)
    cases = {}
    for rows, k in [(1, 32), (5, 96), (16, 256), (40, 64)]:
        scale = 10.0 ** rng.uniform(-3, 3, (rows, 1))
        cases[f"normal{rows}x{k}"] = (rng.standard_normal((rows, k)) * scale).astype(np.float32)
    cases["awkward"] = awkward_rows(128)
    return cases


DATA = data_cases()


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
@pytest.mark.parametrize("case", list(DATA))
def test_quantize_and_dequantize_match_gguf(qtype, case):
    x = DATA[case]
    with np.errstate(over="ignore", invalid="ignore"):   # f16_overflow: d -> inf, inf * 0
        ref = quants.quantize(x, qtype)
        ref_deq = quants.dequantize(ref, qtype)
    ours = quantize(int(qtype), x)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    bad = np.argwhere(ours != ref)
    assert bad.size == 0, f"first differing (row, byte): {bad[:5].tolist()}"
    deq = dequantize(int(qtype), ours, x.shape[1])
    assert deq.dtype == np.float32
    np.testing.assert_array_equal(deq, ref_deq)          # NaN where gguf has NaN, bit-equal else
    if x.shape[0] > 1:                                    # OpenMP over rows changes nothing
        np.testing.assert_array_equal(quantize(int(qtype), x, num_threads=3), ours)


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
def test_dequantize_arbitrary_blocks_matches_gguf(qtype):
    """Every code a file can hold (Q8_0's -128, all nibbles and qh bits), finite f16 scales."""
    rng = np.random.default_rng(1)
    blocks = random_blocks(rng, qtype, rows=8, k=256)
    np.testing.assert_array_equal(dequantize(int(qtype), blocks, 256),
                                  quants.dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
def test_simd_dequantize_is_bit_identical(qtype):
    """The SIMD dequantizer the panel path uses (AVX2, and AVX-512 machines) against gguf's,
    on every code, with f16 scales of every exponent range, subnormals included."""
    rng = np.random.default_rng(2)
    blocks = random_blocks(rng, qtype, rows=16, k=256).reshape(16, 8, -1)
    scales = np.array([6e-8, 1e-5, 0.5, 3.0, 900.0, -2e-3, 65504.0, -1.0], np.float16)
    blocks[:, :, 0:2] = np.resize(scales, (16, 8, 1)).view(np.uint8)
    blocks = blocks.reshape(16, -1)
    ref = quants.dequantize(blocks, qtype)
    for isa in ISAS:
        np.testing.assert_array_equal(dequantize(int(qtype), blocks, 256, isa), ref, err_msg=isa)


def random_blocks(rng, qtype, rows, k):
    """Uniformly random code bytes with sane f16 d (and m) so products stay finite."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, k // bs, ts), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(1e-3, 1e-1, (rows, k // bs, 1)).astype(np.float16).view(np.uint8)
    if qtype in WITH_MIN:
        blocks[..., 2:4] = rng.uniform(-1, 1, (rows, k // bs, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


# ---- linear against float64


def activation_error_bound(x, blocks, qtype, k, parts=1):
    """Worst case of |linear - x @ W.T| that the 8-bit activation rows allow, per (t, n).

    One row (the default, ggml's): x is quantized per 32-element block with d = amax / 127 and
    stored as q * f16(d), so each element is off by at most d/2 (rounding; x * id is exact to
    3e-5) plus 127 d 2^-11 (the f16 rounding of d): 0.5625 d. The _1 types compute
    sum_k (w_k - m) x~_k + m s with s = f16(d sum q), and |s - sum_k x_k| <= 16 d + 2 d, so a
    block contributes d (0.5625 sum_k |w_k| + (0.5625 * 32 + 18) |m|) = d (0.5625 sum_k |w_k| +
    36 |m|).
    Two rows (parts=2, kernels act_split=on): lo quantizes the residual r = x - hi, whose
    amax is <= 0.5625 d, so each element is off by 0.5625 * 0.5625 d / 127 < 0.0025 d; lo's s
    is f16(sum x - s_hi), off by 2^-11 |sum x - s_hi| <= 2^-11 * 20 d = 0.01 d: a block gives
    d (0.0025 sum_k |w_k| + (0.0025 * 32 + 0.01) |m|) < d (0.0025 sum_k |w_k| + 0.1 |m|).
    """
    T, N, nb = x.shape[0], blocks.shape[0], k // QK
    d = np.abs(x.astype(np.float64)).reshape(T, nb, QK).max(-1) / 127         # (T, nb)
    w = dequantize(int(qtype), blocks, k).astype(np.float64)
    wabs = np.abs(w).reshape(N, nb, QK).sum(-1)                               # (N, nb)
    m = np.abs(block_mins(blocks, qtype)).astype(np.float64)                  # (N, nb)
    cw, cm = (0.5625, 36) if parts == 1 else (0.0025, 0.1)
    return d @ (cw * wabs + cm * m).T


def block_mins(blocks, qtype):
    bs, ts = GGML_QUANT_SIZES[qtype]
    b = blocks.reshape(blocks.shape[0], -1, ts)
    if qtype not in WITH_MIN:
        return np.zeros(b.shape[:2], np.float32)
    return np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)


def q8_rows(x):
    """x quantized per 32 as quantize_row_q8_0/q8_1_ref do (the gguf Q8_0 quantizer is the same
    formula): float64 levels q (T, nb, 32), f16 scales d (T, nb, 1), and the float32 d before
    its f16 rounding, which Q8_1's s = f16(d * sum q) uses."""
    T, k = x.shape
    nb = k // QK
    d32 = np.abs(x.reshape(T, nb, QK)).max(-1, keepdims=True) / np.float32(127)
    q8 = quants.quantize(x, QT.Q8_0).reshape(T, nb, 34)
    q = q8[..., 2:].view(np.int8).astype(np.float64)
    dd = np.ascontiguousarray(q8[..., :2]).view(np.float16).astype(np.float64)
    return q, dd, d32


def act_rows(x, parts=1):
    """The activations as the kernel multiplies them: [(x~ (T, k), s (T, nb))] per 8-bit row,
    float64. parts=2: hi, then lo = the rows of the float32 residual x - hi, whose s is
    f16(sum x - s_hi) (the float32 sum in element order, as the C loop adds)."""
    T, k = x.shape
    nb = k // QK
    q, dd, d32 = q8_rows(x)
    s_hi = (q.sum(-1, keepdims=True).astype(np.float32) * d32).astype(np.float16)[..., 0]
    rows = [((q * dd).reshape(T, k), s_hi.astype(np.float64))]
    if parts == 1:
        return rows
    hi32 = (q.astype(np.float32) * dd.astype(np.float32)).reshape(T, k)
    lq, ldd, _ = q8_rows(x - hi32)
    sum_x = np.cumsum(x.reshape(T, nb, QK), -1, dtype=np.float32)[..., -1]
    s_lo = (sum_x - s_hi.astype(np.float32)).astype(np.float16)
    return rows + [((lq * ldd).reshape(T, k), s_lo.astype(np.float64))]


def emulated_linear(x, blocks, qtype, k, parts=1):
    """ggml's computation in float64 on exactly the values it multiplies, once per activation
    row of act_rows: weights as d_w q_w (dequantized with m zeroed) plus m * s per block.
    Returns the result and the sum of |terms|, the scale of float32 accumulation error."""
    N, nb = blocks.shape[0], k // QK
    ts = GGML_QUANT_SIZES[qtype][1]
    w0 = blocks.reshape(N, nb, ts).copy()
    if qtype in WITH_MIN:
        w0[..., 2:4] = 0
    wq = dequantize(int(qtype), w0.reshape(N, -1), k).astype(np.float64)      # d_w q_w exactly
    m = block_mins(blocks, qtype).astype(np.float64)                          # (N, nb)
    out = scale = 0
    for xq, s in act_rows(x, parts):
        out = out + xq @ wq.T + s @ m.T
        scale = scale + np.abs(xq) @ np.abs(wq).T + np.abs(s) @ np.abs(m).T
    return out, scale


def run_linear(isa, qtype, x, blocks, k, bias, parts=1):
    """parts=2: a backend built with kernels act_split=on. quant_prefill=f32: these tests hold
    the vec_dot loop and the float32 chunks and panels; the int8 prefill that replaces the loop
    at 3-4 rows on AVX512_VNNI (and everything from 3 rows under quant_prefill=int8_all) gives
    the AVX-512 loop's bits (tests/test_quant_gemm.py)."""
    out = np.full((x.shape[0], blocks.shape[0]), np.nan, np.float32)
    backend = CpuBackend(isa=isa, num_threads=2,
                         kernels={"act_split": "on" if parts == 2 else "off",
                                  "quant_prefill": "f32"})
    backend.linear(x, QuantizedWeight.of(int(qtype), blocks, k), bias, out)
    return out


def check_linear(out, x, blocks, qtype, k, bias, isa, parts=1):
    """Asserts out against both float64 references (see the module docstring); where the ISA
    takes the panel path for these rows, against x @ dequantize(W).T within float32
    accumulation only."""
    w = dequantize(int(qtype), blocks, k).astype(np.float64)
    exact = x.astype(np.float64) @ w.T + bias
    sum_abs = np.abs(x.astype(np.float64)) @ np.abs(w).T + np.abs(bias)
    if takes_panels(qtype, isa, x.shape[0]):   # float32 activations, no Q8 rounding to emulate
        err = np.abs(out - exact)
        tol = f32_rtol(k) * sum_abs + 1e-6
        assert np.all(err <= tol), f"panel path: max err/tol {np.max(err / tol):.3g}"
        return
    bound = activation_error_bound(x, blocks, qtype, k, parts) + ACCUM_RTOL * sum_abs + 1e-6
    err = np.abs(out - exact)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"
    emu, scale = emulated_linear(x, blocks, qtype, k, parts)
    emu_err = np.abs(out - (emu + bias))
    emu_tol = ACCUM_RTOL * (scale + np.abs(bias)) + 1e-6
    assert np.all(emu_err <= emu_tol), f"max err/tol vs emulation {np.max(emu_err / emu_tol):.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
@pytest.mark.parametrize("T,K", [(1, 32), (3, 256), (17, 768), (17, 32), (1, 768), (3, 96)])
@pytest.mark.parametrize("parts", [1, 2])
def test_linear_every_isa(qtype, T, K, parts):
    rng = np.random.default_rng(T * 1000 + K)
    N = 64
    w = (rng.standard_normal((N, K)) * 0.5 + 0.1).astype(np.float32)   # offset: nonzero mins
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, : min(K, 64)] *= 30                                            # uneven activation blocks
    bias = rng.standard_normal(N).astype(np.float32)
    blocks = quantize(int(qtype), w)
    scalar = run_linear("scalar", qtype, x, blocks, K, bias, parts)
    check_linear(scalar, x, blocks, qtype, K, bias, "scalar", parts)
    _, scale = emulated_linear(x, blocks, qtype, K, parts)
    for isa in ISAS[1:]:
        out = run_linear(isa, qtype, x, blocks, K, bias, parts)
        check_linear(out, x, blocks, qtype, K, bias, isa, parts)
        if takes_panels(qtype, isa, T) != takes_panels(qtype, "scalar", T):
            continue   # one rounds x to Q8, the other not: each was held to its reference above
        # same integers per block, float sums in another order; on the panel path the float32
        # GEMMs of the ISAs sum K float products in different orders
        rtol = 2 * f32_rtol(K) if takes_panels(qtype, isa, T) else ACCUM_RTOL
        assert np.all(np.abs(out - scalar) <= rtol * (scale + np.abs(bias)) + 1e-6), isa


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
@pytest.mark.parametrize("T,K,N", [(PANEL_T, 96, 37), (64, 768, 70), (130, 256, 2300)])
def test_linear_panel_path_every_isa(qtype, T, K, N):
    """Prefill (T > every quant_gemv_max_t): float32 panels of dequantize(W) times the float32 x, on every
    ISA, with a bias, writing a column slice of a wider output (a fused weight's part: ldo > N).
    N = 2300 at K = 256 spans two panels (8 MB of float32 rows each)."""
    rng = np.random.default_rng(T + K + N)
    w = (rng.standard_normal((N, K)) * 0.5 + 0.1).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, : min(K, 64)] *= 30
    bias = rng.standard_normal(N).astype(np.float32)
    blocks = quantize(int(qtype), w)
    other = quantize(int(QT.Q8_0), rng.standard_normal((5, K)).astype(np.float32))
    fused = QuantizedWeight.concat([QuantizedWeight.of(qtype, blocks, K),
                                    QuantizedWeight.of(QT.Q8_0, other, K)])
    wd = dequantize(int(qtype), blocks, K).astype(np.float64)
    exact = x.astype(np.float64) @ wd.T + bias
    tol = f32_rtol(K) * (np.abs(x.astype(np.float64)) @ np.abs(wd).T + np.abs(bias)) + 1e-6
    for isa in ISAS:
        out = run_linear(isa, qtype, x, blocks, K, bias)
        err = np.abs(out - exact)
        assert np.all(err <= tol), f"{isa}: max err/tol {np.max(err / tol):.3g}"
        wide = np.full((T, N + 5), np.nan, np.float32)
        CpuBackend(isa=isa, kernels=F32_PREFILL).linear(x, fused, np.concatenate([bias, np.zeros(5, np.float32)]),
                                   wide)
        assert np.all(np.abs(wide[:, :N] - exact) <= tol), f"{isa}: fused part"
        assert np.isfinite(wide).all()


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
def test_linear_batched_decode_chunks_every_isa(qtype):
    """Batched decode (16 rows) on a weight of several of quant_linear_chunks' per-thread chunks
    (256 float32 rows of K = 256, the last one partial) and as one part of a fused weight
    (ldo > N), with a bias; on the ISAs whose loop it is, the Q8 references hold instead."""
    rng = np.random.default_rng(16)
    T, K, N = 16, 256, 700
    w = (rng.standard_normal((N, K)) * 0.5 + 0.1).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    blocks = quantize(int(qtype), w)
    other = QuantizedWeight.of(QT.Q8_0, quantize(int(QT.Q8_0), w[:3]), K)
    fused = QuantizedWeight.concat([other, QuantizedWeight.of(qtype, blocks, K)])
    for isa in ISAS:
        out = run_linear(isa, qtype, x, blocks, K, bias)
        check_linear(out, x, blocks, qtype, K, bias, isa)
        wide = np.full((T, N + 3), np.nan, np.float32)
        CpuBackend(isa=isa, kernels=F32_PREFILL).linear(x, fused, np.concatenate([np.zeros(3, np.float32), bias]),
                                   wide)
        np.testing.assert_array_equal(wide[:, 3:], out, err_msg=isa)


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
def test_linear_arbitrary_codes_every_isa(qtype):
    """Weights with every code (Q8_0 -128, nibble 0 and 15, all qh bits) and odd block counts,
    which the AVX-512 bodies finish with one AVX2 block."""
    rng = np.random.default_rng(3)
    for K in (32, 96, 288):
        blocks = random_blocks(rng, qtype, rows=37, k=K)
        x = rng.standard_normal((3, K)).astype(np.float32)   # 3 rows: every type's vec_dot loop
        bias = np.zeros(37, np.float32)
        for isa in ISAS:
            check_linear(run_linear(isa, qtype, x, blocks, K, bias), x, blocks, qtype, K, bias,
                         isa)


# ---- the checks can fail


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
def test_one_8bit_activation_row_misses_the_two_row_bound(qtype):
    """The default (one 8-bit row, ggml's arithmetic) fails check_linear's two-row bound, so
    test_linear_every_isa[parts=2] fails without act_split=on."""
    rng = np.random.default_rng(12)
    K, N = 256, 64
    w = (rng.standard_normal((N, K)) * 0.5 + 0.1).astype(np.float32)
    x = rng.standard_normal((2, K)).astype(np.float32)
    bias = np.zeros(N, np.float32)
    blocks = quantize(int(qtype), w)
    for isa in ISAS:
        with pytest.raises(AssertionError, match="max err/bound"):
            check_linear(run_linear(isa, qtype, x, blocks, K, bias), x, blocks, qtype, K, bias,
                         isa, parts=2)
    for isa in ISAS:
        check_linear(run_linear(isa, qtype, x, blocks, K, bias, parts=2), x, blocks, qtype, K,
                     bias, isa, parts=2)


@pytest.mark.parametrize("qtype", list(NIBBLES), ids=ids(NIBBLES))
def test_nibble_and_high_bit_positions_are_pinned(qtype):
    """Swapping the two nibbles of qs byte j must move exactly elements j and j + 16 of that
    block, and flipping qh bit j exactly element j by 16 d: an implementation with another
    nibble order or bit order would fail test_quantize_and_dequantize_match_gguf."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    blocks = quantize(int(qtype), x)
    base = dequantize(int(qtype), blocks, 64)[0]
    ts = GGML_QUANT_SIZES[qtype][1]
    qs = NIBBLES[qtype]
    j = next(j for j in range(16) if blocks[0, ts + qs + j] >> 4 != blocks[0, ts + qs + j] & 15)
    swapped = blocks.copy()
    b = swapped[0, ts + qs + j]
    swapped[0, ts + qs + j] = ((b & 15) << 4) | (b >> 4)                  # in the second block
    deq = dequantize(int(qtype), swapped, 64)[0]
    assert sorted(np.flatnonzero(deq != base)) == [QK + j, QK + j + 16]
    np.testing.assert_array_equal(deq, quants.dequantize(swapped, qtype)[0])
    assert not np.array_equal(swapped, quants.quantize(x, qtype))
    if qtype in QH:
        flipped = blocks.copy()
        flipped[0, QH[qtype] + j // 8] ^= 1 << (j % 8)                     # first block, bit j
        deq = dequantize(int(qtype), flipped, 64)[0]
        d = float(blocks[0, :2].view(np.float16)[0])
        assert np.flatnonzero(deq != base).tolist() == [j]
        assert abs(abs(deq[j] - base[j]) - 16 * abs(d)) <= 1e-6 * (1 + abs(base[j]))


@pytest.mark.parametrize("qtype", TYPES, ids=ids(TYPES))
def test_linear_check_catches_a_wrong_element_order(qtype):
    """A dot product that paired weights with the wrong activations (nibbles swapped, or Q8_0's
    halves swapped) must fail check_linear: the tolerances are not loose enough to hide it."""
    rng = np.random.default_rng(6)
    K, N = 256, 16
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((3, K)).astype(np.float32)
    bias = np.zeros(N, np.float32)
    blocks = quantize(int(qtype), w)
    ts = GGML_QUANT_SIZES[qtype][1]
    wrong = blocks.reshape(N, -1, ts).copy()
    if qtype in NIBBLES:
        qs = wrong[..., NIBBLES[qtype]:]
        qs[...] = ((qs & 15) << 4) | (qs >> 4)
    else:
        wrong[..., 2:] = np.roll(wrong[..., 2:], 16, axis=-1)
    wrong = wrong.reshape(N, -1)
    check_linear(run_linear("scalar", qtype, x, blocks, K, bias), x, blocks, qtype, K, bias,
                 "scalar")
    with pytest.raises(AssertionError):
        check_linear(run_linear("scalar", qtype, x, wrong, K, bias), x, blocks, qtype, K, bias,
                     "scalar")

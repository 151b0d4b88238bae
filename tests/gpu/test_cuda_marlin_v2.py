"""Marlin v2 (kernels marlin=v2: striped partitioning, ldmatrix A, lop3 dequantization; issue
12 item 4) against the CPU: the int4 weight dequantized by pyx.weights.int4 (Int4Weight, checked
bit for bit against the checkpoint formats' packers in tests/test_int4_formats.py) times the
activations, in float32 NumPy. Llama-3-8B's projection shapes, M from decode (1, 7, 16) to
prefill (33, 64, 1024); group size 128 (asymmetric zeros) and channel-wise (symmetric).

The GPU rounds each weight element once to the activation type and accumulates in float32, so the
comparison is relative; outputs are poisoned with NaN first. At small M the plan shares columns
between stripes (a workspace, the global reduce), which the test asserts, and the reduce sums in
block order, so two runs give the same bits.
"""
from __future__ import annotations

import numpy as np
import pytest

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}
MS = [1, 7, 16, 33, 64, 1024]
_WEIGHTS: dict = {}
_PLACED: dict = {}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def int4_weight(n, k, g, asym, seed=0):
    """Random codes, scales and zeros as an Int4Weight and its float32 dequantization (cached:
    gate_up's is 470 MB)."""
    from pyx.weights.int4 import Int4Part, Int4Weight
    key = (n, k, g, asym, seed)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        rng = np.random.default_rng(seed)
        gs = k if g == -1 else g
        codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, (n, k // gs)) / (8 * np.sqrt(k))).astype(np.float32)
        zeros = (rng.integers(0, 16, (n, k // gs)) if asym
                 else np.full((n, k // gs), 8)).astype(np.float32)
        w = Int4Weight([Int4Part.from_codes(codes, scales, zeros, gs)], k)
        _WEIGHTS[key] = (w, w.dequantize())
    return _WEIGHTS[key]


def placed_weight(b, w):
    """One device copy per host weight (place_weight repacks on the host: seconds for gate_up);
    the cached weight w stays alive with its copy, so the id is not reused."""
    key = (id(b), id(w))
    if key not in _PLACED:
        _PLACED.clear()
        _PLACED[key] = b.place_weight(w)
    return _PLACED[key]


def v2_linear(b, x, placed, out):
    b.marlin_v2 = True
    try:
        b.linear(x, placed, None, out)
    finally:
        b.marlin_v2 = False


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("layer", sorted(LLAMA3_8B))
@pytest.mark.parametrize("g,asym", [(128, True), (-1, False)], ids=["g128-asym", "channel-sym"])
def test_marlin_v2_matches_cpu_dequantize_matmul(make_cuda, layer, M, g, asym):
    from pyx.cuda_backend import marlin_workspace_bytes
    b = make_cuda("bf16")
    n, k = LLAMA3_8B[layer]
    w, w32 = int4_weight(n, k, g, asym)
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, k)).astype(b.act_dtype)
    want = x.astype(np.float32) @ w32.T
    placed = placed_weight(b, w)
    out = b.xp.full((M, n), np.nan, b.act_dtype)
    v2_linear(b, b.asarray(x), placed, out)
    got = b.to_host(out).astype(np.float32)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < 2e-2
    if M <= 16 and 2 * b.num_sms > -(-n // 256):
        # more stripes than 256-column slices: stripes share columns, the reduce ran
        assert marlin_workspace_bytes(M, n, k, 2) > 0
        out2 = b.xp.full((M, n), np.nan, b.act_dtype)
        v2_linear(b, b.asarray(x), placed, out2)
        np.testing.assert_array_equal(b.to_host(out2).view(np.uint16),
                                      b.to_host(out).view(np.uint16))


@pytest.mark.parametrize("M", [1, 7, 33, 64])
@pytest.mark.parametrize("n,k", [(200, 512), (4160, 1024)])
def test_marlin_v2_f16_and_partial_slices(make_cuda, M, n, k):
    """f16 activations (the x16 lop3 form of the odd nibbles), N not a multiple of the 256-column
    slices (the last slice's missing warps, padding columns never written)."""
    b = make_cuda("f16")
    w, w32 = int4_weight(n, k, 128, True, seed=1)
    x = np.random.default_rng(M).standard_normal((M, k)).astype(np.float16)
    want = x.astype(np.float32) @ w32.T
    out = b.xp.full((M, n), np.nan, b.act_dtype)
    v2_linear(b, b.asarray(x), b.place_weight(w), out)
    got = b.to_host(out).astype(np.float32)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < 1e-2


def test_marlin_v2_falls_back_for_groups_it_lacks(make_cuda):
    """Group size 32 (GPTQ v2 checkpoints): v2 needs multiples of 64 and the simple kernel runs."""
    b = make_cuda("bf16")
    w, w32 = int4_weight(256, 512, 32, True, seed=2)
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(b.act_dtype)
    out = b.xp.full((3, 256), np.nan, b.act_dtype)
    v2_linear(b, b.asarray(x), b.place_weight(w), out)
    assert rel_err(b.to_host(out).astype(np.float32), x.astype(np.float32) @ w32.T) < 2e-2


def test_marlin_v2_switch_from_the_kernel_config(make_cuda, monkeypatch):
    """kernels marlin=v2 turns it on (read by CudaBackend.__init__), marlin=pipeline the
    pipelined kernel, the default neither; the retired TAPER_CUDA_MARLIN is not read; a
    mistyped value is refused naming the key (tests/test_cuda_host.py)."""
    monkeypatch.setenv("TAPER_CUDA_MARLIN", "v2")
    default = make_cuda("bf16")
    assert (default.marlin_v2, default.marlin_pipeline) == (False, False)
    v2 = make_cuda("bf16", "marlin=v2")
    assert (v2.marlin_v2, v2.marlin_pipeline) == (True, False)
    pipelined = make_cuda("bf16", "marlin=pipeline")
    assert (pipelined.marlin_v2, pipelined.marlin_pipeline) == (False, True)

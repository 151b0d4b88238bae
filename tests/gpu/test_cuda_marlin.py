"""Int4 weights (GPTQ, AWQ, compressed-tensors) on the GPU through the Marlin-layout W4A16 GEMM
(issue 6, item 1) against the CPU backend's int4 linear on the same weights.

The GPU multiplies bf16/f16 activations with each weight element rounded once to that type, the
CPU f32 activations with f32 weights, so the comparison is relative (||gpu - cpu|| / ||cpu||).
Outputs are poisoned first; M covers one tile, a partial tile and several tiles; N is not a
multiple of the 64-column tiles, so the padding columns must never be written.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_marlin import CASES


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("kernel", ["simple", "pipelined"])
@pytest.mark.parametrize("M", [1, 5, 16, 33, 128])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_marlin_linear_matches_cpu(make_cuda, cpu, case, M, dtype, kernel):
    """Both kernels: the simple one (default) and the pipelined one with its global reduce
    (kernels marlin=pipeline); shapes the pipelined one lacks (group size 32) fall back to the
    simple one."""
    b = make_cuda(dtype)
    n, k = 200, 512
    weight = CASES[case](n, k, M)
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    want = np.empty((M, n), np.float32)
    cpu.linear(x, weight, bias, want)
    out = b.xp.full((M, n), np.nan, b.act_dtype)
    b.marlin_pipeline = kernel == "pipelined"
    try:
        b.linear(b.asarray(x.astype(b.act_dtype)), b.place_weight(weight), b.asarray(bias), out)
    finally:
        b.marlin_pipeline = False
    got = b.to_host(out).astype(np.float32)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < (1e-2 if dtype == "f16" else 2e-2)

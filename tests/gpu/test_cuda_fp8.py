"""FP8 weights on the GPU (issue 6, items 2 and 4) against the CPU backend and the float64 oracle.

Default path: block-wise (and per-channel) e4m3 weights dequantized once on the device to the
activation dtype, then cuBLAS. Switch kernels fp8=cutlass (sm_90a): activations quantized per
token and group of 128, then the CUTLASS block-scaled GEMM. Outputs are poisoned first.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from test_fp8 import random_fp8


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def sm90(b) -> bool:
    return b.device.compute_capability == "90"


@pytest.mark.parametrize("block", [(128, 128), (1, 384)])
def test_dequantize_equals_reference(cuda, block):
    from pyx.cuda_backend import launch_fp8_dequantize
    from pyx.cuda_backend import _dtype_code
    rng = np.random.default_rng(0)
    codes, scale = random_fp8(rng, 256, 384, block)
    want = ref.fp8_block_dequantize(codes, scale, block).astype(np.float32).astype(cuda.act_dtype)
    out = cuda.xp.full((256, 384), np.nan, cuda.act_dtype)
    # Device inputs held in names until the kernel has run: a temporary's memory goes back to
    # CuPy's pool as soon as its pointer is taken (the next copy reused it, which wrote the scales
    # over the first codes in the 2026-11-24 H100 run).
    d_codes, d_scale = cuda.asarray(codes), cuda.asarray(scale)
    launch_fp8_dequantize(d_codes.data.ptr, d_scale.data.ptr, out.data.ptr, 256, 384, block[0],
                          block[1], _dtype_code(cuda.act_dtype), cuda.stream.ptr)
    assert np.array_equal(cuda.to_host(out).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_quantize_per_token_group_equals_reference(cuda, M):
    from pyx.cuda_backend import _dtype_code, launch_fp8_quantize_per_token_group
    rng = np.random.default_rng(M)
    x = (rng.standard_normal((M, 512)) * 3).astype(cuda.act_dtype)
    x[0, :128] = 0                                   # an all-zero group: scale 1
    codes, scales = ref.fp8_quantize_per_token_group(x.astype(np.float32), 128)
    q = cuda.xp.full((M, 512), 0xAB, np.uint8)
    s = cuda.xp.full((M, 4), np.nan, np.float32)
    d_x = cuda.asarray(x)
    launch_fp8_quantize_per_token_group(d_x.data.ptr, q.data.ptr, s.data.ptr, M, 512, 128,
                                        _dtype_code(cuda.act_dtype), cuda.stream.ptr)
    assert np.array_equal(cuda.to_host(q), codes)
    assert np.array_equal(cuda.to_host(s), scales)


@pytest.mark.parametrize("M", [1, 2, 16, 33, 128, 1024])
@pytest.mark.parametrize("cutlass", [False, True])
def test_fp8_linear_matches_cpu(make_cuda, cpu, M, cutlass):
    from pyx.weights.fp8 import Fp8Weight
    b = make_cuda("bf16")
    if cutlass:
        if not sm90(b):
            pytest.skip("the CUTLASS FP8 GEMM needs sm_90a")
        b.fp8_cutlass = True
    try:
        rng = np.random.default_rng(M)
        weight = Fp8Weight(*random_fp8(rng, 384, 512, (128, 128)), (128, 128))
        x = rng.standard_normal((M, 512)).astype(np.float32)
        want = np.empty((M, 384), np.float32)
        cpu.linear(x, weight, None, want)
        placed = b.place_weight(weight)
        assert (type(placed).__name__ == "DeviceFp8Weight") == cutlass
        out = b.xp.full((M, 384), np.nan, b.act_dtype)
        b.linear(b.asarray(x.astype(b.act_dtype)), placed, None, out)
        got = b.to_host(out).astype(np.float32)
    finally:
        b.fp8_cutlass = False
    assert np.isfinite(got).all()
    # bf16 weights (default) or e4m3 activations (CUTLASS) against the CPU's f32 activations
    assert rel_err(got, want) < (5e-2 if cutlass else 2e-2)

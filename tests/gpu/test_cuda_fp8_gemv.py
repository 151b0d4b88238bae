"""The small-M FP8 GEMV (cuda/fp8_gemv.cu; kernels fp8_gemv=on, issue 12 item 2) against the
float64 oracle (tests/reference.py fp8_block_dequantize, then x W^T) and the CPU backend's FP8
linear (dequantize, then an f32 GEMM).

The kernel alone for M in 1..64 (every activation-row tile and its ragged tail), odd N (a warp's
missing second row), each activation dtype; Llama-3-8B's four projections at M 1, 4, 16, 64; the
backend with the switch on (weights stay e4m3, small M through the GEMV, larger M through
dequantized panels and cuBLAS) and off (weights dequantized at load); bad sizes refused.
Outputs are poisoned with NaN first, so an unwritten element fails.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from test_fp8 import random_fp8

TOL = {"f32": 1e-5, "bf16": 1e-2, "f16": 2e-3}
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def dtype_name(b) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[np.dtype(b.act_dtype).name]


def gemv(b, x, codes, scale):
    """launch_fp8_gemv on host arrays; device inputs held in names until the kernel has run."""
    from pyx.cuda_backend import _dtype_code, launch_fp8_gemv
    M, K = x.shape
    N = codes.shape[0]
    d_x, d_w, d_s = b.asarray(x), b.asarray(codes), b.asarray(scale)
    out = b.xp.full((M, N), np.nan, b.act_dtype)
    launch_fp8_gemv(d_x.data.ptr, d_w.data.ptr, d_s.data.ptr, out.data.ptr, M, N, K,
                    _dtype_code(b.act_dtype), b.stream.ptr)
    return b.to_host(out).astype(np.float32)


M_ALL = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64]


@pytest.mark.parametrize("M", M_ALL)
def test_fp8_gemv_matches_reference(cuda, M):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(M)
    N, K = 301, 640                      # odd N: the last warp has one row
    codes, scale = random_fp8(rng, N, K, (128, 128))
    x = rng.standard_normal((M, K)).astype(cuda.act_dtype)
    want = x.astype(np.float64) @ ref.fp8_block_dequantize(codes, scale, (128, 128)).T
    got = gemv(cuda, x, codes, scale)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < TOL[dt], (dt, M)
    # per row too: a wrong activation row in one tile would hide in the whole-matrix norm
    for m in range(M):
        assert rel_err(got[m], want[m]) < 4 * TOL[dt], (dt, M, m)


def test_fp8_gemv_applies_each_block_scale(cuda_f32):
    """Scales differ per 128 x 128 block; swapping two blocks' scales changes the reference, and
    the kernel follows the reference."""
    rng = np.random.default_rng(5)
    codes, scale = random_fp8(rng, 256, 512, (128, 128))
    scale = scale * rng.uniform(0.5, 4.0, scale.shape).astype(np.float32)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    want = x.astype(np.float64) @ ref.fp8_block_dequantize(codes, scale, (128, 128)).T
    swapped = scale.copy()
    swapped[0, [1, 2]] = scale[0, [2, 1]]
    other = x.astype(np.float64) @ ref.fp8_block_dequantize(codes, swapped, (128, 128)).T
    assert rel_err(other, want) > 1e-2
    assert rel_err(gemv(cuda_f32, x, codes, scale), want) < TOL["f32"]


@pytest.mark.parametrize("M", [1, 4, 16, 64])
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_fp8_gemv_llama3_8b_shapes_match_cpu(cuda_bf16, cpu, layer, M):
    from pyx.weights.fp8 import Fp8Weight
    N, K = LLAMA3_8B[layer]
    rng = np.random.default_rng(M + N + K)
    weight = Fp8Weight(*random_fp8(rng, N, K, (128, 128)), (128, 128))
    x = rng.standard_normal((M, K)).astype(cuda_bf16.act_dtype)
    want = np.empty((M, N), np.float32)
    cpu.linear(x.astype(np.float32), weight, None, want)
    got = gemv(cuda_bf16, x, weight.weight, weight.scale)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < TOL["bf16"], (layer, M)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 64, 65, 300])
def test_fp8_linear_with_the_switch(make_cuda, cpu, M):
    """fp8_gemv=on: weights stay e4m3 (a DeviceFp8Weight, not a dequantized array);
    up to fp8_gemv_max_m rows take the GEMV, more take dequantized panels and cuBLAS, both with
    the bias, equal to the CPU backend's FP8 linear."""
    from pyx.weights.fp8 import Fp8Weight
    from pyx.cuda_backend import DeviceFp8Weight
    b = make_cuda("bf16")
    saved = b.fp8_gemv, b.fp8_gemv_max_m
    rng = np.random.default_rng(M)
    weight = Fp8Weight(*random_fp8(rng, 384, 512, (128, 128)), (128, 128))
    x = rng.standard_normal((M, 512)).astype(np.float32)
    want = np.empty((M, 384), np.float32)
    cpu.linear(x, weight, None, want)
    try:
        b.fp8_gemv, b.fp8_gemv_max_m = True, 64
        placed = b.place_weight(weight)
        assert isinstance(placed, DeviceFp8Weight)
        bias = rng.standard_normal(384).astype(np.float32)
        out = b.xp.full((M, 384), np.nan, b.act_dtype)
        b.linear(b.asarray(x.astype(b.act_dtype)), placed, b.asarray(bias), out)
        got = b.to_host(out).astype(np.float32)
        # switched off, the weight is dequantized at load (the default)
        b.fp8_gemv = False
        assert not isinstance(b.place_weight(weight), DeviceFp8Weight)
    finally:
        b.fp8_gemv, b.fp8_gemv_max_m = saved
    assert np.isfinite(got).all()
    assert rel_err(got, want + bias) < 2e-2


def test_fp8_gemv_rejects_bad_sizes(cuda_bf16):
    from pyx.cuda_backend import CudaError, _dtype_code, launch_fp8_gemv
    b = cuda_bf16
    w, s = b.xp.zeros((128, 256), np.uint8), b.xp.ones((1, 2), np.float32)
    x, out = b.xp.zeros((65, 256), b.act_dtype), b.xp.zeros((65, 128), b.act_dtype)
    code = _dtype_code(b.act_dtype)
    with pytest.raises(CudaError, match=r"^fp8_gemv: .*M=65"):
        launch_fp8_gemv(x.data.ptr, w.data.ptr, s.data.ptr, out.data.ptr, 65, 128, 256, code,
                        b.stream.ptr)
    with pytest.raises(CudaError, match=r"^fp8_gemv: .*K=200"):
        launch_fp8_gemv(x.data.ptr, w.data.ptr, s.data.ptr, out.data.ptr, 1, 128, 200, code,
                        b.stream.ptr)

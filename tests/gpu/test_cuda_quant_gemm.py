"""Each quantized GEMM of the CUDA backend (issue 6, item 6) against the CPU reference on fresh
random inputs, over M in {1..16, 32, 64, 128, 1024, 4096} and the real layer shapes of Llama-3-8B
and Qwen3-8B.

Relative error bounds, ||gpu - ref|| / ||ref|| over the whole (M, N) output:
  GGUF (Q4_0, Q8_0, Q4_K, Q6_K)  2e-2  the GPU quantizes activations to int8 blocks (M <= 16) or
                                       multiplies bf16 activations by bf16-rounded dequantized
                                       panels; the reference keeps float activations
  Marlin int4 f16                1e-2  weights (code - zero) * scale rounded once to f16, f16 x
  Marlin int4 bf16               2e-2  the same in bf16 (3 fewer mantissa bits)
  FP8 dequantized (default)      2e-2  weights dequantized once to bf16, then cuBLAS
  FP8 CUTLASS (sm_90a)           5e-2  activations quantized per token and group of 128 to e4m3
The GPU output is always rounded to its activation dtype; the reference is float32.

Shapes (N x K): Llama-3-8B qkv 6144x4096 (q 4096 + k 1024 + v 1024; Qwen3-8B's fused qkv is the
same), o 4096x4096 (both models), gate_up 28672x4096, down 4096x14336; Qwen3-8B gate_up 24576x4096,
down 4096x12288. To keep the run short M and shapes are crossed sparsely: every M on 4096x4096, M in
{1, 16, 4096} on the others.

The reference is the CPU backend's own linear on the same weight object where M x N x K is at most
REF_CPU_MACS (M up to 4 on the 4096 x 4096 shape: the CPU kernels themselves stay checked against
the GPU's); above that it is x @ weight.dequantize().T, dequantized on the CPU once per weight and
multiplied in float64 on the GPU through CuPy (cuBLAS DGEMM: a different code path from every
kernel under test). The CPU backend's quantized kernels take seconds to minutes per case at the
larger sizes on the GPU machine's CPU (3 cores on the 2026-11-28 H200, shared by the test files
bench/gpu_check.sh runs side by side: 205 of these 360 cases fit 110 s there), and so does a
float32 NumPy product of up to 1 TFLOP; the dequantized product is the same function up to
rounding (the CPU's GGUF kernels also quantize activations, which only the GPU should be charged
for here).

Weights: GGUF blocks from the CPU quantizer (pyx.cpu_backend.quantize_weight); int4 from random
codes and scales, group 128 with random zero points (the asymmetric Marlin path) and per channel
with zero 8 (the symmetric path, zeros=None in the Marlin layout); FP8 e4m3 with 128 x 128 block
scales (tests/test_fp8.py's random_fp8). A weight is built once per (format, shape) and kept while
the cases of that (format, shape) run (cases are ordered so), then released. Outputs are poisoned
with NaN first; every output element must be finite.
"""
from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest

BOUND_GGUF = 2e-2
BOUND_MARLIN = {"f16": 1e-2, "bf16": 2e-2}
BOUND_FP8 = 2e-2
BOUND_FP8_CUTLASS = 5e-2

REF_CPU_MACS = 1 << 26      # M x N x K up to this: the CPU backend's linear is the reference

SMALL_SHAPE = (4096, 4096)  # every M runs here
SHAPES = {                  # (N, K) -> the layers it stands for
    (6144, 4096): "llama3_8b/qwen3_8b qkv",
    (4096, 4096): "llama3_8b/qwen3_8b o",
    (28672, 4096): "llama3_8b gate_up",
    (4096, 14336): "llama3_8b down",
    (24576, 4096): "qwen3_8b gate_up",
    (4096, 12288): "qwen3_8b down",
}
M_ALL = list(range(1, 17)) + [32, 64, 128, 1024, 4096]
M_SPARSE = [1, 16, 4096]

GGUF_TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}
FORMATS = {  # format -> activation dtypes it runs with
    **{name: ("bf16",) for name in GGUF_TYPES},
    "int4_g128": ("bf16", "f16"),
    "int4_channel": ("bf16", "f16"),
    "fp8": ("bf16",),
    "fp8_cutlass": ("bf16",),   # the CUTLASS path is bf16-only
}


def bound(fmt: str, dtype: str) -> float:
    if fmt in GGUF_TYPES:
        return BOUND_GGUF
    if fmt.startswith("int4"):
        return BOUND_MARLIN[dtype]
    return BOUND_FP8_CUTLASS if fmt == "fp8_cutlass" else BOUND_FP8


def cases():
    """(format, (N, K), dtype, M), grouped by (format, shape) so each weight is built once."""
    out = []
    for fmt, dtypes in FORMATS.items():
        for shape in SHAPES:
            for dtype in dtypes:
                for m in (M_ALL if shape == SMALL_SHAPE else M_SPARSE):
                    out.append(pytest.param(fmt, shape, dtype, m,
                                            id=f"{fmt}-{shape[0]}x{shape[1]}-{dtype}-M{m}"))
    return out


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_weight(fmt: str, n: int, k: int):
    rng = np.random.default_rng(seed_of("weight", fmt, n, k))
    if fmt in GGUF_TYPES:
        from gguf import GGMLQuantizationType as QT

        from pyx.cpu_backend import quantize_weight
        w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05)
        return quantize_weight(w, int(getattr(QT, GGUF_TYPES[fmt])))
    if fmt.startswith("int4"):
        from pyx.weights.int4 import Int4Part, Int4Weight
        g = 128 if fmt == "int4_g128" else k
        codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
        scales = (rng.uniform(0.002, 0.02, (n, k // g))
                  * rng.choice([-1.0, 1.0], (n, k // g))).astype(np.float32)
        if fmt == "int4_g128":
            zeros = rng.integers(0, 16, (n, k // g)).astype(np.float32)
        else:
            zeros = np.full((n, k // g), 8, np.float32)
        return Int4Weight([Int4Part.from_codes(codes, scales, zeros, g)], k)
    if fmt.startswith("fp8"):
        from test_fp8 import random_fp8

        from pyx.weights.fp8 import Fp8Weight
        codes, scale = random_fp8(rng, n, k, (128, 128))
        return Fp8Weight(codes, scale, (128, 128))
    raise KeyError(fmt)


class _Current:
    """The one (format, shape) whose weight is alive: host weight, its float32 dequantization
    (made when first needed) and the weight placed on each backend."""
    key = None
    weight = None
    dequantized = None
    repacked = None
    placed: dict = {}


def current_weight(fmt, shape):
    if _Current.key != (fmt, shape):
        _Current.key = _Current.weight = _Current.dequantized = _Current.repacked = None
        _Current.placed = {}
        _Current.weight = make_weight(fmt, *shape)
        _Current.key = (fmt, shape)
    return _Current


def placed_weight(cur, b, dtype, fmt):
    if dtype not in cur.placed:
        host = cur.weight
        if fmt.startswith("int4"):   # one repack (NumPy, ~15 s at 28672x4096) for both dtypes
            if cur.repacked is None:
                from pyx.weights.marlin import repack_int4
                cur.repacked = repack_int4(cur.weight)
            host = cur.repacked
        placed = b.place_weight(host)
        kind = type(placed).__name__
        if fmt in GGUF_TYPES:
            assert kind == "QuantizedWeight", kind
        elif fmt.startswith("int4"):
            assert kind == "DeviceMarlinWeight", kind
        else:
            assert (kind == "DeviceFp8Weight") == (fmt == "fp8_cutlass"), kind
        cur.placed[dtype] = placed
    return cur.placed[dtype]


def fmt_is_int4(weight) -> bool:
    return type(weight).__name__ == "Int4Weight"


def reference(cpu, cur, x, bias) -> np.ndarray:
    m, k = x.shape
    n = cur.weight.shape[0]
    if m * n * k <= REF_CPU_MACS:
        want = np.empty((m, n), np.float32)
        cpu.linear(x, cur.weight, bias, want)
        return want
    import cupy as cp
    if cur.dequantized is None:
        w = cur.weight
        from pyx.cpu_backend import dequantize_weight
        from pyx.weights.ggml import QuantizedWeight
        deq = (w.dequantize(num_threads=os.cpu_count()) if fmt_is_int4(w) else
               dequantize_weight(w) if isinstance(w, QuantizedWeight) else w.dequantize())
        cur.dequantized = np.ascontiguousarray(deq, dtype=np.float32)
    product = cp.asarray(x, cp.float64) @ cp.asarray(cur.dequantized, cp.float64).T
    want = cp.asnumpy(product).astype(np.float32)
    del product
    want += bias
    return want


def rel_err(got, want) -> float:
    """||got - want|| / ||want||, float64 sums over row chunks (outputs reach 117M elements)."""
    num = den = 0.0
    for r in range(0, want.shape[0], 256):
        g = np.asarray(got[r:r + 256], np.float64)
        w = np.asarray(want[r:r + 256], np.float64)
        num += float(np.square(g - w).sum())
        den += float(np.square(w).sum())
    return math.sqrt(num / max(den, 1e-60))


@pytest.mark.parametrize("fmt,shape,dtype,M", cases())
def test_quant_gemm_matches_cpu_reference(make_cuda, cpu, fmt, shape, dtype, M):
    b = make_cuda(dtype)
    cutlass = fmt == "fp8_cutlass"
    if cutlass and b.device.compute_capability != "90":
        pytest.skip("the CUTLASS FP8 block GEMM needs sm_90a")
    n, k = shape
    cur = current_weight(fmt, shape)
    rng = np.random.default_rng(seed_of("x", fmt, shape, dtype, M))
    x = rng.standard_normal((M, k), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)

    saved = b.fp8_cutlass
    b.fp8_cutlass = cutlass
    try:
        weight = placed_weight(cur, b, dtype, fmt)
        out = b.xp.full((M, n), np.nan, b.act_dtype)
        b.linear(b.asarray(x.astype(b.act_dtype)), weight, b.asarray(bias), out)
        got = b.to_host(out).astype(np.float32)
    finally:
        b.fp8_cutlass = saved
    del out

    want = reference(cpu, cur, x, bias)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} non-finite outputs"
    err = rel_err(got, want)
    assert err < bound(fmt, dtype), (
        f"{fmt} {SHAPES[shape]} ({n}x{k}) {dtype} M={M}: relative error {err:.3g} "
        f"(bound {bound(fmt, dtype):g})")

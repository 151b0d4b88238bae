"""ggml block weights on the GPU (issue 6, item 3) against the CPU backend on the same blocks.

Blocks come from the CPU quantizer (byte-identical to gguf-py for the legacy types, llama.cpp's
reference quantizers for the K types). Dequantization must equal the CPU's scalar reference
element for element (rounded to the activation dtype); the GEMV quantizes activations to 32-wide
int8 blocks where the CPU uses Q8_0 / Q8_K, so it is compared with a relative tolerance; the
prefill path (dequantized panels through cuBLAS) likewise. Outputs are poisoned first.
"""
from __future__ import annotations

import numpy as np
import pytest

from gguf import GGMLQuantizationType as QT

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K,
         QT.Q6_K]


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def blocks_of(qtype, n, k, seed):
    from pyx.cpu_backend import quantize_weight
    rng = np.random.default_rng(seed)
    return quantize_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05, int(qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_equals_cpu_reference(cuda, qtype):
    weight = blocks_of(qtype, 48, 512, seed=int(qtype))
    from pyx.cpu_backend import dequantize_weight
    want = dequantize_weight(weight).astype(cuda.act_dtype)
    dev = cuda.place_weight(weight)
    ids = np.array([0, 7, 47, 7, 3], np.int32)
    out = cuda.xp.full((len(ids), 512), np.nan, cuda.act_dtype)
    cuda.embedding(cuda.asarray(ids), dev, out)
    got = cuda.to_host(out)
    assert np.array_equal(got.view(np.uint8), want[ids].view(np.uint8))


@pytest.mark.parametrize("M", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_linear_matches_cpu(cuda_bf16, cpu, qtype, M):
    """M <= 16 takes the int8 GEMV, more the dequantized panels; a fused weight of two types
    writes its column slices."""
    b = cuda_bf16
    rng = np.random.default_rng(M)
    K = 512
    weight = type(blocks_of(qtype, 40, K, 1)).concat(
        [blocks_of(qtype, 40, K, 1), blocks_of(QT.Q6_K, 24, K, 2)])
    x = (rng.standard_normal((M, K)) * 0.5).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float32)
    want = np.empty((M, 64), np.float32)
    cpu.linear(x, weight, bias, want)
    out = b.xp.full((M, 64), np.nan, b.act_dtype)
    b.linear(b.asarray(x.astype(b.act_dtype)), b.place_weight(weight), b.asarray(bias), out)
    got = b.to_host(out).astype(np.float32)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < 2e-2


def test_quantized_logits_into_float32(cuda_bf16, cpu):
    b = cuda_bf16
    weight = blocks_of(QT.Q6_K, 96, 256, 5)
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    want = np.empty((2, 96), np.float32)
    cpu.linear(x, weight, None, want)
    out = b.xp.full((2, 96), np.nan, np.float32)
    b.linear(b.asarray(x.astype(b.act_dtype)), b.place_weight(weight), None, out)
    assert rel_err(b.to_host(out), want) < 2e-2

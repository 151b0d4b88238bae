"""Host side of the FP8 block-wise GEMM path (issue 6, item 2), on any machine: the CPU reference
of the per-token-group activation quantizer (tests/reference.py fp8_quantize_per_token_group,
which the GPU tests hold cuda/fp8_quant.cu to bit for bit) against ml_dtypes' e4m3fn cast, its
scale rule and error bound; the block-scaled product the sm90a kernel computes against the
dequantize-then-matmul reference; and the C ABI in cutlass_ext/taper_cutlass.h against the
launchers the two .cu files define. The kernels themselves run in tests/gpu/."""
import os
import re

import ml_dtypes
import numpy as np
import pytest

import reference as ref

E4M3 = ml_dtypes.float8_e4m3fn
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("group", [128, 64])
def test_quantize_matches_ml_dtypes(group):
    rng = np.random.default_rng(0)
    x = _bf16(rng.standard_normal((5, 4 * group)) * np.exp(rng.uniform(-8, 8, (5, 1))))
    codes, s = ref.fp8_quantize_per_token_group(x, group)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert s.dtype == np.float32 and s.shape == (5, 4)
    g = x.reshape(5, 4, group)
    want_s = np.abs(g).max(axis=2) / np.float32(448)
    np.testing.assert_array_equal(s, want_s)
    q = (g / s[:, :, None]).astype(np.float32)   # float32 quotient, as the kernel divides
    assert np.abs(q).max() <= 448 * (1 + 2.0 ** -23)  # the group max lands on (or next to) 448
    want = q.astype(E4M3).view(np.uint8).reshape(x.shape)
    np.testing.assert_array_equal(codes, want)


def test_quantize_error_bound():
    rng = np.random.default_rng(1)
    x = _bf16(rng.standard_normal((7, 512)))
    codes, s = ref.fp8_quantize_per_token_group(x, 128)
    back = ref.e4m3_decode(codes).reshape(7, 4, 128) * s[:, :, None]
    err = np.abs(back.reshape(7, 512) - x)
    # 3 mantissa bits: half an ulp is 2^-4 of the value for normals; subnormal steps are
    # 2^-9 * s, so half of one is 2^-10 * s.
    bound = np.maximum(np.abs(x) * 2.0 ** -4, np.repeat(s, 128, axis=1) * 2.0 ** -10)
    assert np.all(err <= bound * (1 + 1e-6))


def test_quantize_special_groups():
    x = np.zeros((3, 256), np.float32)
    x[1, 128:] = 1e-45                      # amax / 448 underflows to 0
    x[2, :128] = np.linspace(-3, 3, 128)
    x[2, 7] = np.nan                        # ignored by amax, kept as a NaN code
    x[2, 128:] = np.nan                     # all NaN: amax 0
    codes, s = ref.fp8_quantize_per_token_group(x, 128)
    assert s[0, 0] == s[0, 1] == 1.0 and not codes[0].any()
    assert s[1, 1] == 1.0 and not codes[1, 128:].any()
    assert s[2, 0] == np.float32(3) / np.float32(448)
    assert (codes[2, 7] & 0x7F) == 0x7F
    assert np.all((codes[2, 128:] & 0x7F) == 0x7F) and s[2, 1] == 1.0
    assert codes[2, 127] == 0x7E and codes[2, 0] == 0xFE  # +-448
    with pytest.raises(ValueError):
        ref.fp8_quantize_per_token_group(np.zeros((1, 200), np.float32), 128)


def _block_scaled_gemm(a_codes, a_s, b_codes, b_s):
    """What taper_cutlass_fp8_block_gemm computes (before the bf16 rounding), in float64:
    per 128-deep K block, the code products summed, then times a_s[m, kb] * b_s[n // 128, kb]."""
    M, K = a_codes.shape
    N = b_codes.shape[0]
    a, b = ref.e4m3_decode(a_codes), ref.e4m3_decode(b_codes)
    out = np.zeros((M, N))
    for kb in range(K // 128):
        ks = slice(kb * 128, (kb + 1) * 128)
        part = a[:, ks] @ b[:, ks].T
        out += part * a_s[:, kb:kb + 1] * np.repeat(b_s[:, kb], 128)[:N][None, :]
    return out


def test_block_scaled_gemm_is_dequantized_matmul():
    rng = np.random.default_rng(2)
    M, N, K = 3, 200, 384                   # a partial 128-row weight block
    a_codes, a_s = ref.fp8_quantize_per_token_group(_bf16(rng.standard_normal((M, K))), 128)
    w = rng.standard_normal((N, K)).astype(np.float32)
    b_s = rng.uniform(0.5, 2.0, (-(-N // 128), K // 128)).astype(np.float32) / 448
    b_codes = ref.e4m3_encode(w / np.repeat(np.repeat(b_s, 128, 0), 128, 1)[:N])
    got = _block_scaled_gemm(a_codes, a_s, b_codes, b_s)
    a_deq = ref.e4m3_decode(a_codes) * np.repeat(a_s.astype(np.float64), 128, axis=1)
    want = a_deq @ ref.fp8_block_dequantize(b_codes, b_s, (128, 128)).T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_abi_declarations_match_definitions():
    header = open(os.path.join(ROOT, "cutlass_ext", "taper_cutlass.h")).read()
    declared = set(re.findall(r"^(?:int|int64_t) (taper_\w+)\(", header, re.M))
    assert declared == {
        "taper_cutlass_fp8_block_gemm", "taper_cutlass_fp8_block_gemm_workspace_bytes",
        "taper_cuda_fp8_dequantize", "taper_cuda_fp8_dequantize_blockwise",
        "taper_cuda_fp8_quantize_per_token_group", "taper_cuda_fp8_gemv"}
    defined = set()
    for path in ("cutlass_ext/fp8_block_gemm.cu", "cuda/fp8_quant.cu", "cuda/fp8_gemv.cu"):
        src = open(os.path.join(ROOT, path)).read()
        defined |= set(re.findall(r'extern "C" (?:int|int64_t) (taper_\w+)\(', src))
    assert defined == declared

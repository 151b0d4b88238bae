"""The ops GPT-OSS, Llama 4 and Gemma 4 take beside the plain ones (issue 29 item 4 on CUDA), on
the CPU backend, which is the CUDA kernels' reference (tests/gpu/test_cuda_quirk_families.py
compares them): paged_attention's attention_chunk (Llama 4's chunked attention) against the
float64 formula, with sinks and a sliding window beside it; clamped_swiglu (GPT-OSS's experts)
against the formula and transformers' own experts; and pyx/attention_dispatch.py, the rule by
which the CUDA backend picks its attention kernel, with its argument checks."""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from test_backend_ops import make_paged_batch

SEQS = [(1, 1), (37, 1), (50, 13), (20, 20), (70, 2), (33, 33)]


@pytest.fixture(scope="module")
def cpu():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize("window", [0, 12])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_chunk_matches_reference(cpu, chunk, window, with_sinks):
    """Decode rows, prefill chunks crossing chunk boundaries, a whole prompt; the chunk masks
    keys the plain op would read (so the plain answer differs)."""
    rng = np.random.default_rng(chunk + window)
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, SEQS, 8, 4, 2, 16)
    sinks = rng.normal(1.0, 1.0, 4).astype(np.float32) if with_sinks else None
    extra = {"sinks": sinks} if with_sinks else {}
    out = np.full_like(q, np.nan)
    cpu.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.25, window, attention_chunk=chunk,
                        **extra)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.25, window, sinks=sinks,
                               attention_chunk=chunk)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    plain = np.empty_like(q)
    cpu.paged_attention(plain, q, kc, vc, tables, seq_lens, qsl, 0.25, window, **extra)
    assert np.abs(plain - want).max() > 1e-2


def test_attention_chunk_refusals(cpu):
    rng = np.random.default_rng(0)
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, SEQS, 8, 4, 2, 16)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="attention_chunk 12 is not a multiple of the KV block "
                                         "size 8"):
        cpu.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.25, 0, attention_chunk=12)
    with pytest.raises(ValueError, match="attention_chunk must be >= 0"):
        cpu.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.25, 0, attention_chunk=-8)
    with pytest.raises(ValueError, match="attention_chunk must be an integer"):
        cpu.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.25, 0, attention_chunk=8.0)


def clamped_swiglu_reference(x, alpha, limit):
    x = x.astype(np.float64)
    I = x.shape[1] // 2
    gate = np.minimum(x[:, :I], limit)
    up = np.clip(x[:, I:], -limit, limit)
    return (up + 1) * gate / (1 + np.exp(-alpha * gate))


def test_clamped_swiglu_matches_formula_and_transformers(cpu):
    """Values beyond the limit on both sides of gate and up; transformers' GptOssExperts
    activation (interleaved gate/up columns) gives the same on the de-interleaved halves."""
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 4.0, (7, 2 * 40)).astype(np.float32)
    out = np.full((7, 40), np.nan, np.float32)
    cpu.clamped_swiglu(x, out, 1.702, 3.0)
    np.testing.assert_allclose(out, clamped_swiglu_reference(x, 1.702, 3.0), rtol=1e-5,
                               atol=1e-5)
    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=40, num_local_experts=1,
                                         swiglu_limit=3.0))
    interleaved = np.empty_like(x)
    interleaved[:, 0::2], interleaved[:, 1::2] = x[:, :40], x[:, 40:]
    hf = experts._apply_gate(torch.from_numpy(interleaved)).detach().numpy()
    np.testing.assert_allclose(out, hf, rtol=1e-5, atol=1e-5)
    plain = np.empty_like(out)
    cpu.silu_and_mul(x, plain)
    assert np.abs(plain - out).max() > 1.0        # the clamps and the +1 matter here


@pytest.mark.parametrize("alpha,limit", [(1.702, 0.0), (1.702, -1.0), (float("nan"), 7.0),
                                         (1.702, float("inf"))])
def test_clamped_swiglu_refuses_bad_constants(cpu, alpha, limit):
    x, out = np.zeros((2, 8), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="clamped_swiglu: need a finite alpha and a finite limit"):
        cpu.clamped_swiglu(x, out, alpha, limit)


def test_clamped_swiglu_refuses_bad_shapes(cpu):
    with pytest.raises(ValueError, match=r"clamped_swiglu: need x \(T, 2I\), out \(T, I\)"):
        cpu.clamped_swiglu(np.zeros((2, 8), np.float32), np.zeros((2, 3), np.float32), 1.7, 7.0)


# ---- the CUDA backend's choice of attention kernel (pyx/attention_dispatch.py)

@pytest.mark.parametrize("T,B,D,sinks,chunk,kernel", [
    (4, 4, 64, None, 0, "decode"),
    (9, 4, 64, None, 0, "prefill"),
    (4, 4, 256, None, 0, "decode"),
    (4, 4, 64, np.zeros(8, np.float32), 0, "masked"),     # GPT-OSS: every batch
    (9, 4, 64, np.zeros(8, np.float32), 0, "masked"),
    (4, 4, 64, None, 8192, "masked"),                      # Llama 4's chunked layers
    (9, 4, 128, None, 8192, "masked"),
    (4, 4, 512, None, 0, "masked"),                        # Gemma 4's full layers
    (9, 4, 512, None, 0, "masked"),
])
def test_attention_kernel_choice(T, B, D, sinks, chunk, kernel):
    from pyx.attention_dispatch import attention_kernel
    assert attention_kernel(T, B, D, sinks, chunk) == kernel


def test_mask_checks_name_the_problem():
    from pyx.attention_dispatch import check_masks
    assert check_masks("paged_attention", None, np.int64(16), 8, 64) == 16
    with pytest.raises(ValueError, match=r"paged_attention: need sinks \(Hq,\) = \(8,\) float32"):
        check_masks("paged_attention", np.zeros(7, np.float32), 0, 8, 64)
    with pytest.raises(ValueError, match=r"need sinks .* float64"):
        check_masks("paged_attention", np.zeros(8, np.float64), 0, 8, 64)
    with pytest.raises(ValueError, match="attention_chunk must be >= 0"):
        check_masks("paged_attention", None, -1, 8, 64)
    with pytest.raises(ValueError, match="attention_chunk must be an integer"):
        check_masks("paged_attention", None, True, 8, 64)
    with pytest.raises(ValueError, match="head_dim 520 is over the CUDA kernels' 512"):
        check_masks("paged_attention", None, 0, 8, 520)

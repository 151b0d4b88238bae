"""The FlashAttention-2 style prefill kernel (kernels prefill=fa2, issue 12 item 2) and its
warp-specialized Hopper form (prefill=fa3: wgmma, an mbarrier ring; on a GPU other than
compute capability 9.0 the backend runs fa2 instead), every test for both, against the CPU
backend's paged attention, and beside the simple CUDA kernel (the general fallback).

Shapes: D 64 and 128; GQA groups 1, 2, 4, 8, an odd group (5: a block's 64 packed rows split a
token's heads across blocks) and multi-query (32 heads over one KV head); causal prompts of odd
lengths, chunks at an offset into a longer context read from the paged cache (prefix-cache hits
and chunked prefill), decode rows mixed in; block sizes 16, 32, 128 and 24 (not a divisor of the
64-key tile); sliding window and soft-cap; cache memory the batch does not own holding large
finite garbage or NaN; a Llama-3-8B-shaped 2k prompt and its continuation chunk. Batches the
kernel lacks (FP8 cache, D 96) must still give the right answer through the simple kernel. At
model level, test_cuda_model's greedy comparison with the CPU engine runs with the switch on.
"""
from __future__ import annotations

import numpy as np
import pytest

import test_cuda_model as model_tests
from test_cuda_model import checkpoints  # noqa: F401 (the tiny-256 checkpoints fixture)
from test_cuda_ops import TOL, check_attention, cpu_attention, cuda_attention, paged_batch, rel_diff

# (seq_len, q_len): whole prompts of odd lengths, chunks whose rows sit at an offset into a longer
# context, decode rows, a chunk of one row that is not a decode batch's only kind of row
SEQS = [(300, 300), (500, 77), (129, 1), (64, 64), (1000, 130), (33, 17), (1, 1), (65, 65),
        (257, 3)]


@pytest.fixture(params=["fa2", "fa3"])
def kernel(request):
    return request.param


def fa2_backend(make_cuda, dt, kernel="fa2"):
    """The backend built with kernels prefill=kernel; fa3 is fa3 on compute capability 9.0
    only."""
    b = make_cuda(dt, f"prefill={kernel}")
    want = kernel
    if kernel == "fa3" and b.device.compute_capability != "90":
        want = "fa2"
    assert b.prefill_kernel == want
    return b


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 0.0), (0, 5.0), (37, 3.0)])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_fa2_prefill_matches_cpu(make_cuda, kernel, cpu, dt, D, group, window, softcap):
    b = fa2_backend(make_cuda, dt, kernel)
    rng = np.random.default_rng(D + 10 * group + window + int(softcap))
    BS = {1: 16, 2: 32, 4: 16, 5: 24, 8: 128}[group]
    p = paged_batch(rng, SEQS, BS, 2 * group, 2, D, dt)
    check_attention(b, cpu, p, window, softcap, f"{kernel} D={D} group={group} BS={BS}")


@pytest.mark.parametrize("D", [64, 128])
def test_fa2_prefill_matches_simple_kernel(make_cuda, kernel, cpu, D):
    """The same batch through the simple kernel (the general fallback) and fa2: both within the
    dtype's tolerance of the CPU, and of each other."""
    rng = np.random.default_rng(D)
    p = paged_batch(rng, SEQS, 16, 8, 2, D, "bf16")
    simple_backend = make_cuda("bf16", "prefill=simple")
    assert simple_backend.prefill_kernel == "simple"
    simple = cuda_attention(simple_backend, p, 0, 0.0)
    fa2 = cuda_attention(fa2_backend(make_cuda, "bf16", kernel), p, 0, 0.0)
    want = cpu_attention(cpu, p, 0, 0.0)
    assert rel_diff(simple, want) < TOL["bf16"]
    assert rel_diff(fa2, want) < TOL["bf16"]
    assert rel_diff(fa2, simple) < TOL["bf16"]


def test_fa2_prefill_multi_query(make_cuda, kernel, cpu):
    """32 query heads over one KV head: a block's 64 packed rows are two tokens."""
    b = fa2_backend(make_cuda, "bf16", kernel)
    rng = np.random.default_rng(32)
    p = paged_batch(rng, [(200, 200), (150, 45), (7, 1)], 16, 32, 1, 128, "bf16")
    check_attention(b, cpu, p, 0, 0.0, f"{kernel} MQA")


@pytest.mark.parametrize("chunk", [False, True])
def test_fa2_prefill_llama3_8b_shape(make_cuda, kernel, cpu, chunk):
    """Llama-3-8B's heads (32 over 8, D 128): a 2k prompt, or its 700-token continuation chunk
    whose first 1400 keys come from the paged cache."""
    b = fa2_backend(make_cuda, "bf16", kernel)
    rng = np.random.default_rng(8 + chunk)
    seqs = [(2100, 700)] if chunk else [(2048, 2048)]
    p = paged_batch(rng, seqs, 16, 32, 8, 128, "bf16")
    check_attention(b, cpu, p, 0, 0.0, f"{kernel} Llama-3-8B chunk={chunk}")


@pytest.mark.parametrize("D", [64, 128])
def test_fa2_prefill_nan_in_unused_slots(make_cuda, kernel, cpu, D):
    """NaN in every slot and block the batch does not own (past each context, padded table
    entries): keys outside a row's range must contribute exact zeros, not 0 * NaN."""
    b = fa2_backend(make_cuda, "bf16", kernel)
    rng = np.random.default_rng(D + 1)
    p = paged_batch(rng, SEQS, 16, 8, 2, D, "bf16", garbage="nan")
    check_attention(b, cpu, p, 0, 0.0, f"{kernel} NaN garbage D={D}")
    check_attention(b, cpu, p, 50, 0.0, f"{kernel} NaN garbage D={D}")


@pytest.mark.parametrize("case", ["fp8", "D96", "f32"])
def test_fa2_switch_falls_back_for_other_batches(make_cuda, kernel, cpu, case):
    """With the switch on, batches fa2 lacks still give the right answer (the simple kernel)."""
    dt = "f32" if case == "f32" else "bf16"
    b = fa2_backend(make_cuda, dt, kernel)
    rng = np.random.default_rng(len(case))
    D = 96 if case == "D96" else 64
    p = paged_batch(rng, SEQS, 16, 4, 2, D, dt, fp8=case == "fp8")
    check_attention(b, cpu, p, 0, 0.0, f"{kernel} switch, {case}")


@pytest.mark.parametrize("case", ["llama", "mistral_window16"])
def test_fa2_engine_greedy_matches_cpu(checkpoints, monkeypatch, case, kernel):  # noqa: F811
    """test_cuda_model's greedy comparison (chunked prefill mixed with decodes, a round that hits
    the prefix cache; tiny-256 llama with GQA 4:2, mistral with a window of 16) with the engine's
    CUDA backend built with kernels prefill=fa2 or fa3."""
    made = []

    def make_llm(path, backend, **config):
        if backend == "cuda":
            config["kernels"] = f"prefill={kernel}"
        made.append(original(path, backend, **config))
        return made[-1]

    original = model_tests.make_llm
    monkeypatch.setattr(model_tests, "make_llm", make_llm)
    model_tests.test_greedy_matches_cpu(checkpoints, case)
    kernels = [llm.engine.backend.prefill_kernel if llm.engine.backend.name == "cuda" else "cpu"
               for llm in made]
    import cupy
    want = kernel if cupy.cuda.Device(0).compute_capability == "90" else "fa2"
    assert sorted(kernels) == ["cpu", want], kernels

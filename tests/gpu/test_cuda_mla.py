"""GPU: multi-head latent attention (issue 29 item 1) on the CUDA backend against the CPU backend.

The two ops MLA adds, against the CPU backend's (the reference; itself checked against
transformers in tests/test_models_mla.py): batched_linear (cuBLAS strided-batched GEMM) and
mla_decode_attention (cuda/mla_decode.cu) at DeepSeek's real head size (a latent of 512 and a
rotary part of 64: D 576, past the paged attention kernels' 256) and at the tiny checkpoints'.
Then the tiny MLA checkpoints (tests/checkpoints.py) through the CUDA engine: greedy tokens equal
the CPU engine's up to its near-ties, with prompt chunks beside decodes (the plain path through
the prefill kernel, the absorbed one through the new kernel) and decode graphs replayed; and
DeepSeek-V3's MTP head drafting on the device (speculative method mtp).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from test_cuda_model import compare, cpu_margins, greedy, random_prompts
from test_cuda_ops import ACT, TOL, assert_close, rand, to_dev, to_host


@pytest.mark.parametrize("G, T, K, N", [(16, 1, 128, 512), (4, 7, 24, 32), (128, 3, 512, 128)])
@pytest.mark.parametrize("out_f32", [False, True])
def test_batched_linear(cuda, cpu, G, T, K, N, out_f32):
    from test_cuda_ops import dtype_name
    dt = dtype_name(cuda)
    rng = np.random.default_rng(G + T)
    x, w = rand(rng, (G, T, K), dt), rand(rng, (G, N, K), dt, 0.1)
    want = np.empty((G, T, N), np.float32)
    cpu.batched_linear(x.astype(np.float32), w.astype(np.float32), want)
    out = to_dev(cuda, np.full((G, T, N), np.nan, np.float32 if out_f32 else ACT[dt]))
    cuda.batched_linear(to_dev(cuda, x), to_dev(cuda, w), out)
    assert_close(to_host(cuda, out), want, TOL[dt], f"batched_linear {dt}")


@pytest.mark.parametrize("D, Dv, Hq", [(576, 512, 16), (48, 32, 4), (576, 512, 128)])
@pytest.mark.parametrize("BS", [16, 1])
def test_mla_decode_attention(cuda, cpu, D, Dv, Hq, BS):
    from test_cuda_ops import dtype_name
    dt = dtype_name(cuda)
    rng = np.random.default_rng(D + Hq + BS)
    lens = np.array([1, 37, 300, 5], np.int32)
    MB = -(-int(lens.max()) // BS)
    NB = len(lens) * MB + 3
    tables = rng.permutation(NB)[:len(lens) * MB].reshape(len(lens), MB).astype(np.int32)
    cache = rand(rng, (NB, BS, 1, D), dt)
    q = rand(rng, (len(lens), Hq, D), dt)
    scale = D ** -0.5
    want = np.empty((len(lens), Hq, Dv), np.float32)
    cpu.mla_decode_attention(want, q.astype(np.float32), cache.astype(np.float32), tables, lens,
                             scale)
    out = to_dev(cuda, np.full((len(lens), Hq, Dv), np.nan, ACT[dt]))
    cuda.mla_decode_attention(out, to_dev(cuda, q), to_dev(cuda, cache), to_dev(cuda, tables),
                              to_dev(cuda, lens), scale)
    assert_close(to_host(cuda, out), want, TOL[dt], f"mla_decode_attention {dt}")


def test_mla_decode_attention_rejects_bad_input(cuda_bf16):
    b = cuda_bf16
    q = to_dev(b, np.zeros((2, 4, 48), ACT["bf16"]))
    cache = to_dev(b, np.zeros((4, 16, 2, 48), ACT["bf16"]))      # two cached heads
    out = to_dev(b, np.zeros((2, 4, 32), ACT["bf16"]))
    tables = to_dev(b, np.zeros((2, 1), np.int32))
    lens = to_dev(b, np.ones(2, np.int32))
    with pytest.raises(ValueError, match="mla_decode_attention"):
        b.mla_decode_attention(out, q, cache, tables, lens, 0.1)


# ---- the tiny MLA checkpoints through the CUDA engine

ARCHS = ("deepseek_v3", "deepseek_v2_lite", "deepseek_v2", "glm4_moe_lite")


@pytest.fixture(scope="module")
def mla_checkpoints(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    root = tmp_path_factory.mktemp("mla")
    return {a: tiny_checkpoint(os.path.join(root, a), arch=a) for a in ARCHS}


def make(path, backend, dtype, **config):
    from engine import LLM
    return LLM(path, backend=backend, dtype=dtype, num_kv_blocks=64, max_num_seqs=8, **config)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_greedy_matches_cpu(mla_checkpoints, arch, dtype):
    path = mla_checkpoints[arch]
    common = dict(max_num_batched_tokens=48, block_size=16)   # chunks beside decode rows
    cuda = make(path, "cuda", dtype, **common)
    cpu = make(path, "cpu", "auto", **common)
    prompts = random_prompts(7, (5, 23, 40, 70, 17, 33))
    got, want = greedy(cuda, prompts), greedy(cpu, prompts)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        margins = cpu_margins(cpu, prompts[i], w.token_ids)
        compared += compare(f"{arch} {dtype} prompt {i}", g.token_ids, w.token_ids, margins)
    assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_replay_equals_eager(mla_checkpoints, batch):
    path = mla_checkpoints["deepseek_v3"]
    # graphs need the fused experts (moe=simple reads expert counts on the host: no graphs)
    graph = make(path, "cuda", "bf16", cuda_graph=True, kernels="moe=fused")
    assert graph.engine.runner.graph_runner is not None
    eager = make(path, "cuda", "bf16", cuda_graph=False, kernels="moe=fused")
    prompts = random_prompts(300 + batch, [45, 20, 31][:batch])
    assert ([o.token_ids for o in greedy(graph, prompts)]
            == [o.token_ids for o in greedy(eager, prompts)])


def test_mtp_speculation_matches_cpu(tmp_path, monkeypatch):
    """DeepSeek-V3's MTP head (tests/mtp_heads.py) drafting on the device in bf16 (the target's
    final-norm states captured in the device forward, the head's latent cache and hidden-state
    pool on the device, the position-0 embedding zeroed by a device scatter): greedy tokens equal
    the CPU engine's without speculation up to its near-ties, drafts proposed; a head that
    computes the bigram target's next token has most drafts accepted (bf16 rounding may part a
    near-tie)."""
    from engine.spec.costs import StepCost
    from mtp_heads import bigram_mtp_checkpoint, mtp_checkpoint
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    prompts = random_prompts(17, (5, 23, 40))
    for name, path in (("random", mtp_checkpoint(tmp_path / "random")),
                       ("bigram", bigram_mtp_checkpoint(tmp_path / "bigram"))):
        cpu = make(path, "cpu", "auto")
        cuda = make(path, "cuda", "bf16", speculative_config=spec)
        got, want = greedy(cuda, prompts), greedy(cpu, prompts)
        compared = 0
        for i, (g, w) in enumerate(zip(got, want)):
            margins = cpu_margins(cpu, prompts[i], w.token_ids)
            compared += compare(f"mtp {name} prompt {i}", g.token_ids, w.token_ids, margins)
        assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
        stats = cuda.engine.speculator.stats
        assert stats.num_drafts > 0
        if name == "bigram":
            assert stats.acceptance_rate > 0.8, stats

"""The fused MoE path on CUDA (cuda/moe.cu; kernels moe=fused, issue 16 item 2) against the
CPU backend's moe_* ops (pyx/cpu_moe.py: each expert through the CPU's own linear) and, at model
level, against transformers' greedy tokens.

Ops: moe_align (offsets, padding and the block -> expert map exactly the CPU's; each expert's
run the same set of pairs, whose order the kernel leaves unspecified), the grouped GEMM for bf16
and f16 activations with activation-dtype and GGUF Q8_0 experts (blocks from gguf-py's own
quantizer), both M tiles, decode and prefill sizes, experts with no tokens and very uneven
counts, odd N and a K that is not a multiple of 8 (the element-wise loads); moe_combine; the
whole block fused on CUDA against the one-expert-at-a-time block on the CPU. Outputs are
poisoned with NaN first, so an unwritten row fails.

Model: Mixtral- and Qwen3-MoE-shaped tiny-256 checkpoints (tests/checkpoints.py ARCHS_256) on the
CUDA engine with the switch on give transformers' greedy tokens up to its first near-tie (top-two
logit margin under 0.05: bf16 activations against transformers' float32); the same engine with
CUDA Graph replay gives eager decode's tokens.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from pyx.moe import moe_align_capacity, moe_block_m

TOL = {"bf16": 1e-2, "f16": 2e-3}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def skewed_ids(rng, T, k, E):
    """Top-k ids with very uneven counts and empty experts: distinct experts per token drawn from
    a Dirichlet-skewed half of the experts."""
    live = max(E // 2, k)
    p = rng.dirichlet(np.full(live, 0.3))
    ids = np.stack([rng.choice(live, size=k, replace=False, p=p) for _ in range(T)])
    return (ids * 2 % E if 2 * live <= E else ids).astype(np.int64)


def align_on(b, ids, E, block_m):
    xp = b.xp
    cap = moe_align_capacity(ids.size, E, block_m)
    out = (xp.full(cap, -7, np.int32), xp.full(cap // block_m, -7, np.int32),
           xp.full(E + 1, -7, np.int32), xp.full(1, -7, np.int32))
    b.moe_align(b.asarray(ids), E, block_m, *out)
    return [np.asarray(b.to_host(a)) for a in out], out


@pytest.mark.parametrize("T, k, E, block_m", [(1, 2, 8, 16), (1, 8, 128, 16), (37, 2, 8, 16),
                                              (37, 2, 8, 64), (512, 8, 128, 16),
                                              (300, 4, 16, 64), (3, 1, 1, 64)])
def test_align_matches_cpu(cuda_bf16, cpu, T, k, E, block_m):
    ids = skewed_ids(np.random.default_rng(T + E), T, k, E) if E > 1 else np.zeros((T, k),
                                                                                    np.int64)
    (s_c, b_c, o_c, n_c), _ = align_on(cpu, ids, E, block_m)
    (s_g, b_g, o_g, n_g), _ = align_on(cuda_bf16, ids, E, block_m)
    assert n_g.tolist() == n_c.tolist() and o_g.tolist() == o_c.tolist()
    assert b_g.tolist() == b_c.tolist()
    for e in range(E):
        run = slice(int(o_c[e]), int(o_c[e + 1]))
        assert sorted(s_g[run].tolist()) == sorted(s_c[run].tolist()), e
    assert (s_g[int(n_c[0]):] == ids.size).all()


def q8_0_experts(rng, E, N, K):
    """E Q8_0 weights (N, K) as the loader builds them, blocks from gguf-py's quantizer."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize as gguf_quantize

    from pyx.weights.ggml import QuantizedWeight
    return [QuantizedWeight([(int(QT.Q8_0), gguf_quantize(
        (rng.standard_normal((N, K)) * 0.05).astype(np.float32), QT.Q8_0))], K)
        for _ in range(E)]


SHAPES = [  # (T, k, E, N, K): decode, prefill (M tile 64), odd N, K % 8 != 0, many empty experts
    (1, 2, 8, 1536, 256), (4, 8, 128, 256, 128), (200, 2, 4, 384, 256), (37, 2, 8, 301, 96),
    (9, 2, 4, 48, 24), (64, 4, 64, 128, 512)]


@pytest.mark.parametrize("fmt", ["dtype", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_grouped_gemm_matches_cpu(make_cuda, cpu, dt, shape, fmt):
    T, k, E, N, K = shape
    if fmt == "q8_0" and K % 32:
        pytest.skip("Q8_0 rows are whole 32-element blocks")
    b = make_cuda(dt)
    rng = np.random.default_rng(T * 7 + N)
    ids = skewed_ids(rng, T, k, E)
    if fmt == "q8_0":   # the reference multiplies the CPU's scalar dequantization in float
        host_w = q8_0_experts(rng, E, N, K)
        from pyx.cpu_backend import dequantize_weight
        ref_w = [dequantize_weight(w) for w in host_w]
    else:  # weights and activations rounded to the device dtype, so both sides see the same
        host_w = [rng.standard_normal((N, K)).astype(b.act_dtype).astype(np.float32) * 0.05
                  for _ in range(E)]
        ref_w = host_w
    x = rng.standard_normal((T, K)).astype(b.act_dtype)
    P = T * k
    for block_m in (16, 64):
        (s, be, _, n), _ = align_on(cpu, ids, E, block_m)
        want = np.full((P, N), np.nan, np.float32)
        cpu.moe_grouped_linear(x.astype(np.float32), cpu.stack_experts(ref_w), s, be, n, k,
                               block_m, want)
        _, dev = align_on(b, ids, E, block_m)
        stack = b.stack_experts([b.place_weight(w) for w in host_w])
        assert stack.qtype == (8 if fmt == "q8_0" else 0)
        out = b.xp.full((P, N), np.nan, b.act_dtype)
        b.moe_grouped_linear(b.asarray(x), stack, dev[0], dev[1], dev[3], k, block_m, out)
        got = b.to_host(out).astype(np.float32)
        assert np.isfinite(got).all(), block_m
        assert rel_err(got, want) < TOL[dt], (block_m, rel_err(got, want))
        for p in range(0, P, max(1, P // 16)):   # row by row: a misplaced row hides in the norm
            assert rel_err(got[p], want[p]) < 3 * TOL[dt], (block_m, p)


def test_down_projection_reads_pair_rows(cuda_bf16, cpu):
    """x_div 1: the activation rows are the pairs themselves (the down projection)."""
    b = cuda_bf16
    rng = np.random.default_rng(5)
    T, k, E, N, K = 13, 2, 8, 64, 96
    ids = skewed_ids(rng, T, k, E)
    ws = [rng.standard_normal((N, K)).astype(b.act_dtype).astype(np.float32) for _ in range(E)]
    x = rng.standard_normal((T * k, K)).astype(b.act_dtype)
    (s, be, _, n), _ = align_on(cpu, ids, E, 16)
    want = np.empty((T * k, N), np.float32)
    cpu.moe_grouped_linear(x.astype(np.float32), cpu.stack_experts(ws), s, be, n, 1, 16, want)
    _, dev = align_on(b, ids, E, 16)
    out = b.xp.full((T * k, N), np.nan, b.act_dtype)
    b.moe_grouped_linear(b.asarray(x), b.stack_experts([b.place_weight(w) for w in ws]), dev[0],
                         dev[1], dev[3], 1, 16, out)
    assert rel_err(b.to_host(out).astype(np.float32), want) < 1e-2


def test_combine_matches_cpu(cuda_bf16, cpu):
    b = cuda_bf16
    rng = np.random.default_rng(6)
    T, k, H, E = 11, 4, 200, 16
    y = rng.standard_normal((T * k, H)).astype(b.act_dtype)
    w = rng.random((T, k)).astype(np.float32)
    ids = skewed_ids(rng, T, k, E)
    ids[3, 2] = E                                   # outside the experts: skipped on both
    want = np.empty((T, H), np.float32)
    cpu.moe_combine(y.astype(np.float32), w, ids, E, want)
    out = b.xp.full((T, H), np.nan, b.act_dtype)
    b.moe_combine(b.asarray(y), b.asarray(w), b.asarray(ids), E, out)
    assert rel_err(b.to_host(out).astype(np.float32), want) < 5e-3


@pytest.mark.parametrize("T", [1, 3, 40, 300])
def test_fused_block_matches_cpu_block(make_cuda, cpu, T):
    """The whole block: routing, align, gate_up, SiLU-and-mul, down, combine (fused, CUDA)
    against the one-expert-at-a-time block on the CPU (itself equal to transformers' in
    tests/test_moe.py), same bf16-rounded weights."""
    from pyx.layers import Workspace
    from pyx.moe import MoE

    b = make_cuda("bf16")
    rng = np.random.default_rng(T)
    H, I, E, k = 256, 128, 16, 4

    def r(*shape):
        return rng.standard_normal(shape).astype(b.act_dtype).astype(np.float32) * 0.08
    router, gate_up, down = r(E, H), [r(2 * I, H) for _ in range(E)], [r(H, I) for _ in range(E)]
    x = (rng.standard_normal((T, H)) * 2).astype(b.act_dtype)
    want = np.empty((T, H), np.float32)
    MoE(cpu, router, gate_up, down, k, True).forward(x.astype(np.float32), want, Workspace(np))
    block = MoE(b, b.place_weight(router), [b.place_weight(w) for w in gate_up],
                [b.place_weight(w) for w in down], k, True, fused=True)
    out = b.xp.full((T, H), np.nan, b.act_dtype)
    block.forward(b.asarray(x), out, Workspace(b.xp, b.act_dtype))
    got = b.to_host(out).astype(np.float32)
    assert np.isfinite(got).all()
    # bf16 routing logits may flip a near-tied expert choice for a token: compare tokens whose
    # CPU top-k is clear of the (k+1)-th by a margin, and require most tokens to qualify
    logits = x.astype(np.float32) @ router.T
    top = np.sort(logits, axis=1)[:, ::-1]
    clear = top[:, k - 1] - top[:, k] > 0.05
    assert clear.mean() > 0.5
    assert rel_err(got[clear], want[clear]) < 2e-2


def test_bad_weights_are_refused(cuda_bf16):
    b = cuda_bf16
    with pytest.raises(ValueError, match="stack_experts: the fused MoE path"):
        b.stack_experts([b.place_weight(np.zeros((8, 16), np.float32)), np.zeros((8, 16))])


# ---- model level

GEN = 16
TIE = 0.05
ARCHS = ["mixtral", "qwen3_moe"]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from checkpoints import tiny256_checkpoint
    root = tmp_path_factory.mktemp("moe256")
    return {a: tiny256_checkpoint(os.path.join(root, a), arch=a) for a in ARCHS}


def fused_llm(path, **config):
    from engine import LLM
    llm = LLM(path, backend="cuda", dtype="bf16", num_kv_blocks=256, max_num_seqs=8,
              kernels="moe=fused", **config)
    from pyx.moe import MoE
    blocks = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, MoE)]
    assert blocks and all(m.fused for m in blocks)
    return llm


def greedy(llm, prompts, n=GEN):
    from engine import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 512, n).tolist() for n in (5, 23, 40, 70, 17)]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_greedy_equals_transformers(moe_checkpoints, arch):
    from hf_oracle import hf_greedy, load_hf
    hf = load_hf(moe_checkpoints[arch])
    refs = [hf_greedy(hf, p, GEN, tie=TIE) for p in prompts()]
    # a small token budget: chunked prefill rows mix with decode rows in one grouped GEMM
    llm = fused_llm(moe_checkpoints[arch], max_num_batched_tokens=48,
                    cuda_graph=False)
    compared = 0
    for i, (got, (tokens, trusted, _)) in enumerate(zip(greedy(llm, prompts()), refs)):
        assert got[:trusted] == tokens[:trusted], (
            f"{arch} prompt {i}: taper {got} vs transformers {tokens} (trusted {trusted})")
        compared += trusted
    assert compared >= 12, f"only {compared} tokens compared: near-ties everywhere"


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_graph_replay_equals_eager(moe_checkpoints, arch):
    """The fused path has no host round trip, so MoE decode steps capture in CUDA Graphs."""
    eager = greedy(fused_llm(moe_checkpoints[arch], cuda_graph=False), prompts())
    graphs = greedy(fused_llm(moe_checkpoints[arch], cuda_graph=True), prompts())
    assert graphs == eager


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fused_q8_0_gguf_matches_transformers_on_the_file_weights(name):
    """llama.cpp's own Q8_0 files (tests/data/gguf, made by its converter and quantizer): the
    experts stay Q8_0 blocks in the grouped GEMM, and the greedy tokens are those recorded from
    transformers on the file's dequantized weights (tests/test_gguf_moe.py), up to its first
    top-two margin under 0.05."""
    import json
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "gguf")
    with open(os.path.join(data, "moe_fixtures.json")) as f:
        model = json.load(f)["models"][name]
    ref = model["files"]["q8_0"]["transformers"]
    n = next((i for i, m in enumerate(ref["margins"]) if m < TIE), len(ref["margins"]))
    assert n >= 4, "reference near-tie too early"
    llm = fused_llm(data, weight_file=f"{name}-q8_0.gguf", cuda_graph=False)
    from pyx.moe import MoE
    blocks = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, MoE)]
    assert all(m.gate_up.qtype == 8 and m.down.qtype == 8 for m in blocks)
    assert greedy(llm, [model["prompt_ids"]], n)[0] == ref["tokens"][:n]

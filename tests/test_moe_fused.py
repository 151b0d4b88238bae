"""The fused MoE path's CPU ops (pyx/cpu_moe.py, the reference of cuda/moe.cu) and the block
wired through them (pyx/moe.py, fused=True).

moe_align against literal lists and against a plain per-pair loop written here from vLLM's
moe_align_block_size contract (sorted by expert, pair order kept, runs padded to the M tile, the
rest filled with P, block -> expert map, -1 past the padded total); moe_combine against float64;
the block with fused=True against transformers' own Mixtral / Qwen2-MoE / Qwen3-MoE blocks (as
tests/test_moe.py does for the one-expert-at-a-time path), and a broken alignment shown to move
the output away from transformers', so the comparison can fail. The CUDA kernels are compared
with these ops in tests/gpu/test_cuda_moe.py."""
from __future__ import annotations

import numpy as np
import pytest

from pyx.cpu_backend import CpuBackend
from pyx.layers import Workspace
from pyx.moe import moe_align_capacity, moe_block_m



def align(backend, ids, E, block_m):
    ids = np.ascontiguousarray(ids, np.int64)
    cap = moe_align_capacity(ids.size, E, block_m)
    sorted_ids = np.full(cap, -7, np.int32)
    block_expert = np.full(cap // block_m, -7, np.int32)
    offsets = np.full(E + 1, -7, np.int32)
    num_padded = np.full(1, -7, np.int32)
    backend.moe_align(ids, E, block_m, sorted_ids, block_expert, offsets, num_padded)
    return sorted_ids, block_expert, offsets, int(num_padded[0])


def loop_reference(ids, E, block_m):
    """moe_align_block_size's result, one pair at a time."""
    flat = [int(e) for e in np.asarray(ids).reshape(-1)]
    P = len(flat)
    runs = [[p for p in range(P) if flat[p] == e] for e in range(E)]
    offsets, rows, blocks = [0], [], []
    for e, run in enumerate(runs):
        padded = -(-len(run) // block_m) * block_m
        rows += run + [P] * (padded - len(run))
        blocks += [e] * (padded // block_m)
        offsets.append(offsets[-1] + padded)
    cap = moe_align_capacity(P, E, block_m)
    rows += [P] * (cap - len(rows))
    blocks += [-1] * (cap // block_m - len(blocks))
    return rows, blocks, offsets


def test_align_literal():
    b = CpuBackend()
    ids = [[2, 0], [2, 1], [0, 2]]          # pairs 0..5 -> experts 2 0 2 1 0 2; expert 3 empty
    sorted_ids, block_expert, offsets, total = align(b, ids, 4, 16)
    P = 6
    assert total == 48 and offsets.tolist() == [0, 16, 32, 48, 48]
    assert sorted_ids.tolist() == ([1, 4] + [P] * 14 + [3] + [P] * 15 + [0, 2, 5] + [P] * 13
                                   + [P] * 32)   # capacity: ceil((6 + 4 * 15) / 16) * 16 = 80
    assert block_expert.tolist() == [0, 1, 2, -1, -1]


def test_align_skips_ids_outside_the_experts():
    b = CpuBackend()
    sorted_ids, block_expert, offsets, total = align(b, [[1, -1], [4, 1]], 4, 16)
    assert total == 16 and offsets.tolist() == [0, 0, 16, 16, 16]
    assert sorted_ids[:16].tolist() == [0, 3] + [4] * 14
    assert block_expert.tolist()[:1] == [1] and set(block_expert.tolist()[1:]) == {-1}


@pytest.mark.parametrize("T, k, E, block_m", [(1, 2, 8, 16), (7, 2, 8, 16), (33, 8, 128, 16),
                                              (300, 2, 4, 64), (64, 4, 16, 64), (5, 1, 1, 16)])
def test_align_matches_the_per_pair_loop(T, k, E, block_m):
    b = CpuBackend()
    rng = np.random.default_rng(T * 1000 + E)
    # uneven counts with empty experts: ids drawn from a skewed distribution over half of them
    p = rng.dirichlet(np.full(max(E // 2, 1), 0.3))
    ids = rng.choice(max(E // 2, 1), size=(T, k), p=p) * (2 if E > 1 else 1) % E
    sorted_ids, block_expert, offsets, total = align(b, ids, E, block_m)
    rows, blocks, offs = loop_reference(ids, E, block_m)
    assert sorted_ids.tolist() == rows
    assert block_expert.tolist() == blocks
    assert offsets.tolist() == offs and total == offs[-1]
    assert total % block_m == 0 and total <= sorted_ids.size


def test_graph_safe_routing_picks_the_same_experts():
    """The fused path's top-k by argmax passes against the partition's, on ties-free logits."""
    from pyx.moe import route
    logits = np.random.default_rng(9).normal(size=(50, 16)).astype(np.float32)
    for normalize in (False, True):
        ids, w = route(logits, 4, normalize)
        ids2, w2 = route(logits, 4, normalize, graph_safe=True)
        for a, wa, b, wb in zip(ids, w, ids2, w2):
            assert sorted(a.tolist()) == sorted(b.tolist())
            np.testing.assert_allclose(sorted(wa), sorted(wb), rtol=1e-6)
        assert (np.diff(w2, axis=1) <= 0).all()        # by probability, highest first


def test_block_m_rule():
    assert moe_block_m(8, 128) == 16 and moe_block_m(64 * 8, 8) == 64 and moe_block_m(511, 8) == 16


def test_combine_against_float64():
    b = CpuBackend()
    rng = np.random.default_rng(3)
    T, k, H, E = 5, 3, 24, 6
    y = rng.normal(size=(T * k, H)).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    ids = rng.integers(0, E, (T, k)).astype(np.int64)
    ids[2, 1] = -1                                   # an unrouted slot adds nothing
    out = np.full((T, H), np.nan, np.float32)
    b.moe_combine(y, w, ids, E, out)
    want = np.einsum("tk,tkh->th", np.where(ids >= 0, w, 0).astype(np.float64),
                     y.reshape(T, k, H).astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_grouped_linear_runs_each_expert_on_its_rows():
    """Against x[p // k] @ W[e].T computed here pair by pair (float64)."""
    b = CpuBackend()
    rng = np.random.default_rng(4)
    T, k, E, N, K = 9, 2, 5, 12, 20
    ids = rng.integers(0, E - 1, (T, k)).astype(np.int64)    # expert E-1 gets no tokens
    ws = [rng.normal(size=(N, K)).astype(np.float32) for _ in range(E)]
    x = rng.normal(size=(T, K)).astype(np.float32)
    sorted_ids, block_expert, _, total = align(b, ids, E, 16)
    out = np.full((T * k, N), np.nan, np.float32)
    b.moe_grouped_linear(x, b.stack_experts(ws), sorted_ids, block_expert,
                         np.array([total], np.int32), k, 16, out)
    for p in range(T * k):
        want = x[p // k].astype(np.float64) @ ws[ids.reshape(-1)[p]].T.astype(np.float64)
        np.testing.assert_allclose(out[p], want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_name_the_op():
    b = CpuBackend()
    ids = np.zeros((3, 2), np.int64)
    with pytest.raises(ValueError, match=r"^moe_align: sorted_ids must be"):
        b.moe_align(ids, 4, 16, np.empty(5, np.int32), np.empty(6, np.int32),
                    np.empty(5, np.int32), np.empty(1, np.int32))
    with pytest.raises(ValueError, match=r"^moe_align: .*block_m 16 or 64"):
        b.moe_align(ids, 4, 8, np.empty(5, np.int32), np.empty(6, np.int32),
                    np.empty(5, np.int32), np.empty(1, np.int32))
    ws = b.stack_experts([np.zeros((4, 8), np.float32)] * 2)
    with pytest.raises(ValueError, match=r"^moe_grouped_linear: x has 3 rows"):
        b.moe_grouped_linear(np.zeros((3, 8), np.float32), ws, np.zeros(48, np.int32),
                             np.zeros(3, np.int32), np.zeros(1, np.int32), 1, 16,
                             np.zeros((6, 4), np.float32))
    with pytest.raises(ValueError, match=r"^moe_combine: need y"):
        b.moe_combine(np.zeros((5, 4), np.float32), np.zeros((3, 2), np.float32), ids, 4,
                      np.zeros((3, 4), np.float32))


def test_cuda_launchers_refuse_bad_sizes_naming_the_op():
    """Host side of cuda/moe.cu, on any machine with the extension built: the launchers check
    their sizes before touching the device, and a failure names the op and the sizes."""
    import importlib.util
    if importlib.util.find_spec("pyx.cuda_backend") is None:
        pytest.skip("pyx.cuda_backend was not built (no nvcc here, or TAPER_CUDA=0)")
    import pyx.cuda_backend as cb
    if not hasattr(cb, "launch_moe_grouped_gemm"):
        pytest.skip("pyx.cuda_backend predates cuda/moe.cu (rebuild with nvcc)")
    with pytest.raises(cb.CudaError, match=r"^moe_align: .*status -1.*E=5000"):
        cb.launch_moe_align(0, 0, 0, 0, 0, 4, 5000, 16, 0)          # E over 4096
    with pytest.raises(cb.CudaError, match=r"^moe_grouped_gemm: .*status -1.*block_m=32"):
        cb.launch_moe_grouped_gemm(8, 8, 0, 8, 8, 8, 8, 4, 2, 16, 64, 2, 32, 1, 0)
    with pytest.raises(cb.CudaError, match=r"^moe_grouped_gemm: .*K=40.*wtype=8"):
        cb.launch_moe_grouped_gemm(8, 8, 8, 8, 8, 8, 8, 4, 2, 16, 40, 2, 16, 1, 0)  # Q8_0 K%32
    with pytest.raises(cb.CudaError, match=r"^moe_combine: .*status -1"):
        cb.launch_moe_combine(8, 8, 8, 8, 2, 0, 16, 4, 1, 0)          # top_k 0


# ---- the block, fused, against transformers (tests/test_moe.py's models and helpers)

torch = pytest.importorskip("torch")
from test_moe import CASES, H, T, our_block, saved_weights, tiny, torch_block, torch_out  # noqa: E402


@pytest.mark.parametrize("arch, overrides", CASES)
def test_fused_block_equals_transformers(arch, overrides, tmp_path):
    model = tiny(arch, **overrides)
    block = our_block(arch, model, saved_weights(model, tmp_path), CpuBackend(), fused=True)
    assert block.fused
    x = np.random.default_rng(1).normal(0, 1, (T, H)).astype(np.float32)
    out = np.empty((T, H), np.float32)
    block.forward(x, out, Workspace(np))
    np.testing.assert_allclose(out, torch_out(torch_block(arch, model), x), atol=2e-5, rtol=1e-4)


def test_a_wrong_alignment_leaves_transformers(tmp_path, monkeypatch):
    """So the test above can fail: the same block with each run's expert shifted by one."""
    model = tiny("mixtral")
    backend = CpuBackend()
    block = our_block("mixtral", model, saved_weights(model, tmp_path), backend, fused=True)
    x = np.random.default_rng(1).normal(0, 1, (T, H)).astype(np.float32)
    want = torch_out(torch_block("mixtral", model), x)

    class Shifted:
        def __getattr__(self, name):
            return getattr(backend, name)

        def moe_align(self, ids, E, *rest):
            backend.moe_align(ids, E, *rest)
            be = rest[2]
            be[be >= 0] = (be[be >= 0] + 1) % E
    block.backend = Shifted()
    out = np.empty((T, H), np.float32)
    block.forward(x, out, Workspace(np))
    assert np.abs(out - want).max() > 1e-2


# ---- the whole engine on the fused path (CPU reference ops) against transformers

from test_models_moe import ARCHS, dirs, hf_tokens  # noqa: E402,F401 (dirs is a fixture)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_the_fused_path_equals_transformers(dirs, arch, monkeypatch):
    """The family code's MoE blocks on the fused path (kernels moe=fused, as on CUDA), run by
    the CPU backend's reference ops: greedy tokens equal transformers'."""
    import engine.models.moe as family
    from engine import LLM, SamplingParams
    from hf_oracle import assert_matches, load_hf
    from model_cases import GEN, prompts_for
    from pyx.moe import MoE

    made = []

    def recorded_moe(*args, **kwargs):
        made.append(MoE(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(family, "MoE", recorded_moe)
    refs = hf_tokens(load_hf(dirs[arch]))
    llm = LLM(dirs[arch], kv_cache_memory_mb=16, max_num_batched_tokens=32, kernels="moe=fused")
    assert llm.engine.backend.fused_moe
    assert made and all(m.fused for m in made)
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0.0, max_tokens=GEN,
                                                       ignore_eos=True))
    for out, ref in zip(outs, refs):
        assert_matches(out.token_ids, ref, label=arch)

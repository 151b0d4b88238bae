"""Tensor parallel's CUDA path (issue 28): NCCL through CuPy (engine/parallel/nccl.py) on the
backend's stream.

  one device   a group of one rank through the NCCL communicator: the split graph (row-parallel
               attention and MLP with their all-reduces, the vocab-parallel embedding's zero
               row and the LM head's all-gather) gives the plain engine's greedy tokens; with
               --kernels graphs_parallel=on its decode steps replay graphs captured with the
               collectives inside, the bucket rank 0 chose (StepInputs.graphs), and give the
               eager rank's tokens; the collectives alone in bf16, also replayed from a
               captured graph.
  two devices  tensor_parallel_size 2 against one device (skipped with fewer than 2 GPUs:
               pending a machine with several).
  GPTQ, Gemma 4 a GPTQ checkpoint (its cut tensors repacked for Marlin), Gemma 4's MoE
  MoE, E2B     (each branch all-reduced before its post-norm) and E2B's shape (the per-layer
               table's vocab-parallel lookup, the projection's all-gather, the KV-shared layers'
               all-reduce) in a group of one against the plain engine; on two devices pending a
               machine with several.
  expert       the fused MoE block's shares of two ranks holding [0, E/2) and [E/2, E) add up
  parallel     to the whole block's output on the device (the other rank's pairs unrouted in
               moe_align and moe_combine); a Mixtral-shaped model with enable_expert_parallel in
               a group of one through the NCCL communicator gives the plain engine's tokens,
               with decode graphs.

NCCL comes from the nvidia-nccl wheel beside CuPy; without it these tests fail naming it.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_model import GEN, checkpoints, greedy, make_llm, random_prompts  # noqa: F401


class OneRank:
    """The MPI group's part NcclCommunicator and the builder use, for a group of one."""
    rank, size = 0, 1

    def send(self, message):
        pass

    def allgather(self, value):
        return [value]

    def close(self):
        pass


def test_nccl_collectives_of_one_rank():
    from conftest import cuda_backend
    from engine.parallel.nccl import NcclCommunicator
    backend = cuda_backend("bf16")
    comm = NcclCommunicator(OneRank(), backend)
    cp = backend.xp
    x = cp.asarray(np.linspace(-3, 3, 4096, dtype=np.float32)).astype(backend.act_dtype)
    want = cp.asnumpy(x.astype(cp.float32))
    comm.all_reduce(x)
    np.testing.assert_array_equal(cp.asnumpy(x.astype(cp.float32)), want)
    gathered = comm.all_gather(cp.arange(12, dtype=cp.float32).reshape(3, 4))
    assert gathered.shape == (1, 3, 4)
    np.testing.assert_array_equal(cp.asnumpy(gathered[0]), np.arange(12).reshape(3, 4))
    graph = backend.capture_graph(lambda: comm.all_reduce(x))   # NCCL inside a CUDA graph
    graph.launch()
    backend.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(x.astype(cp.float32)), want)
    assert comm.all_min(7) == 7


def one_rank_llm(path, monkeypatch, **config):
    """An engine built as a group of one rank (the split graph, its NCCL communicator)."""
    import engine.core.llm_engine as llm_engine
    from engine.core.builder import build
    monkeypatch.setattr(llm_engine, "build",
                        lambda config, loaded=None: build(config, loaded, group=OneRank()))
    return make_llm(path, "cuda", **config)


def test_split_graph_of_one_rank_matches_plain_engine(checkpoints, monkeypatch):
    path = checkpoints("llama")
    prompts = random_prompts(3, (40, 17, 70))
    plain = [list(o.token_ids) for o in greedy(make_llm(path, "cuda"), prompts)]
    llm = one_rank_llm(path, monkeypatch)
    assert llm.engine.model.config.tensor_parallel is not None      # the split graph ran
    assert llm.engine.runner.graph_runner is None       # graphs_parallel=off: eager ranks
    split = [list(o.token_ids) for o in greedy(llm, prompts)]
    assert split == plain


def tp_quant_checkpoint(kind: str, tmp_path) -> str:
    """A GPTQ int4 tiny-256 Llama (groups of 128: its Marlin repack starts from the rank's cut
    tensors), a tiny-256 Gemma 4 26B-A4B-shaped MoE or E2B-shaped model."""
    from checkpoints import tiny256_checkpoint, tiny_checkpoint
    if kind in ("gemma4_moe", "gemma4_e2b"):
        return tiny256_checkpoint(str(tmp_path / kind), arch=kind, dtype="bfloat16")
    from test_int4_formats import CHECKPOINT, write_gptq_awq
    floats = tiny_checkpoint(str(tmp_path / "f32"), "llama", **CHECKPOINT)
    return write_gptq_awq(floats, tmp_path / kind, "gptq", False, 128)[0]


@pytest.mark.parametrize("kind", ["gptq", "gemma4_moe", "gemma4_e2b"])
def test_split_gptq_and_gemma4_moe_of_one_rank_match_plain_engine(kind, monkeypatch, tmp_path):
    """GPTQ's cut tensors repacked for Marlin, Gemma 4's per-branch all-reduces through NCCL."""
    path = tp_quant_checkpoint(kind, tmp_path)
    prompts = random_prompts(3, (40, 17, 70))
    plain = [list(o.token_ids) for o in greedy(make_llm(path, "cuda"), prompts)]
    llm = one_rank_llm(path, monkeypatch)
    assert llm.engine.model.config.tensor_parallel is not None
    assert [list(o.token_ids) for o in greedy(llm, prompts)] == plain


@pytest.mark.parametrize("kind", ["gptq", "gemma4_moe", "gemma4_e2b"])
def test_two_devices_split_gptq_and_gemma4_moe(kind, tmp_path):
    need_two_devices(f"{kind} at tensor_parallel_size 2")
    assert_two_devices_match_one(tp_quant_checkpoint(kind, tmp_path), random_prompts(5, (40, 17)),
                                 tensor_parallel_size=2)


def need_two_devices(what: str) -> None:
    """Skips the test (`what` it runs named) on a machine with fewer than 2 GPUs."""
    from pyx.cuda_backend import device_count
    if device_count() < 2:
        pytest.skip(f"pending a machine with 2+ GPUs: {what}")


def assert_two_devices_match_one(path, prompts, **split):
    """The engine split across two devices (split: EngineConfig's, e.g. tensor_parallel_size=2)
    starts with one device's greedy tokens: bf16 sums in another order (or a pipeline's
    micro-batches changing the GEMMs' shapes) let only the first tokens agree."""
    one = [list(o.token_ids) for o in greedy(make_llm(path, "cuda"), prompts)]
    llm = make_llm(path, "cuda", **split)
    try:
        two = [list(o.token_ids) for o in greedy(llm, prompts)]
    finally:
        llm.engine.shutdown()
    for a, b in zip(one, two):
        assert a[:8] == b[:8], (a, b)


def test_graphs_parallel_replays_with_the_collectives_inside(checkpoints, monkeypatch):
    """graphs_parallel=on: four sequences decode through the bucket-4 graph (the same kernels
    on the same shapes as the eager rank: the same tokens), all-reduces and all-gather replayed
    from it; every decode step replayed, none run eagerly in its place."""
    path = checkpoints("llama")
    prompts = random_prompts(4, (40, 17, 70, 9))
    eager_llm = one_rank_llm(path, monkeypatch)
    eager = [list(o.token_ids) for o in greedy(eager_llm, prompts)]
    llm = one_rank_llm(path, monkeypatch, kernels="graphs_parallel=on")
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    got = [list(o.token_ids) for o in greedy(llm, prompts)]
    assert got == eager
    assert graphs.num_replays >= GEN - 2 and graphs.num_eager_fallbacks == 0


def test_two_devices_match_one(checkpoints):
    need_two_devices("tensor_parallel_size 2 on two devices")
    assert_two_devices_match_one(checkpoints("llama"), random_prompts(5, (40, 17)),
                                 tensor_parallel_size=2)


def test_expert_parallel_shares_add_up_on_the_device():
    from conftest import cuda_backend
    from pyx.layers import Workspace
    from pyx.moe import MoE
    b = cuda_backend("bf16")
    rng = np.random.default_rng(3)
    H, I, E, k, T = 256, 128, 16, 4, 40

    def r(*shape):
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)
    router, gate_up, down = r(E, H), [r(2 * I, H) for _ in range(E)], [r(H, I) for _ in range(E)]
    x = b.asarray((rng.standard_normal((T, H)) * 2).astype(b.act_dtype))

    def block_output(first, held):
        place = b.place_weight
        block = MoE(b, place(router), [place(w) for w in gate_up[first:first + held]],
                    [place(w) for w in down[first:first + held]], k, True, fused=True,
                    first_expert=first, num_experts=E)
        out = b.xp.full((T, H), np.nan, b.act_dtype)      # an unwritten row fails
        block.forward(x, out, Workspace(b.xp, b.act_dtype))
        return b.to_host(out).astype(np.float32)
    whole = block_output(0, E)
    shares = block_output(0, E // 2) + block_output(E // 2, E // 2)
    assert np.isfinite(shares).all()
    err = np.linalg.norm(shares - whole) / np.linalg.norm(whole)
    assert err < 1e-2, err          # each share rounded to bf16 once more than the whole


def test_expert_parallel_of_one_rank_matches_plain_engine(monkeypatch, tmp_path):
    import engine.core.llm_engine as llm_engine
    from checkpoints import tiny256_checkpoint
    from engine.core.builder import build
    from pyx.moe import MoE
    path = tiny256_checkpoint(str(tmp_path / "mixtral"), arch="mixtral", dtype="bfloat16")
    prompts = random_prompts(4, (40, 17, 70))
    plain = [list(o.token_ids) for o in greedy(make_llm(path, "cuda", kernels="moe=fused"),
                                                prompts)]
    monkeypatch.setattr(llm_engine, "build",
                        lambda config, loaded=None: build(config, loaded, group=OneRank()))
    llm = make_llm(path, "cuda", kernels="moe=fused", enable_expert_parallel=True)
    assert llm.engine.model.config.tensor_parallel.experts == (0, 8)   # the split graph ran
    blocks = [layer.mlp.block for layer in llm.engine.model.layers]
    assert all(isinstance(m, MoE) and m.fused for m in blocks)
    assert llm.engine.runner.graph_runner is not None
    split = [list(o.token_ids) for o in greedy(llm, prompts)]
    assert split == plain

"""Expert parallel on the CPU backend (issue 28 item 1, vLLM's --enable-expert-parallel): a MoE
model's tensor-parallel ranks each hold E / N whole experts (engine/parallel/sharding.py), route
every token as one process does (the router is replicated), run only the pairs routed to their
experts (pyx/moe.py), and the all-reduce after the block adds the ranks' shares; attention and
the shared expert stay split within the ranks.

- The block: the shares of ranks holding [0, E/2) and [E/2, E) (and four quarters) add up to the
  whole block's output, on the one-expert-at-a-time and the fused (grouped GEMM) paths.
- Greedy tokens with tensor_parallel_size 2 and expert parallel equal transformers' (up to a
  near-tie) and the single process's, logprobs within float tolerance: Mixtral, Qwen2-MoE (its
  sigmoid-gated shared expert split within the ranks), Qwen3-MoE (a dense first layer), GLM-4.5
  (DeepSeek-V3's grouped sigmoid router) and MiniMax-M2 (q/k norms over all heads) with tensor
  parallel alone as well, GPT-OSS (stacked experts and sinks; float and MXFP4) and Llama 4
  (stacked experts, its own attention), these two expert parallel only; q8_0 GGUFs (Qwen3-MoE with 8 experts, Qwen2-MoE); with pipeline
  parallel (2 stages x 2 ranks).
- A rank reads only its experts: the tensors handed to the model are its experts' alone (and
  the whole of each), from safetensors and from a GGUF's stacked expert tensors, an FP8 expert's
  block scales with it; tracemalloc's peak while a rank of 2 loads a checkpoint whose experts
  are nearly all of it stays near half. --isq q8_0 and int4 (Marlin) quantize whole experts.
- An expert count the ranks do not divide is refused, naming the numbers; the server's flag
  reaches the engine config.
"""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches
from model_cases import Cases
import test_tensor_parallel as tensor_parallel
from test_tensor_parallel import assert_same_as_one_process, wait_for_workers_gone, worker_pids

pytestmark = pytest.mark.timeout(300)

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")
# Qwen2-MoE's tiny case has 3 query heads, which 2 ranks cannot split: 4 here.
CASES = {"mixtral": (dict(arch="mixtral"), None), "qwen3_moe": (dict(arch="qwen3_moe"), None),
         "qwen2_moe": (dict(arch="qwen2_moe", num_attention_heads=4, num_key_value_heads=2),
                       None),
         "glm4_moe": (dict(arch="glm4_moe"), None), "gpt_oss": (dict(arch="gpt_oss"), None),
         "llama4": (dict(arch="llama4"), None), "minimax_m2": (dict(arch="minimax_m2"), None)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("ep")), CASES)


def moe_blocks(model):
    """The model's MoE blocks (pyx/moe.py's, GPT-OSS's), unwrapped from a split model's
    all-reduce."""
    blocks = [getattr(layer.mlp, "block", layer.mlp) for layer in model.layers]
    return [b for b in blocks if hasattr(b, "first_expert")]


def greedy(model, tp: int = 1, pp: int = 1, **kwargs):
    """(token ids, logprobs) of each prompt and the experts (first, held, all) of rank 0's MoE
    blocks; the engine shut down after."""
    return tensor_parallel.greedy(
        model, tp, pipeline_parallel_size=pp, **kwargs,
        inspect=lambda m: {(b.first_expert, b.num_held, b.num_experts) for b in moe_blocks(m)})


# ---- the block

def random_block(backend, E, fused, first=0, held=None, seed=0):
    from pyx.moe import MoE
    rng = np.random.default_rng(seed)
    H, I, k = 64, 32, 2

    def r(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)
    router, gate_up, down = r(E, H), [r(2 * I, H) for _ in range(E)], [r(H, I) for _ in range(E)]
    held = held or E
    place = backend.place_weight
    return MoE(backend, place(router), [place(w) for w in gate_up[first:first + held]],
               [place(w) for w in down[first:first + held]], k, True, fused=fused,
               first_expert=first, num_experts=E)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_shares_add_up_to_the_whole_block(fused, ranks):
    """Each share's output poisoned with NaN first: a row a share leaves unwritten fails."""
    from pyx.cpu_backend import CpuBackend
    from pyx.layers import Workspace
    b = CpuBackend(num_threads=1)
    E, T = 8, 37
    x = np.random.default_rng(1).standard_normal((T, 64)).astype(np.float32)
    want = np.full((T, 64), np.nan, np.float32)
    random_block(b, E, fused).forward(x, want, Workspace(np))
    total = np.zeros_like(want)
    for r in range(ranks):
        share = np.full_like(want, np.nan)
        block = random_block(b, E, fused, first=r * E // ranks, held=E // ranks)
        block.forward(x, share, Workspace(np))
        assert np.isfinite(share).all()
        total += share
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-6)


def test_experts_outside_the_router_are_refused():
    from pyx.cpu_backend import CpuBackend
    from pyx.moe import MoE
    b = CpuBackend(num_threads=1)
    w = b.place_weight(np.zeros((8, 8), np.float32))
    with pytest.raises(ValueError, match=r"MoE: experts \[6, 10\) are not among the router's 8"):
        MoE(b, w, [w] * 4, [w] * 4, 2, True, first_expert=6, num_experts=8)


# ---- whole models across processes

@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_tokens_match_hf_and_one_process(cases, name):
    before = worker_pids()
    split, held = greedy(cases.dir(name), 2, enable_expert_parallel=True)
    assert held == {(0, 2, 4)}              # rank 0 holds experts 0 and 1 of 4, whole
    for i, (tokens, ref) in enumerate(zip(split[0], cases.ref(name))):
        assert_matches(tokens, ref, min_trusted=8, label=f"{name} ep2 prompt {i}")
    one, _ = greedy(cases.dir(name))
    assert_same_as_one_process(one, split, f"{name} ep2")
    wait_for_workers_gone(before)


@pytest.mark.parametrize("name", ["glm4_moe", "minimax_m2"])
def test_splits_within_and_across_ranks(cases, name):
    """GLM-4.5's DeepSeek-V3 block (grouped sigmoid routing with a correction bias, an ungated
    shared expert, a dense first layer) and MiniMax-M2 (q/k RMSNorm over all heads: its mean
    square all-reduced): 8 experts split within the ranks (tensor parallel) and across them
    (expert parallel), both the single process's and transformers' tokens."""
    one, _ = greedy(cases.dir(name))
    for expert_parallel, held in ((False, (0, 8, 8)), (True, (0, 4, 8))):
        split, rank0 = greedy(cases.dir(name), 2, enable_expert_parallel=expert_parallel)
        assert rank0 == {held}
        label = f"{name} {'ep' if expert_parallel else 'tp'}2"
        for i, (tokens, ref) in enumerate(zip(split[0], cases.ref(name))):
            assert_matches(tokens, ref, min_trusted=8, label=f"{label} prompt {i}")
        assert_same_as_one_process(one, split, label)


@pytest.mark.parametrize("name,arch", [("gpt_oss", "GptOssForCausalLM"),
                                       ("llama4", "Llama4ForCausalLM")])
def test_stacked_experts_split_across_ranks_only(cases, name, arch):
    """GPT-OSS (attention sinks per head, experts with biases) and Llama 4 (its own attention
    all-reduced, top-1 sigmoid on the experts' input, a shared expert) store every expert of a
    layer in one tensor: each rank reads its rows; tensor parallel alone is refused."""
    from engine import LLM
    split, held = greedy(cases.dir(name), 2, enable_expert_parallel=True)
    assert held == {(0, 2, 4)}
    for i, (tokens, ref) in enumerate(zip(split[0], cases.ref(name))):
        assert_matches(tokens, ref, min_trusted=8, label=f"{name} ep2 prompt {i}")
    assert_same_as_one_process(greedy(cases.dir(name))[0], split, f"{name} ep2")
    with pytest.raises(ValueError, match=f"tensor parallel: {arch}'s experts split across ranks "
                                         f"only, whole: add --enable-expert-parallel"):
        LLM(cases.dir(name), tensor_parallel_size=2)


def test_gpt_oss_mxfp4_experts_split_across_ranks(cases, tmp_path):
    """The released checkpoints' layout: each rank dequantizes its own experts' MXFP4 blocks
    (the file's reference against transformers: tests/test_gpt_oss_mxfp4.py)."""
    from test_gpt_oss_mxfp4 import write_mxfp4
    mxfp4 = write_mxfp4(cases.dir("gpt_oss"), str(tmp_path / "mxfp4"))
    split, held = greedy(mxfp4, 2, enable_expert_parallel=True)
    assert held == {(0, 2, 4)}
    assert_same_as_one_process(greedy(mxfp4)[0], split, "gpt_oss mxfp4 ep2")


@pytest.mark.parametrize("fixture,experts", [("qwen3_moe-q8_0", 8), ("qwen2_moe-q8_0", 4)])
def test_gguf_experts_split_across_ranks(fixture, experts):
    kwargs = dict(weight_file=os.path.join(DATA, f"{fixture}.gguf"))
    split, held = greedy(DATA, 2, enable_expert_parallel=True, **kwargs)
    assert held == {(0, experts // 2, experts)}
    assert_same_as_one_process(greedy(DATA, **kwargs)[0], split, fixture)


def test_with_pipeline_parallel(cases):
    """2 stages of 2 expert-parallel ranks (4 processes)."""
    split, held = greedy(cases.dir("mixtral"), 2, 2, enable_expert_parallel=True)
    assert held == {(0, 2, 4)}
    assert_same_as_one_process(greedy(cases.dir("mixtral"))[0], split, "mixtral pp2 ep2")


@pytest.mark.parametrize("isq", ["q8_0", "marlin"])
def test_isq_quantizes_whole_experts(tmp_path_factory, isq):
    """--isq q8_0 and int4 (Marlin's layout) on each rank's whole experts, as one process
    quantizes them (exact activations: see test_tensor_parallel.test_isq_quantizes_each_share)."""
    from checkpoints import tiny256_checkpoint
    model = tiny256_checkpoint(str(tmp_path_factory.mktemp("ep_isq") / "m"), arch="mixtral",
                               dtype="float32")
    how = dict(isq=isq, kernels="act_split=on")
    split, held = greedy(model, 2, enable_expert_parallel=True, **how)
    assert held == {(0, 4, 8)}
    assert_same_as_one_process(greedy(model, **how)[0], split, f"isq {isq}")


# ---- each rank reads only its experts

def tensors_given_to_the_model(monkeypatch):
    """The names of the tensors the loader hands to the model's class, recorded."""
    import engine.loader.model_loader as model_loader
    seen, get_model_class = {}, model_loader.get_model_class

    def recording(arch):
        cls = get_model_class(arch)

        def build(config, weights, backend):
            seen.update({n: w.shape for n, w in weights.items()})
            return cls(config, weights, backend)
        return build
    monkeypatch.setattr(model_loader, "get_model_class", recording)
    return seen


def expert_numbers(names) -> set[int]:
    from engine.parallel.sharding import expert_of
    return {e for n in names if (e := expert_of(n)) is not None}


def test_a_rank_reads_only_its_experts_from_safetensors(cases, monkeypatch, caplog):
    import logging
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    from safetensors.numpy import load_file
    seen = tensors_given_to_the_model(monkeypatch)
    caplog.set_level(logging.INFO, logger="taper.parallel")
    model, _ = load_model(cases.dir("mixtral"), CpuBackend(num_threads=1), progress=False,
                          tensor_parallel=(1, 2, SingleProcess()), expert_parallel=True)
    assert ("expert parallel 2: rank 0 holds experts 0-1, rank 1 holds experts 2-3 (of 4); "
            "this rank (1) reads only its own") in caplog.text
    assert expert_numbers(seen) == {2, 3}
    stored = load_file(os.path.join(cases.dir("mixtral"), "model.safetensors"))
    for name, shape in seen.items():
        if ".experts." in name:              # whole, not a slice of the intermediate size
            assert shape == stored[name].shape, name
    blocks = moe_blocks(model)
    assert blocks and all((b.first_expert, b.num_held, b.num_experts) == (2, 2, 4)
                          for b in blocks)
    w1 = stored["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    np.testing.assert_array_equal(np.asarray(blocks[0].gate_up.experts[0])[:w1.shape[0]], w1)


def test_a_rank_reads_only_its_experts_from_a_gguf(monkeypatch):
    """The file stacks each layer's experts in one tensor per projection; the loader views each
    expert's rows of blocks, and the rank keeps its own views only."""
    from engine.loader.model_loader import load_gguf_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    seen = tensors_given_to_the_model(monkeypatch)
    model, _, _ = load_gguf_model(os.path.join(DATA, "qwen3_moe-q8_0.gguf"),
                                  CpuBackend(num_threads=1), progress=False,
                                  tensor_parallel=(1, 2, SingleProcess()), expert_parallel=True)
    assert expert_numbers(seen) == {4, 5, 6, 7}
    assert all((b.first_expert, b.num_held, b.num_experts) == (4, 4, 8)
               for b in moe_blocks(model))


def test_fp8_block_scales_go_with_their_experts(tmp_path):
    """An FP8 checkpoint's weight_scale_inv of an expert is whole on the expert's rank (not cut
    in scale blocks as a slice of the intermediate size would be) and absent elsewhere."""
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    tiny_checkpoint(str(tmp_path / "m"), arch="mixtral")
    config = ModelConfig.from_pretrained(str(tmp_path / "m"))
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    name = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    scales = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)     # (192 / 32, 96 / 32)
    shapes = {name: (192, 96), name + "_scale_inv": scales.shape}
    plans = [ShardPlan(config, r, 2, expert_parallel=True) for r in range(2)]
    assert plans[0].shard(name + "_scale_inv", scales, shapes) is None
    assert plans[1].shard(name + "_scale_inv", scales, shapes) is scales
    within = ShardPlan(config, 1, 2).shard(name + "_scale_inv", scales, shapes)
    np.testing.assert_array_equal(within, scales[3:])      # (tensor parallel alone: its rows)


def test_a_rank_holds_about_half_the_experts(tmp_path):
    """8 experts of 512 x 96 are nearly the whole checkpoint. The loader copies each expert's
    gate and up into one fused matrix (3.1 MB for all 8, float32; down stays a view of the
    memory-mapped file): loading rank 0 of 2 peaks near half of that (a rank reading every expert
    and dropping the others after would hold all of them at once)."""
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    tiny_checkpoint(str(tmp_path / "m"), arch="mixtral", num_local_experts=8,
                    intermediate_size=512, num_hidden_layers=1)
    gate_up = 8 * 2 * 512 * 96 * 4
    tracemalloc.start()
    try:
        load_model(str(tmp_path / "m"), CpuBackend(num_threads=1), progress=False,
                   tensor_parallel=(0, 2, SingleProcess()), expert_parallel=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert gate_up / 2 <= peak < 0.65 * gate_up, (
        f"peak {peak / 1e6:.2f} MB, all experts' gate_up {gate_up / 1e6:.2f} MB")


# ---- clear errors, the flag

def test_an_indivisible_expert_count_is_refused(tmp_path):
    from engine import LLM
    before = worker_pids()
    tiny_checkpoint(str(tmp_path / "m"), arch="mixtral", num_local_experts=3)
    with pytest.raises(ValueError, match=r"expert parallel 2: MixtralForCausalLM has 3 experts, "
                                         r"not divisible by 2"):
        LLM(str(tmp_path / "m"), tensor_parallel_size=2, enable_expert_parallel=True)
    assert not worker_pids() - before             # refused before any worker started


def test_server_flag_reaches_the_engine_config(tmp_path):
    from server.__main__ import build_parser, engine_config
    args = build_parser().parse_args(["--w", str(tmp_path), "--cpu", "--tp", "2",
                                      "--enable-expert-parallel"])
    config = engine_config(args)
    assert config.enable_expert_parallel and config.tensor_parallel_size == 2
    assert not engine_config(build_parser().parse_args(["--w", str(tmp_path), "--cpu"])
                             ).enable_expert_parallel

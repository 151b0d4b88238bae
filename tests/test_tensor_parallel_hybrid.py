"""Tensor parallel for the hybrid linear-attention families (issue 28: Qwen3-Next, Qwen3.5,
Qwen3.5-MoE) on the CPU backend, 2 MPI ranks: the gated DeltaNet's heads split across the ranks
with their conv and recurrent state (engine/parallel/linear_attention_shards.py), the gated
full attention's heads with their output gates, the MoE experts within the ranks or across them.

- Greedy tokens at tensor parallel 2 equal transformers' (hf_oracle's near-tie rule) and the
  single process's, whose logprobs they equal within float tolerance; Qwen3-Next under expert
  parallel too.
- GGUF (tests/data/gguf: a q8_0 Qwen3-Next, an f32 Qwen3.5) splits the same way and gives the
  single process's tokens.
- Qwen3.5-MoE's experts stacked (transformers 5's layout) split the same way, within or across.
- A later turn's prefix-cache hit restores the DeltaNet state snapshot on every rank (each rank
  its heads') and gives the single process's tokens.
- n-gram speculation: each rank keeps its verified state rows (copied with the next step).
- A rank holds its heads' state only: a state row's floats are half the whole model's.
- Key heads not divisible by the ranks: a clear error.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from checkpoints import edit_config, tiny_checkpoint
from engine.spec.costs import StepCost
from hf_oracle import assert_matches
from model_cases import Cases
from test_tensor_parallel import DATA, assert_same_as_one_process, greedy

pytestmark = pytest.mark.timeout(300)

CASES = {arch: (dict(arch=arch), None) for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe")}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("tp_hybrid")), CASES)


@pytest.mark.parametrize("name,expert_parallel", [("qwen3_next", False), ("qwen3_5", False),
                                                  ("qwen3_5_moe", False), ("qwen3_next", True)])
def test_greedy_tokens_match_hf_and_one_process(cases, name, expert_parallel):
    how = dict(enable_expert_parallel=True) if expert_parallel else {}
    split = greedy(cases.dir(name), 2, **how)
    label = f"{name} tp2{' ep' if expert_parallel else ''}"
    for i, (tokens, ref) in enumerate(zip(split[0], cases.ref(name))):
        assert_matches(tokens, ref, min_trusted=8, label=f"{label} prompt {i}")
    assert_same_as_one_process(greedy(cases.dir(name), 1), split, label)


@pytest.mark.parametrize("fixture", ["qwen3_next-q8_0", "qwen3_5-f32"])
def test_gguf_splits_the_same_way(fixture):
    """With exact activations (act_split=on): the ranks' partial sums add in another order, and
    a last-bit difference can round a later 8-bit activation the other way (test_tensor_parallel's
    isq test)."""
    kwargs = dict(weight_file=f"{DATA}/{fixture}.gguf", kernels="act_split=on")
    assert_same_as_one_process(greedy(DATA, 1, **kwargs), greedy(DATA, 2, **kwargs), fixture)


def stacked_experts_copy(src: str, dst: str) -> str:
    """src's checkpoint with each layer's experts stacked as transformers 5 holds them
    (mlp.experts.gate_up_proj (E, 2I, H), mlp.experts.down_proj (E, H, I))."""
    import glob
    import re
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = {}
    for f in glob.glob(f"{src}/*.safetensors"):
        weights.update(load_file(f))
    experts = {}
    for name in [n for n in weights if re.search(r"\.mlp\.experts\.\d+\.", n)]:
        base, e, proj = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name).groups()
        experts.setdefault(base, {}).setdefault(int(e), {})[proj] = weights.pop(name)
    for base, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        weights[f"{base}.gate_up_proj"] = np.stack(
            [np.concatenate([x["gate_proj"], x["up_proj"]]) for x in order])
        weights[f"{base}.down_proj"] = np.stack([x["down_proj"] for x in order])
    save_file(weights, f"{dst}/model.safetensors")
    return dst


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_stacked_experts_split(cases, tmp_path, expert_parallel):
    """Qwen3.5-MoE with its experts stacked: each rank's slice of every expert (or its experts
    whole) gives the per-expert checkpoint's tokens."""
    stacked = stacked_experts_copy(cases.dir("qwen3_5_moe"), str(tmp_path / "stacked"))
    how = dict(enable_expert_parallel=True) if expert_parallel else {}
    assert_same_as_one_process(greedy(cases.dir("qwen3_5_moe"), 1), greedy(stacked, 2, **how),
                               f"stacked experts{' ep' if expert_parallel else ''}")


def conversation(model: str, tp: int = 1, **kwargs):
    """Two turns, the second's prompt the first's with its answer and new tokens: (the turns'
    tokens, the second's cached tokens, the snapshot restores). kwargs: more EngineConfig (the
    pipeline-parallel tests')."""
    from engine import LLM, SamplingParams
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 512, 40).tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, tensor_parallel_size=tp, num_kv_blocks=64, **kwargs)
    try:
        first = list(llm.generate([prompt], params)[0].token_ids)
        second = llm.generate([prompt + first + rng.integers(3, 512, 9).tolist()], params)[0]
        return ([first, list(second.token_ids)], second.num_cached_tokens,
                llm.engine.block_pool.num_snapshot_restores)
    finally:
        llm.engine.shutdown()


def test_prefix_cache_hit_restores_each_ranks_state(cases):
    one, split = conversation(cases.dir("qwen3_next"), 1), conversation(cases.dir("qwen3_next"), 2)
    assert split[0] == one[0]
    assert split[1] == one[1] == 48        # the history's full blocks (63 tokens: 3 of 16)
    assert split[2] == one[2] == 1


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_a_rank_holds_its_heads_state(cases, name):
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    backend = CpuBackend(num_threads=1)
    whole, config = load_model(cases.dir(name), backend, progress=False)
    share, _ = load_model(cases.dir(name), backend, progress=False,
                          tensor_parallel=(1, 2, SingleProcess()))
    la = config.linear_attention
    assert share.config.linear_attention.state_floats() * 2 == la.state_floats()
    for a, b in zip(whole.layers, share.layers):
        if a.is_linear:
            (conv, recurrent) = a.mixer.state_shapes(3)
            (conv2, recurrent2) = b.mixer.state_shapes(3)
            assert conv2 == (3, la.conv_kernel - 1, la.conv_dim // 2)
            assert recurrent2 == (3, la.num_v_heads // 2, la.head_k_dim, la.head_v_dim)
            assert recurrent[1] == la.num_v_heads and conv[2] == la.conv_dim


def test_key_heads_not_divisible(tmp_path):
    from engine import LLM
    tiny_checkpoint(str(tmp_path / "m"), arch="qwen3_next")
    edit_config(str(tmp_path / "m"), lambda c: {**c, "linear_num_key_heads": 1})
    with pytest.raises(ValueError, match="has 1 linear-attention key heads, not divisible by 2"):
        LLM(str(tmp_path / "m"), tensor_parallel_size=2)


def state_slots(model: str, tp: int) -> int:
    from engine import LLM
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_mb=1)
    try:
        return llm.engine.block_pool.num_slots
    finally:
        llm.engine.shutdown()


def test_state_slots_cost_a_ranks_bytes(cases):
    """Under a 1 MB budget per rank, half of it for the states (a slot and its snapshot): a
    rank's state row costs half the whole model's, so twice the slots fit."""
    from engine.models.model_config import ModelConfig
    la = ModelConfig.from_pretrained(cases.dir("qwen3_next")).linear_attention
    row = la.state_floats() * 4
    assert state_slots(cases.dir("qwen3_next"), 1) == 2**19 // (2 * row)
    assert state_slots(cases.dir("qwen3_next"), 2) == 2**19 // row


def ngram_tokens(model: str, speculate: bool, tp: int = 1, **kwargs):
    """Greedy tokens of three prompts (one repeating a loop, so that n-gram drafts are found),
    with or without n-gram speculation; a speculating run's drafts must include rejected ones.
    kwargs: more EngineConfig (the pipeline-parallel tests')."""
    from engine import LLM, SamplingParams
    rng = np.random.default_rng(5)
    loop = rng.integers(3, 500, 7).tolist()
    prompts = [loop * 4, rng.integers(3, 500, 33).tolist(), rng.integers(3, 500, 17).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    how = dict(speculative_config=spec) if speculate else {}
    llm = LLM(model, tensor_parallel_size=tp, num_kv_blocks=64, **how, **kwargs)
    try:
        # drafts free (the cost model follows this machine's step times, which a busy machine
        # turns against speculation): acceptance alone decides how many rank 0 proposes, as
        # tests/test_spec_decode.py's free_drafts makes them
        with mock.patch.object(StepCost, "min_use", lambda self, rows: 0.0):
            tokens = [list(o.token_ids) for o in llm.generate(prompts, params)]
        if speculate:
            stats = llm.engine.speculator.stats
            assert stats.num_drafts > 2, stats
            assert stats.num_accepted_tokens < stats.num_draft_tokens, stats
        return tokens
    finally:
        llm.engine.shutdown()


def test_ngram_speculation_keeps_each_ranks_verified_state(cases):
    """A verify step's accepted state goes back to each sequence's slot on every rank (the
    other ranks copy theirs with the next step): the tokens without speculation, with drafts
    rejected."""
    model = cases.dir("qwen3_next")
    assert ngram_tokens(model, True, 2) == ngram_tokens(model, False)

"""Pipeline parallel for the hybrid linear-attention families (issue 28: Qwen3-Next, Qwen3.5,
Qwen3.5-MoE) on the CPU backend: the layers split into 2 stages on MPI processes, each stage
holding its full-attention layers' KV caches and its linear layers' DeltaNet state rows, indexed
by the slots of rank 0's plan (engine/parallel/pipeline.py, engine/models/qwen3_next.py).

The tiny checkpoints' layer types put a stage without any KV-cache layer in each split
(Qwen3-Next: linear, linear | linear, full; Qwen3.5: linear, full | linear, linear), and steps
are cut into micro-batches (pipeline_micro_batches), each carrying its sequences' state plan.

- Greedy tokens at pipeline parallel 2 equal transformers' (hf_oracle's near-tie rule) and the
  single process's, whose logprobs they equal within float tolerance, with chunked prefill;
  Qwen3.5 also in its multimodal checkpoint layout (model.language_model.*); 2 x 2 (tensor
  parallel within each stage, 4 processes) on Qwen3-Next.
- GGUF (tests/data/gguf: a q8_0 Qwen3-Next, an f32 Qwen3.5) gives the single process's tokens.
- A later turn's prefix-cache hit restores the DeltaNet state snapshot on every stage.
- n-gram speculation: every stage keeps its verified state rows (copied with the next step).
- A stage holds only its layers, their layer types and their caches; the MTP head's tensors
  (mtp.*) go with the last stage alone.
"""
from __future__ import annotations

import os

import pytest

from hf_oracle import assert_matches
from model_cases import Cases
from test_pipeline_parallel import DATA, greedy
from test_tensor_parallel import assert_same_as_one_process, check_split
from test_tensor_parallel_hybrid import CASES, conversation, ngram_tokens

pytestmark = pytest.mark.timeout(300)

# micro-batches in every split run: each carries its own sequences' state rows
MICRO = dict(pipeline_micro_batches=4)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("pp_hybrid")), CASES)


def multimodal_layout_copy(src: str, dst: str) -> str:
    """src's checkpoint (Qwen3.5's text model) under the names Qwen3.5's released checkpoints
    use: model.language_model.layers.*, model.language_model.embed_tokens / norm."""
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({("model.language_model." + n[len("model."):] if n.startswith("model.") else n): w
               for n, w in weights.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def long_memory_copy(src: str, dst: str) -> str:
    """src's checkpoint with every DeltaNet head's decay rate near 0 (A_log -6: the state keeps
    ~99.5% a token), as a trained model's long-memory heads: the tiny checkpoints' random rates
    forget a state within some tens of tokens, so a later turn's tokens would hardly show a
    wrong snapshot or verify row."""
    import shutil
    import numpy as np
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in weights if n.endswith(".linear_attn.A_log")]:
        weights[name] = np.full_like(weights[name], -6.0)
    save_file(weights, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def long_memory(cases, tmp_path_factory):
    return long_memory_copy(cases.dir("qwen3_next"), str(tmp_path_factory.mktemp("long") / "qwen3_next"))


@pytest.mark.parametrize("name,tp", [("qwen3_next", 1), ("qwen3_5", 1), ("qwen3_5_moe", 1),
                                     ("qwen3_next", 2)])
def test_greedy_tokens_match_hf_and_one_process(cases, name, tp):
    check_split(cases, name, f"pp2 tp{tp}", tp=tp, pipeline_parallel_size=2, **MICRO)


def test_multimodal_layout_stages(cases, tmp_path):
    """Qwen3.5's released layout: each stage reads its layers under model.language_model.*."""
    model = multimodal_layout_copy(cases.dir("qwen3_5"), str(tmp_path / "mm"))
    split = greedy(model, 2, **MICRO)
    for i, (tokens, ref) in enumerate(zip(split[0], cases.ref("qwen3_5"))):
        assert_matches(tokens, ref, min_trusted=8, label=f"multimodal layout prompt {i}")
    assert_same_as_one_process(greedy(cases.dir("qwen3_5")), split, "multimodal layout")


@pytest.mark.parametrize("fixture", ["qwen3_next-q8_0", "qwen3_5-f32"])
def test_gguf_stages(fixture):
    kwargs = dict(weight_file=f"{DATA}/{fixture}.gguf")
    assert_same_as_one_process(greedy(DATA, **kwargs), greedy(DATA, 2, **kwargs, **MICRO),
                               fixture)


def test_prefix_cache_hit_restores_each_stages_state(long_memory):
    one = conversation(long_memory)
    split = conversation(long_memory, pipeline_parallel_size=2)
    assert split[0] == one[0]
    assert split[1] == one[1] == 48        # the history's full blocks (63 tokens: 3 of 16)
    assert split[2] == one[2] == 1


def test_ngram_speculation_keeps_each_stages_verified_state(cases):
    """A verify step's accepted state goes back to each sequence's slot on every stage (the
    other stages copy theirs with the next step), its verify rows cut with the micro-batches:
    the tokens without speculation, with drafts rejected."""
    model = cases.dir("qwen3_next")
    assert (ngram_tokens(model, True, pipeline_parallel_size=2, **MICRO)
            == ngram_tokens(model, False))


def test_a_stage_holds_its_layers_state_and_the_mtp_head_last(cases, tmp_path):
    """Each stage's model: its layers' types, KV caches for its full-attention layers only,
    state rows for its linear ones; the mtp.* tensors on the last stage only."""
    import shutil
    import numpy as np
    from safetensors.numpy import load_file, save_file
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    model = str(tmp_path / "mtp")
    shutil.copytree(cases.dir("qwen3_next"), model)
    weights = load_file(os.path.join(model, "model.safetensors"))
    weights["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    weights["mtp.norm.weight"] = np.zeros(64, np.float32)
    save_file(weights, os.path.join(model, "model.safetensors"))
    backend = CpuBackend(num_threads=1)
    types = ["linear_attention"] * 3 + ["full_attention"]
    for stage, mine in ((0, types[:2]), (1, types[2:])):
        share, config = load_model(model, backend, progress=False,
                                   pipeline=(stage, 2, 0, SingleProcess()))
        assert config.linear_attention.layer_types == types
        assert share.config.linear_attention.layer_types == mine
        assert [layer.is_linear for layer in share.layers] == [t != "full_attention"
                                                              for t in mine]
        caches = share.allocate_caches(8, 16, np.float32, 5)
        la = config.linear_attention
        for kind, (a, b) in zip(mine, caches):
            if kind == "linear_attention":
                assert a.shape == (5, la.conv_kernel - 1, la.conv_dim)
                assert b.shape == (5, la.num_v_heads, la.head_k_dim, la.head_v_dim)
            else:
                assert a.shape == b.shape == share.kv_cache_shape(8, 16)
        assert sorted(share.mtp_weights) == ([] if stage == 0 else
                                             ["mtp.fc.weight", "mtp.norm.weight"])
        assert (share.embed_tokens is None) == (stage == 1)
        assert (share.lm_head is None) == (stage == 0)

"""Gemma 4 across processes on the CPU backend (issue 28): the E2B/E4B shapes (per-layer input
embeddings, KV-shared layers) under tensor parallel, the MoE under expert parallel, every shape
under pipeline parallel.

Greedy tokens equal transformers' (up to a near-tie, as the family tests) and the single-process
engine's, whose logprobs they equal within float tolerance, with chunked prefill so that a step
holds several sequences' chunks (and, but for a pipeline stage, the KV-shared layers run on the
rows read alone):

- tensor parallel 2: E2B's shape (one KV head, replicated on both ranks; double-wide MLPs on the
  shared layers) and E4B's (two sliding KV heads, one per rank: each rank's shared layers read
  its own head of their source's cache), the per-layer embedding table vocab-parallel and its
  projection column-parallel (engine/models/gemma4_per_layer.py).
- expert parallel 2: the 26B-A4B shape's stacked GeGLU experts held whole, rank 0 experts 0-1
  and rank 1 experts 2-3 of 4 (its dense MLP beside them split within the ranks).
- pipeline parallel 2: dense (per-layer head sizes, KV heads and layer types sliced to the
  stage), the MoE, E2B's and E4B's shapes, whose KV-shared layers sit on the stage of the layers
  whose caches they read (stage 0 holds layer 0 alone) and whose per-layer inputs each stage
  computes from its columns of the tables (engine/parallel/stages_gemma4.py); E4B's with tensor
  parallel within each stage too (4 processes), the MoE with expert parallel within each stage;
  Gemma 4 as released (model.language_model.* beside a vision tower, tied embeddings).
- The stage cut of 35 layers (four sliding to a full one, E2B's), the last 20 KV-shared reading
  layers 13 and 14, and of 42, the last 18 reading 23 and 19; a cut that cannot keep them
  together refused.
"""
from __future__ import annotations

import pytest

from model_cases import Cases
import test_tensor_parallel as tensor_parallel
from test_tensor_parallel import assert_same_as_one_process, check_split, greedy, \
    wait_for_workers_gone, worker_pids

pytestmark = pytest.mark.timeout(300)

CASES = {"gemma4": tensor_parallel.CASES["gemma4"],
         "gemma4_e2b": (dict(arch="gemma4_e2b"), None),
         "gemma4_e4b": (dict(arch="gemma4_e4b"), None),
         "gemma4_moe": tensor_parallel.CASES["gemma4_moe"]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("gemma4_parallel")), CASES)


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_e4b"])
def test_per_layer_inputs_and_kv_sharing_under_tensor_parallel(cases, name):
    check_split(cases, name, "tp2", tp=2)


def held_experts(model):
    """(first expert, held, of all) of each MoE layer of rank 0's model."""
    return {(layer.mlp.experts.first_expert, layer.mlp.experts.num_held,
             layer.mlp.experts.num_experts) for layer in model.layers}


def test_moe_under_expert_parallel(cases):
    seen = check_split(cases, "gemma4_moe", "ep2", tp=2, enable_expert_parallel=True,
                       inspect=held_experts)
    assert seen == {(0, 2, 4)}


def stage_layers_held(model):
    return len(model.layers)


@pytest.mark.parametrize("name,tp,ep,layers", [
    ("gemma4", 1, False, 1), ("gemma4_moe", 1, False, 1), ("gemma4_moe", 2, True, 1),
    ("gemma4_e2b", 1, False, 1), ("gemma4_e4b", 1, False, 1), ("gemma4_e4b", 2, False, 1)])
def test_pipeline_parallel(cases, name, tp, ep, layers):
    """layers: the layers stage 0 holds (E2B/E4B: layer 0 alone, the others reading or writing
    the shared caches on stage 1). tp 2: tensor parallel within each stage (4 processes); ep:
    with expert parallel."""
    seen = check_split(cases, name, f"pp2 tp{tp} ep {ep}", tp=tp, pipeline_parallel_size=2,
                       enable_expert_parallel=ep, inspect=stage_layers_held)
    assert seen == layers


def released_config(layers: int, shared: int) -> dict:
    """A text config of E2B's kind: four sliding layers to a full one, the last one full."""
    types = (["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5) + [
        "sliding_attention"] * (layers % 5)
    types[-1] = "full_attention"
    return dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=64,
                intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, global_head_dim=32, vocab_size=512,
                hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                num_kv_shared_layers=shared, layer_types=types, sliding_window=16)


@pytest.mark.parametrize("layers,shared,want", [(35, 20, [(0, 13), (13, 35)]),
                                                (42, 18, [(0, 19), (19, 42)])])
def test_stage_cut_keeps_kv_sharing_on_one_stage(layers, shared, want):
    from engine.models.model_config import ModelConfig
    from engine.parallel.pipeline import model_stage_layers
    config = ModelConfig.from_dict(released_config(layers, shared))
    s = config.family
    sources = {s.kv_sources[i] for i, x in enumerate(s.kv_shared) if x}
    assert model_stage_layers(config, 2) == want
    assert min(sources) == want[1][0]       # the first layer whose cache is shared starts it


def test_stage_cut_that_cannot_keep_kv_sharing_together_is_refused():
    from engine.models.model_config import ModelConfig
    from engine.parallel.pipeline import model_stage_layers
    cfg = released_config(6, 4)     # layers 2-5 read the caches of layers 0 (full) and 1
    cfg["layer_types"] = ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]
    config = ModelConfig.from_dict(cfg)
    with pytest.raises(ValueError, match=r"pipeline parallel 2: Gemma4ForCausalLM's layers 0-5 "
                                         r"must sit on one stage"):
        model_stage_layers(config, 2)


def test_released_layout_under_pipeline_parallel(tmp_path):
    """Gemma4ForConditionalGeneration's tensors under model.language_model. are renumbered into
    the stages as the text model's (a stage holding every layer, misnumbered, would differ)."""
    from test_models_quirk_families import released_gemma4
    released_gemma4(tmp_path, "gemma4_e4b")
    before = worker_pids()
    split = greedy(str(tmp_path), pipeline_parallel_size=2)
    assert_same_as_one_process(greedy(str(tmp_path)), split, "released layout pp2")
    wait_for_workers_gone(before)

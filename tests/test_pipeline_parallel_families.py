"""Pipeline parallel (issue 28) for the families whose layers differ from Llama's beyond config
flags (engine/parallel/pipeline.py, engine/parallel/stage_families.py): greedy tokens with
pipeline_parallel_size 2 equal transformers' (up to a near-tie, as the family tests) and the
single process's, whose logprobs they equal within float tolerance.

- StableLM (LayerNorm with bias, a quarter of each head rotated, q/k/v bias; sequential
  residual) and StableLM-2 12B's shape (per-head q/k LayerNorms, parallel residual), Phi-2
  (parallel attention + MLP, dense biases, its own final_layernorm and a biased lm_head): the
  residual stream crossing the boundary is LayerNorm's, and the final norm's bias and the head's
  bias are the last stage's alone.
- GPT-OSS (sinks, a sliding layer then a full one: one a stage, stacked experts with biases;
  float and MXFP4), MiniMax-M2 (q/k RMSNorm over all heads, a sigmoid router).
- Llama 4 with 6 layers: every 4th NoPE (layer 3, the second stage's first), chunked attention
  on the RoPE layers, MoE on the odd layers; the stage holding layers 3-5 must read those
  layers' entries (NoPE, chunked, MoE of layer 3 first), not entries 0-2. Llama 4 as released
  (its text model's tensors under language_model.): each stage reads its layers there too.
- Phi-2 at 2 stages x 2 tensor-parallel ranks; GPT-OSS and Llama 4 at 2 stages x 2
  expert-parallel ranks.
- A stage reads its own ends: Phi-2's final_layernorm and lm_head bias only on the last stage.
"""
from __future__ import annotations

import pytest

from hf_oracle import assert_matches
from model_cases import Cases
import test_expert_parallel as expert_parallel
from test_pipeline_parallel import greedy
import test_tensor_parallel as tensor_parallel
from test_tensor_parallel import assert_same_as_one_process, check_split

pytestmark = pytest.mark.timeout(300)

CASES = {"stablelm": (dict(arch="stablelm"), None),
         "stablelm_qk": tensor_parallel.CASES["stablelm_qk"],
         "phi": tensor_parallel.CASES["phi"],
         "gpt_oss": expert_parallel.CASES["gpt_oss"],
         "minimax_m2": expert_parallel.CASES["minimax_m2"],
         # transformers' defaults for 6 layers: no_rope_layers [1, 1, 1, 0, 1, 1] (every 4th
         # NoPE), the RoPE layers chunked, MoE on layers 1, 3, 5 (interleave step 2)
         "llama4_6": (dict(arch="llama4", num_hidden_layers=6, no_rope_layers=None), None)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("pp_families")), CASES)


@pytest.mark.parametrize("name,pp,tp", [("stablelm", 2, 1), ("stablelm_qk", 2, 1),
                                        ("phi", 2, 1), ("gpt_oss", 2, 1),
                                        ("minimax_m2", 2, 1), ("llama4_6", 2, 1),
                                        ("phi", 2, 2)])
def test_greedy_tokens_match_hf_and_one_process(cases, name, pp, tp):
    check_split(cases, name, f"pp{pp} tp{tp}", tp=tp, pipeline_parallel_size=pp)


def test_llama4_stage_reads_its_layers_settings(cases):
    """The second of 2 stages of the 6-layer Llama 4 holds layers 3-5: its first layer is the
    NoPE, full-attention, MoE layer 3 (numbered 0 in the stage)."""
    from engine.models.model_config import ModelConfig
    from engine.parallel.pipeline import PipelineStage
    config = ModelConfig.from_pretrained(cases.dir("llama4_6"))
    assert config.family.rope_layers == (True, True, True, False, True, True)
    local = PipelineStage.of(config, 1, 2, 0, None).local_config(config)
    assert local.family.rope_layers == (False, True, True)
    assert local.family.chunked_layers == (False, True, True)
    assert local.moe.sparse_layers == [True, False, True]


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_6"])
def test_expert_parallel_stages(cases, name):
    """2 stages of 2 expert-parallel ranks (4 processes): each rank holds 2 of the 4 stacked
    experts of its stage's MoE layers (GPT-OSS: every layer; Llama 4: the odd ones)."""
    split, held = expert_parallel.greedy(cases.dir(name), 2, 2, enable_expert_parallel=True)
    assert held == {(0, 2, 4)}
    assert_same_as_one_process(greedy(cases.dir(name)), split, f"{name} pp2 ep2")


def test_gpt_oss_mxfp4_stages(cases, tmp_path):
    """The released checkpoints' layout: each stage dequantizes its own layer's MXFP4 expert
    blocks (the file's reference against transformers: tests/test_gpt_oss_mxfp4.py)."""
    from test_gpt_oss_mxfp4 import write_mxfp4
    mxfp4 = write_mxfp4(cases.dir("gpt_oss"), str(tmp_path / "mxfp4"))
    assert_same_as_one_process(greedy(mxfp4), greedy(mxfp4, 2), "gpt_oss mxfp4 pp2")


def test_a_stage_reads_only_its_own_ends(cases, caplog):
    """Phi-2's final_layernorm (weight and bias) and lm_head bias are the last stage's: the
    first stage is handed none of them (it would warn of them unused), the last all."""
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    backend = CpuBackend(num_threads=1)
    models = []
    with caplog.at_level("WARNING", logger="taper.models"):
        for stage in (0, 1):
            models.append(load_model(cases.dir("phi"), backend, progress=False,
                                     pipeline=(stage, 2, 0, SingleProcess()))[0])
    assert "unused" not in caplog.text
    assert models[0].norm is None and not hasattr(models[0], "lm_head_bias")
    assert models[1].norm is not None and models[1].lm_head_bias is not None


def test_llama4_multimodal_layout_stages(tmp_path):
    """Llama 4 as released (Llama4ForConditionalGeneration: the text model's tensors under
    language_model., beside a vision model): each stage reads its layers under that prefix, the
    tokens transformers' and the single process's."""
    from hf_oracle import hf_greedy
    from model_cases import GEN, prompts_for
    from test_models_quirk_families import released_llama4
    model = released_llama4(tmp_path)
    split = greedy(str(tmp_path), 2)
    for i, (tokens, prompt) in enumerate(zip(split[0], prompts_for())):
        assert_matches(tokens, hf_greedy(model, prompt, GEN), min_trusted=8,
                       label=f"Llama4ForConditionalGeneration pp2 prompt {i}")
    assert_same_as_one_process(greedy(str(tmp_path)), split, "llama4 multimodal pp2")

"""Mixtral, Qwen2-MoE and Qwen3-MoE: greedy tokens equal transformers' on tiny checkpoints
(tests/checkpoints.py), through the whole engine; each MoE quirk first shown to change
transformers' own tokens (DESIGN.md section 6, rung 2)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf
from model_cases import GEN, prompts_for

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {a: tiny_checkpoint(os.path.join(root, a), arch=a) for a in ARCHS}


def hf_tokens(model):
    return [hf_greedy(model, p, GEN) for p in prompts_for()]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(dirs, arch):
    from engine import LLM, SamplingParams
    refs = hf_tokens(load_hf(dirs[arch]))
    llm = LLM(dirs[arch], kv_cache_memory_mb=16)
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0.0, max_tokens=GEN,
                                                       ignore_eos=True))
    for out, ref in zip(outs, refs):
        assert_matches(out.token_ids, ref, label=arch)


def test_moe_config_is_read_as_transformers_reads_it(dirs):
    from engine.models.model_config import ModelConfig
    q2 = ModelConfig.from_pretrained(dirs["qwen2_moe"]).moe
    assert (q2.num_experts, q2.top_k, q2.intermediate_size, q2.normalize,
            q2.shared_intermediate_size, q2.sparse_layers) == (4, 2, 64, False, 128, [True, True])
    q3 = ModelConfig.from_pretrained(dirs["qwen3_moe"]).moe
    assert (q3.normalize, q3.shared_intermediate_size, q3.sparse_layers) == (True, 0, [False, True])
    mx = ModelConfig.from_pretrained(dirs["mixtral"]).moe
    assert (mx.num_experts, mx.top_k, mx.normalize, mx.intermediate_size) == (4, 2, True, 192)


def _with_config(d, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(d)
    for k, v in changes.items():
        setattr(config, k, v)
    return AutoModelForCausalLM.from_pretrained(d, config=config, dtype=torch.float32).eval()


def _shared_gate_closed(d):
    model = load_hf(d)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert_gate.weight.fill_(-1e4)
    return model


@pytest.mark.parametrize("arch, switch_off", [
    ("qwen3_moe", lambda d: _with_config(d, norm_topk_prob=False)),
    ("qwen2_moe", lambda d: _with_config(d, norm_topk_prob=True)),
    ("qwen2_moe", _shared_gate_closed),
    ("mixtral", lambda d: _with_config(d, num_experts_per_tok=1)),
], ids=["norm_topk_prob", "no_renormalisation", "shared_expert", "top_k"])
def test_each_quirk_changes_transformers_tokens(dirs, arch, switch_off):
    on = [r[0] for r in hf_tokens(load_hf(dirs[arch]))]
    off = [r[0] for r in hf_tokens(switch_off(dirs[arch]))]
    assert on != off


def test_a_dense_layer_among_sparse_ones(dirs):
    """mlp_only_layers: Qwen3-MoE's layer 0 has a dense MLP; the checkpoint holds mlp.gate_proj
    there and experts only in layer 1."""
    from safetensors import safe_open
    with safe_open(os.path.join(dirs["qwen3_moe"], "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)
    with open(os.path.join(dirs["qwen3_moe"], "config.json")) as f:
        assert json.load(f)["mlp_only_layers"] == [0]

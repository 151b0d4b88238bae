"""Model level (DESIGN.md section 6, rung 2): greedy tokens equal transformers' on tiny checkpoints.

Each case first shows that transformers' own tokens change when its feature is switched off, so the
comparison can fail. Prompts (48 and 33 tokens) are longer than the Mistral window (16) and than
the RoPE original context (32). Comparison stops at the reference's first near-tie (top-two
log-probs within 1e-4). Taper runs twice: through `LLM.generate` (the whole engine, with its default
kernels and with the batch-invariant ones of `--batch-invariant`) and through a
bare model harness here (prefill logits against transformers' too), so a model bug and an engine
bug point at different tests.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints import to_legacy_rope
from hf_oracle import load_hf
from model_cases import (PROMPT_LENS, Cases, assert_llm_greedy_matches,
                         assert_model_forward_matches, hf_tokens, hf_with_config, qk_norm_off,
                         qkv_bias_off)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}

# name -> (tiny_checkpoint kwargs, or the case it is the legacy rope form of)
CASES = {
    "llama_gqa_tied": (dict(arch="llama"), None),
    "qwen2_qkv_bias": (dict(arch="qwen2"), None),
    "qwen3_qk_norm": (dict(arch="qwen3"), None),
    "mistral_sliding_window": (dict(arch="mistral"), None),
    "llama3_rope": (dict(arch="llama", rope_parameters=LLAMA3), None),
    "llama3_rope_legacy": (None, ("llama3_rope", to_legacy_rope)),
    "yarn_rope": (dict(arch="llama", rope_parameters=YARN, max_position_embeddings=128), None),
    "yarn_rope_legacy": (None, ("yarn_rope", to_legacy_rope)),
    "llama_bf16": (dict(arch="llama", dtype="bfloat16", seed=1), None),
    "qwen2_bf16": (dict(arch="qwen2", dtype="bfloat16", seed=1), None),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("models")), CASES)


# ---- the features matter: transformers' tokens change when each is switched off

def _rope_off(cases, name):
    return hf_with_config(cases, name, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _window_off(cases, name):
    d = cases.dir(name)
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(d)
    assert config.sliding_window == 16 < min(PROMPT_LENS)
    config.sliding_window = None
    return AutoModelForCausalLM.from_pretrained(d, config=config, dtype=torch.float32).eval()


def _gqa_regrouped(cases, name):
    """Query head h reads KV head h % Hkv instead of h // group: permute the query heads (q_proj
    rows and o_proj columns together), which changes only the q -> KV head mapping."""
    model = load_hf(cases.dir(name))
    c = model.config
    D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    assert Hkv < Hq
    group = Hq // Hkv
    order = [g * group + j for j in range(group) for g in range(Hkv)]  # new slot -> old head
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            q = att.q_proj.weight.view(Hq, D, -1)[order].reshape(Hq * D, -1).clone()
            o = att.o_proj.weight.view(-1, Hq, D)[:, order].reshape(-1, Hq * D).clone()
            att.q_proj.weight.copy_(q)
            att.o_proj.weight.copy_(o)
    return model


def _untied(cases, name):
    """The LM head gets weights of its own instead of sharing the embedding's."""
    model = load_hf(cases.dir(name))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(1234)  # not the embedding's seed
    own = torch.randn(model.lm_head.weight.shape, generator=generator) * 0.15
    model.lm_head.weight = torch.nn.Parameter(own)
    return model


# feature -> (the case that has it, transformers' model with the feature switched off)
FEATURE_OFF = {
    "gqa": ("llama_gqa_tied", _gqa_regrouped),
    "tied_embeddings": ("llama_gqa_tied", _untied),
    "qkv_bias": ("qwen2_qkv_bias", qkv_bias_off),
    "qk_norm": ("qwen3_qk_norm", qk_norm_off),
    "sliding_window": ("mistral_sliding_window", _window_off),
    "llama3_rope": ("llama3_rope", _rope_off),
    "yarn_rope": ("yarn_rope", _rope_off),
}


@pytest.mark.parametrize("feature", sorted(FEATURE_OFF))
def test_feature_changes_hf_tokens(cases, feature):
    name, switch_off = FEATURE_OFF[feature]
    ref = [r[0] for r in cases.ref(name)]
    off = hf_tokens(switch_off(cases, name))
    for a, b in zip(ref, off):
        assert a != b, f"{feature}: switching it off does not change transformers' tokens"


def test_tied_checkpoint_has_no_lm_head(cases):
    from engine.loader.safetensors import load_safetensors
    weights = load_safetensors(cases.dir("llama_gqa_tied"), progress=False)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape[0] == 2 * 24  # 2 KV heads


@pytest.mark.parametrize("name", ["llama3_rope", "yarn_rope"])
def test_legacy_rope_form_reads_the_same_in_hf(cases, name):
    from transformers import AutoConfig
    with open(os.path.join(cases.dir(name), "config.json")) as f:
        assert "rope_parameters" in json.load(f)  # what transformers 5 writes
    with open(os.path.join(cases.dir(name + "_legacy"), "config.json")) as f:
        legacy = json.load(f)
    assert "rope_parameters" not in legacy and legacy["rope_scaling"]["type"] in ("llama3", "yarn")
    nested = AutoConfig.from_pretrained(cases.dir(name)).rope_parameters
    parsed = AutoConfig.from_pretrained(cases.dir(name + "_legacy")).rope_parameters
    assert {k: v for k, v in parsed.items() if k != "type"} == nested
    assert [r[0] for r in cases.ref(name + "_legacy")] == [r[0] for r in cases.ref(name)]


# ---- Taper through the whole engine

@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("name", list(CASES))
def test_llm_greedy_matches_hf(cases, name, batch_invariant):
    # dtype auto: bf16 cases stay bf16; batch_invariant: the kernels of --batch-invariant
    assert_llm_greedy_matches(cases, name, batch_invariant=batch_invariant)


def test_bf16_checkpoint_as_f32_matches_hf(cases):
    assert_llm_greedy_matches(cases, "llama_bf16", dtype="f32")


# ---- Taper's model alone (model_cases.harness_greedy)

@pytest.fixture(scope="module")
def backend():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2_qkv_bias", "qwen3_qk_norm",
                                  "mistral_sliding_window", "llama3_rope", "yarn_rope_legacy",
                                  "qwen2_bf16"])
def test_model_forward_matches_hf(cases, backend, name):
    chunk = {"mistral_sliding_window": 20, "qwen3_qk_norm": 7}.get(name)  # chunked prefill
    assert_model_forward_matches(cases, backend, name, chunk)

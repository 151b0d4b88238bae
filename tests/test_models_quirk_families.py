"""Families that are a quirk file each (issue 29 item 4): Phi-2 (PhiForCausalLM), GLM-4.5/4.6
(Glm4MoeForCausalLM) give transformers' greedy tokens on tiny checkpoints written by
transformers itself
(tests/checkpoints.py), through the whole engine with chunked prefill and a prefix-cache hit,
and through the model alone (tests/model_cases.py's paged harness) with prompt chunks beside
the other prompt's decodes (prefill logits too).

Each quirk first shows that transformers' own output changes when the quirk is switched off
(tokens, or the prefill logits far beyond the harness test's tolerance where a tiny model's
tokens do not move), so the comparisons can fail (DESIGN.md section 6, rung 2).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_oracle import assert_matches, hf_greedy, load_hf
from model_cases import (GEN, Cases, assert_model_forward_matches, hf_tokens, hf_with_config,
                         hf_with_rope_parameters, prompts_for, qk_norm_off, qkv_bias_off)

pytestmark = pytest.mark.timeout(300)

# name -> (tiny_checkpoint kwargs, None)
CASES = {
    "phi": (dict(arch="phi", seed=4), None),     # seed 4: continuations that vary
    "glm4_moe": (dict(arch="glm4_moe"), None),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("quirk_families")), CASES)


@pytest.fixture(scope="module")
def backend():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


def _prefill_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].numpy()


def assert_logits_move(cases, name, model):
    """transformers' prefill logits with a quirk switched off leave the harness test's
    tolerance far behind."""
    for prompt, r in zip(prompts_for(), cases.ref(name)):
        tol = 1e-4 * max(1.0, np.abs(r[2]).max())
        assert np.abs(_prefill_logits(model, prompt) - r[2]).max() > 100 * tol


# ---- the quirks matter: transformers' output changes when each is switched off

def _phi_bias_off(part):
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias") and part in n:
                    p.zero_()
        return model
    return switch_off


def _phi_sequential_residual(cases, name):
    """h += attn(norm(h)); h += mlp(norm(h)) with the one input norm, in place of Phi's
    h + attn(norm(h)) + mlp(norm(h))."""
    from transformers.models.phi import modeling_phi
    model = load_hf(cases.dir(name))

    def forward(self, hidden_states, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        attn, _ = self.self_attn(self.input_layernorm(hidden_states),
                                 position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **kwargs)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.input_layernorm(hidden_states))

    original = modeling_phi.PhiDecoderLayer.forward
    modeling_phi.PhiDecoderLayer.forward = forward
    model._restore = lambda: setattr(modeling_phi.PhiDecoderLayer, "forward", original)
    return model


def _full_rotary(cases, name):
    return hf_with_rope_parameters(cases, name, lambda p: {"partial_rotary_factor": 1.0})


def _glm4_moe_router(**changes):
    """GLM-4.5's routers with attributes changed (the config's values are copied into each
    router when it is built)."""
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        for layer in model.model.layers[1:]:
            for k, v in changes.items():
                setattr(layer.mlp.gate, k, v)
        return model
    return switch_off


def _glm4_moe_correction_bias_off(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    return model


class _Zero(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def _glm4_moe_shared_experts_off(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers[1:]:
        layer.mlp.shared_experts = _Zero()
    return model


# quirk -> (the case that has it, transformers' model with the quirk switched off)
QUIRK_OFF = {
    "phi_parallel_residual": ("phi", _phi_sequential_residual),
    "phi_partial_rotary": ("phi", _full_rotary),
    "phi_qkv_bias": ("phi", qkv_bias_off),
    "phi_layer_norm_bias": ("phi", _phi_bias_off("layernorm")),
    "glm4_moe_partial_rotary": ("glm4_moe", _full_rotary),
    "glm4_moe_qk_norm": ("glm4_moe", qk_norm_off),
    "glm4_moe_qkv_bias": ("glm4_moe", qkv_bias_off),
    "glm4_moe_correction_bias": ("glm4_moe", _glm4_moe_correction_bias_off),
    "glm4_moe_shared_experts": ("glm4_moe", _glm4_moe_shared_experts_off),
    "glm4_moe_group_limit": ("glm4_moe", _glm4_moe_router(topk_group=4)),
    "glm4_moe_routed_scaling": ("glm4_moe", _glm4_moe_router(routed_scaling_factor=1.0)),
    "glm4_moe_renormalised": ("glm4_moe", _glm4_moe_router(norm_topk_prob=False)),
}

# Quirks whose switch moves the logits but not every prompt's tokens (shown by the logits).
LOGIT_QUIRK_OFF = {
    "phi_dense_bias": ("phi", _phi_bias_off("self_attn.dense")),
    "phi_mlp_bias": ("phi", _phi_bias_off("mlp.fc")),
    "phi_lm_head_bias": ("phi", _phi_bias_off("lm_head")),
    "phi_gelu_new": ("phi", lambda c, n: hf_with_config(c, n, hidden_act="relu")),
}


@pytest.mark.parametrize("quirk", sorted(QUIRK_OFF))
def test_quirk_changes_hf_tokens(cases, quirk):
    name, switch_off = QUIRK_OFF[quirk]
    ref = [r[0] for r in cases.ref(name)]
    model = switch_off(cases, name)
    try:
        off = hf_tokens(model)
    finally:
        getattr(model, "_restore", lambda: None)()
    for a, b in zip(ref, off):
        assert a != b, f"{quirk}: switching it off does not change transformers' tokens"


@pytest.mark.parametrize("quirk", sorted(LOGIT_QUIRK_OFF))
def test_quirk_changes_hf_logits(cases, quirk):
    name, switch_off = LOGIT_QUIRK_OFF[quirk]
    model = switch_off(cases, name)
    try:
        assert_logits_move(cases, name, model)
    finally:
        getattr(model, "_restore", lambda: None)()


# ---- Taper through the whole engine, and the model alone

@pytest.mark.parametrize("name", list(CASES))
def test_engine_chunked_prefill_and_prefix_hit_match_hf(cases, name):
    """LLM.generate with prompt chunks of 16 (batches mixing chunks with decodes), then a prompt
    sharing the first 40 tokens of an earlier one, which hits the prefix cache."""
    from engine import LLM, SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    prompts = prompts_for()
    shared = prompts[0][:40] + np.random.default_rng(4).integers(3, 512, 12).tolist()
    refs = cases.ref(name) + [hf_greedy(load_hf(cases.dir(name)), shared, GEN)]
    llm = LLM(cases.dir(name), block_size=8, num_kv_blocks=48, prefill_chunk_size=16,
              max_num_batched_tokens=32)
    outs = llm.generate(prompts, greedy)
    again = llm.generate([shared], greedy)[0]
    for i, (out, ref) in enumerate(zip(outs + [again], refs)):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label=f"{name} prompt {i}")
    assert again.num_cached_tokens == 40


@pytest.mark.parametrize("name", list(CASES))
def test_model_forward_matches_hf(cases, backend, name):
    assert_model_forward_matches(cases, backend, name, chunk=9)


def test_phi_gelu_new_is_the_tanh_form(backend):
    """Phi's activation block against transformers' gelu_new to float32 rounding; the exact
    (erf) GELU is farther off than that, so this fails if the block used it."""
    from transformers.activations import ACT2FN

    from engine.models.phi import GeluTanh
    x = np.random.default_rng(0).normal(0, 2, (5, 64)).astype(np.float32)
    out = np.empty_like(x)
    GeluTanh(backend, 64)(x, out)
    new = ACT2FN["gelu_new"](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, new, rtol=0, atol=2e-6)
    assert np.abs(ACT2FN["gelu"](torch.from_numpy(x)).numpy() - new).max() > 1e-4


def test_phi_qk_layernorm_is_refused():
    from engine.models.model_config import ModelConfig
    with pytest.raises(ValueError, match="qk_layernorm"):
        ModelConfig.from_dict({"architectures": ["PhiForCausalLM"], "hidden_size": 96,
                               "num_attention_heads": 4, "num_hidden_layers": 2,
                               "intermediate_size": 192, "vocab_size": 512,
                               "qk_layernorm": True})

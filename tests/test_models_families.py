"""Model level for the families beyond Llama (DESIGN.md section 6, rung 2): Gemma-2, Gemma-3 (text),
Phi-3, GLM-4, StableLM and Yi give transformers' greedy tokens on tiny checkpoints written by transformers
itself.

Each quirk first shows that transformers' own output changes when the quirk is switched off, so the
comparison can fail: tokens for most quirks, the logits for the final soft-cap (tanh is monotonic,
so it never changes a greedy token). Prompts (48 and 33 tokens) are longer than the sliding windows
(16) and than Phi-3's original context (32), so the windows and LongRoPE's long factors are
exercised. Taper runs through `LLM.generate`, through the bare model harness of
model_cases.py (prefill logits against transformers' too, with chunked prefill), and, once
per family, through a live `python -m server`.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf
from model_cases import (GEN, Cases, assert_llm_greedy_matches, assert_model_forward_matches,
                         harness_greedy, hf_tokens, hf_with_config, hf_with_rope_parameters,
                         prompts_for, qk_norm_off, qkv_bias_off)

SHORT = [1.0 + 0.05 * i for i in range(12)]       # LongRoPE factors for head_dim 24 (12 pairs)
LONG = [1.0 + 0.6 * i for i in range(12)]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
            "rope_theta": 10000.0}


def gemma3_legacy(config: dict) -> dict:
    """Gemma-3's older config.json keys: rope_theta (global), rope_local_base_freq, rope_scaling
    for the global layers, sliding_window_pattern instead of layer_types."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["full_attention"]["rope_theta"]
    config["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    config["rope_scaling"] = {"rope_type": "linear", "factor": params["full_attention"]["factor"]}
    config.pop("layer_types")
    config.pop("_sliding_window_pattern", None)
    config["sliding_window_pattern"] = 2
    return config


def phi3_legacy(config: dict, rope_type: str = "longrope") -> dict:
    """Phi-3's released config.json: rope_scaling {type, short_factor, long_factor}, top-level
    rope_theta and original_max_position_embeddings."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    config["rope_scaling"] = {"type": rope_type, "short_factor": params["short_factor"],
                              "long_factor": params["long_factor"]}
    return config


# name -> (tiny_checkpoint kwargs, a config.json rewrite making the legacy form of another case)
CASES = {
    "gemma2": (dict(arch="gemma2"), None),
    "gemma2_bf16": (dict(arch="gemma2", dtype="bfloat16", seed=2), None),
    "gemma3": (dict(arch="gemma3"), None),
    "gemma3_legacy": (None, ("gemma3", gemma3_legacy)),
    "phi3_longrope": (dict(arch="phi3", rope_parameters=LONGROPE), None),
    "phi3_longrope_legacy": (None, ("phi3_longrope", phi3_legacy)),
    "phi3_partial_rotary": (dict(arch="phi3", partial_rotary_factor=0.5), None),
    "glm4": (dict(arch="glm4"), None),
    "stablelm": (dict(arch="stablelm"), None),
    "stablelm_parallel": (dict(arch="stablelm", use_parallel_residual=True), None),
    # StableLM-2 12B's layout: a LayerNorm (own weight, no bias) on each q and k head
    "stablelm_qk": (dict(arch="stablelm", qk_layernorm=True, use_parallel_residual=True,
                         use_qkv_bias=False), None),
    # Yi's checkpoints say LlamaForCausalLM: its shape (GQA 4:1, rope_theta 5e6, untied head)
    "yi": (dict(arch="llama", num_key_value_heads=1, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0}), None),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("families")), CASES)


# ---- the quirks matter: transformers' output changes when each is switched off

def _norm_without_offset(cases, name):
    """Every RMSNorm multiplies by w instead of 1 + w."""
    model = load_hf(cases.dir(name))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.sub_(1.0)
    return model


def _without_layer_modules(*attrs):
    """Switches off the named norms of every decoder layer (identity instead)."""
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        for layer in model.model.layers:
            for attr in attrs:
                setattr(layer, attr, torch.nn.Identity())
        return model
    return switch_off


def _embed_unscaled(cases, name):
    model = load_hf(cases.dir(name))
    model.model.embed_tokens.embed_scale.fill_(1.0)
    return model


def _local_base_is_global(cases, name):
    return hf_with_rope_parameters(cases, name,
                                   lambda p: {"sliding_attention": dict(p["full_attention"])})


def _longrope_short_only(cases, name):
    """The short factors at every length (LongRoPE's long factors switched off)."""
    return hf_with_rope_parameters(cases, name, lambda p: {"long_factor": list(p["short_factor"])})


def _longrope_unscaled_attention(cases, name):
    return hf_with_rope_parameters(cases, name, lambda p: {"attention_factor": 1.0})


def _full_rotary(cases, name):
    return hf_with_rope_parameters(cases, name, lambda p: {"partial_rotary_factor": 1.0})


def _glm4_rotary_in_halves(cases, name):
    """GLM-4's rotation with rotate-half pairs (x[i], x[i + rot/2]) instead of interleaved ones:
    Phi-3's partial-rotary apply_rotary_pos_emb in place of GLM-4's."""
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.phi3 import modeling_phi3
    model = load_hf(cases.dir(name))
    original = modeling_glm4.apply_rotary_pos_emb
    modeling_glm4.apply_rotary_pos_emb = modeling_phi3.apply_rotary_pos_emb
    model._restore = lambda: setattr(modeling_glm4, "apply_rotary_pos_emb", original)
    return model


def _layer_norm_bias_off(cases, name):
    model = load_hf(cases.dir(name))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith(".bias"):
                p.zero_()
    return model


# quirk -> (the case that has it, transformers' model with the quirk switched off)
QUIRK_OFF = {
    "gemma2_norm_one_plus_w": ("gemma2", _norm_without_offset),
    "gemma2_post_norms": ("gemma2", _without_layer_modules("post_attention_layernorm",
                                                           "post_feedforward_layernorm")),
    "gemma2_attn_softcap": ("gemma2",
                            lambda c, n: hf_with_config(c, n, attn_logit_softcapping=None)),
    "gemma2_sliding_window": ("gemma2", lambda c, n: hf_with_config(c, n, sliding_window=4096)),
    "gemma2_embed_scale": ("gemma2", _embed_unscaled),
    "gemma2_query_pre_attn_scalar": ("gemma2",
                                     lambda c, n: hf_with_config(c, n, query_pre_attn_scalar=24)),
    "gemma3_qk_norm": ("gemma3", qk_norm_off),
    "gemma3_local_rope_base": ("gemma3", _local_base_is_global),
    "gemma3_sliding_window": ("gemma3", lambda c, n: hf_with_config(c, n, sliding_window=4096)),
    "phi3_longrope_long_factors": ("phi3_longrope", _longrope_short_only),
    "phi3_longrope_attention_factor": ("phi3_longrope", _longrope_unscaled_attention),
    "phi3_partial_rotary": ("phi3_partial_rotary", _full_rotary),
    "glm4_interleaved_rotary": ("glm4", _glm4_rotary_in_halves),
    "glm4_partial_rotary": ("glm4", _full_rotary),
    "glm4_post_norms": ("glm4", _without_layer_modules("post_self_attn_layernorm",
                                                       "post_mlp_layernorm")),
    "glm4_qkv_bias": ("glm4", qkv_bias_off),
    "stablelm_layer_norm_bias": ("stablelm", _layer_norm_bias_off),
    "stablelm_partial_rotary": ("stablelm", _full_rotary),
    "stablelm_qkv_bias": ("stablelm", qkv_bias_off),
    "stablelm_parallel_residual": (
        "stablelm_parallel", lambda c, n: hf_with_config(c, n, use_parallel_residual=False)),
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


def _prefill_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].numpy()


def test_final_softcap_changes_hf_logits(cases):
    """tanh is monotonic, so the final cap shows in the logits (the harness test compares them),
    not in greedy tokens."""
    off = hf_with_config(cases, "gemma2", final_logit_softcapping=None)
    for prompt, r in zip(prompts_for(), cases.ref("gemma2")):
        assert np.abs(r[2]).max() < 3.0 < np.abs(_prefill_logits(off, prompt)).max()


def test_gelu_tanh_changes_hf_logits(cases):
    """GeGLU's tanh GELU against SwiGLU's SiLU: the MLP output is post-normed, so the tokens of
    these prompts barely move; the prefill logits move far beyond the harness test's tolerance."""
    off = hf_with_config(cases, "gemma2", hidden_activation="silu")
    for prompt, r in zip(prompts_for(), cases.ref("gemma2")):
        tol = 1e-4 * max(1.0, np.abs(r[2]).max())
        assert np.abs(_prefill_logits(off, prompt) - r[2]).max() > 100 * tol


def test_qk_layernorm_changes_hf_logits(cases):
    """StableLM's per-head q/k LayerNorm: this tiny model's greedy tokens settle on one token
    with or without it, so the prefill logits show it (far beyond the harness test's
    tolerance)."""
    off = hf_with_config(cases, "stablelm_qk", qk_layernorm=False)
    for prompt, r in zip(prompts_for(), cases.ref("stablelm_qk")):
        tol = 1e-4 * max(1.0, np.abs(r[2]).max())
        assert np.abs(_prefill_logits(off, prompt) - r[2]).max() > 100 * tol


@pytest.mark.parametrize("name", ["gemma3", "phi3_longrope"])
def test_legacy_config_reads_the_same_in_hf(cases, name):
    assert [r[0] for r in cases.ref(name + "_legacy")] == [r[0] for r in cases.ref(name)]


def test_phi3_su_is_longrope(cases):
    """Phi-3's first configs named LongRoPE "su" (transformers 5.23 renames it only after its
    key check, so it cannot load them: compared with the "longrope" reading instead)."""
    import json
    from engine.models.model_config import ModelConfig
    with open(os.path.join(cases.dir("phi3_longrope"), "config.json")) as f:
        config = json.load(f)
    su = ModelConfig.from_dict(phi3_legacy(dict(config), "su"))
    assert su == ModelConfig.from_dict(phi3_legacy(dict(config)))
    assert su.rope.rope_type == "longrope" and su.rope.long_factor == tuple(LONG)
    assert su.rope.original_max_position_embeddings == 32 and su.rope.factor == 256 / 32


# ---- Taper through the whole engine, and the model alone

@pytest.mark.parametrize("name", list(CASES))
def test_llm_greedy_matches_hf(cases, name):
    assert_llm_greedy_matches(cases, name)


@pytest.fixture(scope="module")
def backend():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3_longrope", "phi3_partial_rotary",
                                  "glm4", "stablelm", "stablelm_parallel", "stablelm_qk"])
def test_model_forward_matches_hf(cases, backend, name):
    chunk = {"gemma2": 20, "gemma3": 7, "glm4": 9, "stablelm_parallel": 11}.get(name)
    assert_model_forward_matches(cases, backend, name, chunk)


# ---- through a live `python -m server`, one family after another

@pytest.mark.timeout(600)
def test_server_completions_match_hf(tmp_path):
    """Each family's checkpoint (vocabulary = the tokenizer's) served by `python -m server --w`:
    a greedy completion of a token-id prompt (40 tokens: past the windows and Phi-3's original
    context), through the official openai client, has the text of transformers' tokens decoded
    by transformers' tokenizer."""
    from transformers import AutoTokenizer

    from server_fakes import LiveServer, client_for
    from tiny_tokenizers import build_byte_level

    for arch, kwargs in [("gemma2", {}), ("gemma3", {}), ("phi3", {"rope_parameters": LONGROPE}),
                         ("glm4", {}), ("stablelm", {})]:
        d = tmp_path / arch
        build_byte_level(d)
        hf_tok = AutoTokenizer.from_pretrained(str(d))
        tiny_checkpoint(d, arch=arch, vocab_size=len(hf_tok), **kwargs)
        # whole-character tokens only, so the first generated byte does not finish a character
        # the prompt began (the server's text would start inside the prompt's)
        whole = [i for i in range(3, len(hf_tok)) if "\ufffd" not in hf_tok.decode([i])]
        prompt = np.random.default_rng(5).choice(whole, 40).tolist()
        tokens, trusted, _ = hf_greedy(load_hf(d), prompt, GEN)
        assert trusted >= 8, f"{arch}: reference near-tie at token {trusted}"
        server = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", arch)
        try:
            out = client_for(server.port).completions.create(
                model=arch, prompt=prompt, max_tokens=trusted, temperature=0,
                extra_body={"ignore_eos": True})
        finally:
            server.close()
        assert out.usage.completion_tokens == trusted
        assert out.choices[0].text == hf_tok.decode(tokens[:trusted], skip_special_tokens=True), arch


def test_longrope_factor_set_is_per_sequence(cases, backend):
    """One batch, a sequence past the original context (long factors) beside one that stays
    under it through its 16 tokens (short factors): each gets transformers' tokens. A rule for
    the whole batch (any long sequence switching every row) fails the short one."""
    from engine.loader.model_loader import load_model
    model, _ = load_model(cases.dir("phi3_longrope"), backend, progress=False)
    prompts = [prompts_for()[0], prompts_for()[1][:10]]     # 48 and 10 tokens; 10 + 16 < 32
    hf = load_hf(cases.dir("phi3_longrope"))
    refs = [hf_greedy(hf, p, GEN) for p in prompts]
    short_only = _longrope_short_only(cases, "phi3_longrope")
    assert hf_greedy(short_only, prompts[1], GEN)[0] == refs[1][0]   # the short set alone
    assert hf_greedy(short_only, prompts[0], GEN)[0] != refs[0][0]
    long_only = hf_with_rope_parameters(cases, "phi3_longrope",
                                        lambda p: {"short_factor": list(p["long_factor"])})
    assert hf_greedy(long_only, prompts[1], GEN)[0] != refs[1][0]    # the set matters for it
    tokens, _ = harness_greedy(model, prompts)
    for i, ref in enumerate(refs):
        assert_matches(tokens[i], ref, min_trusted=8, label=f"phi3 longrope prompt {i}")

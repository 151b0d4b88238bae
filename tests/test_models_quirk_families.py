"""Families that are a quirk file each (issue 29 item 4): Phi-2 (PhiForCausalLM), GLM-4.5/4.6
(Glm4MoeForCausalLM), GPT-OSS (GptOssForCausalLM), Llama 4 text (Llama4ForCausalLM),
MiniMax-M2 (MiniMaxM2ForCausalLM), Gemma 4 text (Gemma4ForCausalLM, dense, with the
26B-A4B's mixture of experts beside the MLP, that one on the fused expert path too, and in the
E2B and E4B shapes: per-layer input embeddings and KV sharing across layers) and
Phi-4-mini's shape of Phi3ForCausalLM give transformers' greedy tokens on tiny checkpoints
written by transformers itself (tests/checkpoints.py), through the whole engine with chunked
prefill, a prefix-cache hit and forced preemption, through the server (Llama 4, MiniMax-M2,
Gemma 4), and through the model alone (tests/model_cases.py's paged harness) with prompt chunks
beside the other prompt's decodes (prefill logits too).

Each quirk first shows that transformers' own output changes when the quirk is switched off
(tokens, or the prefill logits far beyond the harness test's tolerance where a tiny model's
tokens do not move), so the comparisons can fail (DESIGN.md section 6, rung 2). GPT-OSS's
attention sinks are a paged_attention option, checked here against a float64 reference (and
Llama 4's attention_chunk in tests/test_attention_masks.py).
"""
from __future__ import annotations

import random

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
    "gpt_oss": (dict(arch="gpt_oss"), None),
    "llama4": (dict(arch="llama4"), None),
    "minimax_m2": (dict(arch="minimax_m2"), None),
    "gemma4": (dict(arch="gemma4"), None),
    # Gemma 4 26B-A4B's shape: 4 experts (2 per token) beside every layer's dense MLP
    "gemma4_moe": (dict(arch="gemma4", enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32), None),
    # Gemma 4 E2B's and E4B's shapes (tests/checkpoints.py): per-layer input embeddings, the
    # last layers KV-shared (E2B's with double-wide MLPs)
    "gemma4_e2b": (dict(arch="gemma4_e2b"), None),
    "gemma4_e4b": (dict(arch="gemma4_e4b"), None),
    # Phi-4-mini's shape of Phi3ForCausalLM (Phi-4 itself is plain Phi-3): three quarters of
    # each head rotated (18 of 24 dims) with LongRoPE factors for those 9 pairs, tied
    # embeddings. The original context (128) covers every sequence here: past it transformers'
    # full recompute rotates every key with the long factors, while a cache (Taper's, or
    # transformers' own) keeps the short ones for keys computed before, so chunked prefill
    # could not match the recompute (tests/test_models_families.py checks the long factors)
    "phi4_mini": (dict(arch="phi3", partial_rotary_factor=0.75, tie_word_embeddings=True,
                       original_max_position_embeddings=128,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0 + 0.05 * i for i in range(9)],
                                        "long_factor": [1.0 + 0.6 * i for i in range(9)]}),
                  None),
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


def _gpt_oss_sinks_off(cases, name):
    model = load_hf(cases.dir(name))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)      # exp(-1e4 - max) == 0: no sink
    return model


def _gpt_oss_gate(gate):
    """transformers' GPT-OSS with its experts' activation replaced by gate(gate_up)."""
    def switch_off(cases, name):
        from transformers.models.gpt_oss import modeling_gpt_oss
        model = load_hf(cases.dir(name))
        experts = modeling_gpt_oss.GptOssExperts
        original = experts._apply_gate
        experts._apply_gate = lambda self, gate_up: gate(self, gate_up)
        model._restore = lambda: setattr(experts, "_apply_gate", original)
        return model
    return switch_off


def _plain_swiglu(self, gate_up):
    """SiLU(gate) * up on the interleaved columns: no clamp, no alpha, no + 1."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    return torch.nn.functional.silu(gate) * up


def _halves_not_interleaved(self, gate_up):
    """GPT-OSS's activation with gate and up as the first and second halves."""
    I = gate_up.shape[-1] // 2
    gate = gate_up[..., :I].clamp(max=self.limit)
    up = gate_up[..., I:].clamp(-self.limit, self.limit)
    return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def _gpt_oss_experts_attr(**changes):
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        for layer in model.model.layers:
            for k, v in changes.items():
                setattr(layer.mlp.experts, k, v)
        return model
    return switch_off


def _gpt_oss_bias_off(*names):
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(names):
                    p.zero_()
        return model
    return switch_off


def _llama4_layer_attr(layer, **changes):
    """Llama 4's attention of one layer with attributes changed (or removed: value None)."""
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        attn = model.model.layers[layer].self_attn
        for k, v in changes.items():
            if v is None:
                delattr(attn, k)
            else:
                setattr(attn, k, v)
        return model
    return switch_off


def _llama4_moe(scores_on_output=False, sigmoid=True, shared=True):
    """transformers' Llama 4 with its MoE changed: the router's sigmoid scores weighting the
    experts' outputs instead of their inputs, the chosen experts at weight 1 (no sigmoid), or
    no shared expert."""
    def switch_off(cases, name):
        from transformers.models.llama4 import modeling_llama4
        model = load_hf(cases.dir(name))
        moe = modeling_llama4.Llama4TextMoe
        original = moe.forward

        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, self.hidden_dim)
            scores, logits = self.router(x)
            if not sigmoid:
                scores = (scores > 0).to(scores.dtype)
            weights = scores.transpose(0, 1).reshape(-1, 1)
            routed_in = x.repeat(scores.shape[1], 1)
            if scores_on_output:
                routed_out = self.experts(routed_in * (weights > 0)) * weights
            else:
                routed_out = self.experts(routed_in * weights)
            out = self.shared_expert(x) if shared else torch.zeros_like(x)
            out = out + routed_out.reshape(scores.shape[1], -1, x.shape[-1]).sum(dim=0)
            return out, logits
        moe.forward = forward
        model._restore = lambda: setattr(moe, "forward", original)
        return model
    return switch_off


class _PerHeadRmsNorm(torch.nn.Module):
    """An RMSNorm over each head of `head_dim` with the full-width weight's slices, in place of
    one over all heads."""
    def __init__(self, norm, head_dim):
        super().__init__()
        self.norm, self.head_dim = norm, head_dim

    def forward(self, x):
        heads = x.reshape(*x.shape[:-1], -1, self.head_dim).float()
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True)
                                    + self.norm.variance_epsilon)
        return self.norm.weight * heads.reshape(x.shape).to(x.dtype)


def _minimax_per_head_qk_norm(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers:
        a = layer.self_attn
        a.q_norm, a.k_norm = _PerHeadRmsNorm(a.q_norm, a.head_dim), _PerHeadRmsNorm(a.k_norm,
                                                                                    a.head_dim)
    return model


def _minimax_router(scores="sigmoid", renormalise=True):
    """transformers' MiniMax-M2 with its router's scores softmax, or not renormalised."""
    def switch_off(cases, name):
        from transformers.models.minimax_m2 import modeling_minimax_m2
        model = load_hf(cases.dir(name))
        router = modeling_minimax_m2.MiniMaxM2TopKRouter
        original = router.forward

        def forward(self, hidden_states, e_score_correction_bias):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim),
                                                self.weight)
            p = logits.float().sigmoid() if scores == "sigmoid" else logits.float().softmax(-1)
            _, index = torch.topk(p + e_score_correction_bias, self.top_k, dim=-1)
            weights = p.gather(1, index)
            if renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights, index
        router.forward = forward
        model._restore = lambda: setattr(router, "forward", original)
        return model
    return switch_off


def _minimax_correction_bias_off(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers:
        layer.mlp.e_score_correction_bias.zero_()
    return model


def _gemma4_attention(**changes):
    """Gemma 4's attention modules with attributes changed (every layer) to value(module)."""
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        for layer in model.model.layers:
            for k, v in changes.items():
                setattr(layer.self_attn, k, v(layer.self_attn))
        return model
    return switch_off


def _gemma4_norms_one_plus_w(cases, name):
    """Gemma 4's RMSNorms multiplying by 1 + w, as Gemma-2/3's do."""
    from transformers.models.gemma4 import modeling_gemma4
    model = load_hf(cases.dir(name))
    norm = modeling_gemma4.Gemma4RMSNorm
    original = norm.forward

    def forward(self, x):
        out = self._norm(x.float())
        if self.with_scale:
            out = out * (1.0 + self.weight.float())
        return out.type_as(x)
    norm.forward = forward
    model._restore = lambda: setattr(norm, "forward", original)
    return model


def _gemma4_layer_scalar_off(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers:
        layer.layer_scalar.fill_(1.0)
    return model


def _gemma4_moe(change):
    """Gemma 4's MoE layers with change(layer) applied to every one (a part of the block
    ignored)."""
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        with torch.no_grad():
            for layer in model.model.layers:
                change(layer)
        return model
    return switch_off


def _gemma4_experts_on_mlp_input(layer):
    """The experts reading the dense MLP's input (pre_feedforward_layernorm), not their own."""
    layer.pre_feedforward_layernorm_2.weight.copy_(layer.pre_feedforward_layernorm.weight)


def _gemma4_model(change):
    """transformers' Gemma 4 (the E-shapes) with change(model.model) applied."""
    def switch_off(cases, name):
        model = load_hf(cases.dir(name))
        with torch.no_grad():
            change(model.model)
        return model
    return switch_off


def _gemma4_ple_activation_off(text_model):
    for layer in text_model.layers:
        layer.act_fn = torch.nn.Identity()


def _gemma4_kv_from_first_of_kind(text_model):
    """The KV-shared layers reading the first layer of their kind's K/V, not the last one's
    before them (the layer that stores it: Gemma4TextAttention.store_full_length_kv)."""
    first_shared = text_model.first_kv_shared_layer_idx
    firsts = {}
    for layer in text_model.layers[:first_shared]:
        a = layer.self_attn
        firsts.setdefault(a.layer_type, a)
        a.store_full_length_kv = False
    for a in firsts.values():
        a.store_full_length_kv = True


def _gemma4_single_wide_shared_mlps(text_model):
    """The KV-shared layers' double-wide MLPs with their second half of units silenced."""
    for layer in text_model.layers[text_model.first_kv_shared_layer_idx:]:
        down = layer.mlp.down_proj.weight
        down[:, down.shape[1] // 2:] = 0.0


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
    "gpt_oss_sinks": ("gpt_oss", _gpt_oss_sinks_off),
    "gpt_oss_sliding_window": ("gpt_oss", lambda c, n: hf_with_config(c, n, sliding_window=4096)),
    "gpt_oss_swiglu_variant": ("gpt_oss", _gpt_oss_gate(_plain_swiglu)),
    "gpt_oss_interleaved_gate_up": ("gpt_oss", _gpt_oss_gate(_halves_not_interleaved)),
    "gpt_oss_swiglu_limit": ("gpt_oss", _gpt_oss_experts_attr(limit=1e9)),
    "gpt_oss_qkvo_bias": ("gpt_oss", _gpt_oss_bias_off("_proj.bias")),
    "gpt_oss_router_bias": ("gpt_oss", _gpt_oss_bias_off("router.bias")),
    "gpt_oss_expert_biases": ("gpt_oss", _gpt_oss_bias_off("_proj_bias")),
}

# Quirks whose switch moves the logits but not every prompt's tokens (shown by the logits).
LOGIT_QUIRK_OFF = {
    "gemma4_moe_block": ("gemma4_moe", _gemma4_moe(lambda l: setattr(l, "enable_moe_block",
                                                                     False))),
    "gemma4_moe_per_expert_scale": ("gemma4_moe",
                                    _gemma4_moe(lambda l: l.router.per_expert_scale.fill_(1.0))),
    "gemma4_moe_router_scale": ("gemma4_moe", _gemma4_moe(lambda l: l.router.scale.fill_(1.0))),
    "gemma4_moe_experts_pre_norm": ("gemma4_moe", _gemma4_moe(_gemma4_experts_on_mlp_input)),
    "gemma4_moe_experts_gelu": ("gemma4_moe", _gemma4_moe(lambda l: setattr(
        l.experts, "act_fn", torch.nn.SiLU()))),
    "phi_dense_bias": ("phi", _phi_bias_off("self_attn.dense")),
    "phi_mlp_bias": ("phi", _phi_bias_off("mlp.fc")),
    "phi_lm_head_bias": ("phi", _phi_bias_off("lm_head")),
    "phi_gelu_new": ("phi", lambda c, n: hf_with_config(c, n, hidden_act="relu")),
    "llama4_chunked_attention": ("llama4",
                                 lambda c, n: hf_with_config(c, n, attention_chunk_size=4096)),
    "llama4_nope_layer": ("llama4", _llama4_layer_attr(1, use_rope=True)),
    "llama4_temperature_tuning": ("llama4", _llama4_layer_attr(1, attn_temperature_tuning=False)),
    "llama4_l2_qk_norm": ("llama4", _llama4_layer_attr(0, qk_norm=None)),
    "llama4_moe_scores_on_input": ("llama4", _llama4_moe(scores_on_output=True)),
    "llama4_moe_sigmoid": ("llama4", _llama4_moe(sigmoid=False)),
    "llama4_moe_shared_expert": ("llama4", _llama4_moe(shared=False)),
    "minimax_m2_full_width_qk_norm": ("minimax_m2", _minimax_per_head_qk_norm),
    "minimax_m2_qk_norm": ("minimax_m2", qk_norm_off),
    "minimax_m2_partial_rotary": ("minimax_m2", _full_rotary),
    "minimax_m2_sigmoid_router": ("minimax_m2", _minimax_router(scores="softmax")),
    "minimax_m2_renormalised": ("minimax_m2", _minimax_router(renormalise=False)),
    "minimax_m2_correction_bias": ("minimax_m2", _minimax_correction_bias_off),
    "gemma4_norm_weight_not_one_plus": ("gemma4", _gemma4_norms_one_plus_w),
    "gemma4_qk_norm": ("gemma4", qk_norm_off),
    "gemma4_v_norm": ("gemma4", _gemma4_attention(v_norm=lambda a: torch.nn.Identity())),
    "gemma4_unscaled_scores": ("gemma4", _gemma4_attention(scaling=lambda a: a.head_dim ** -0.5)),
    "gemma4_proportional_rope": ("gemma4", lambda c, n: hf_with_rope_parameters(c, n, lambda p: {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})),
    "gemma4_layer_scalar": ("gemma4", _gemma4_layer_scalar_off),
    "gemma4_sliding_window": ("gemma4", lambda c, n: hf_with_config(c, n, sliding_window=4096)),
    "gemma4_final_softcap": ("gemma4",
                             lambda c, n: hf_with_config(c, n, final_logit_softcapping=None)),
    # the E2B/E4B shapes' per-layer input embeddings: the whole block, its two parts, the
    # gate's GELU (their common 1/sqrt(2) is not felt: post_per_layer_input_norm undoes it);
    # KV sharing's source layer; the shared layers' wide MLPs
    "gemma4_ple_block": ("gemma4_e2b", _gemma4_model(
        lambda m: [layer.per_layer_projection.weight.zero_() for layer in m.layers])),
    "gemma4_ple_token_embeddings": ("gemma4_e2b", _gemma4_model(
        lambda m: m.embed_tokens_per_layer.weight.zero_())),
    "gemma4_ple_context_projection": ("gemma4_e4b", _gemma4_model(
        lambda m: m.per_layer_model_projection.weight.zero_())),
    "gemma4_ple_gate_activation": ("gemma4_e4b", _gemma4_model(_gemma4_ple_activation_off)),
    "gemma4_kv_sharing_source_e2b": ("gemma4_e2b", _gemma4_model(_gemma4_kv_from_first_of_kind)),
    "gemma4_kv_sharing_source_e4b": ("gemma4_e4b", _gemma4_model(_gemma4_kv_from_first_of_kind)),
    "gemma4_double_wide_mlp": ("gemma4_e2b", _gemma4_model(_gemma4_single_wide_shared_mlps)),
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
def test_engine_preemption_matches_hf(cases, name):
    """Six prompts in a pool too small for them: the scheduler preempts and recomputes, with
    prompt chunks of 16 beside decodes, on shuffled free blocks; every continuation equals
    transformers'."""
    from engine import LLM, SamplingParams
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, n).tolist() for n in (9, 70, 23, 41, 3, 55)]
    model = load_hf(cases.dir(name))
    refs = [hf_greedy(model, p, GEN) for p in prompts]
    llm = LLM(cases.dir(name), block_size=8, num_kv_blocks=24, prefill_chunk_size=16,
              max_num_batched_tokens=48, max_num_seqs=8)
    llm.engine.block_pool.shuffle_free_blocks(random.Random(1))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_matches(list(out.token_ids), ref, min_trusted=4, label=f"{name} prompt {i}")
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", list(CASES))
def test_model_forward_matches_hf(cases, backend, name):
    assert_model_forward_matches(cases, backend, name, chunk=9)


def _sinks_reference(q, kc, vc, tables, seq_lens, qsl, scale, window, sinks):
    """Dense causal attention in float64 with one more logit per head, sinks[h], in each row's
    softmax (transformers' GPT-OSS eager attention)."""
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = kc.shape
    kf, vf = kc.astype(np.float64).reshape(-1, Hkv, D), vc.astype(np.float64).reshape(-1, Hkv, D)
    out = np.zeros((T, Hq, D))
    for b in range(len(seq_lens)):
        s0, s1, S = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        slots = np.array([tables[b, j // BS] * BS + j % BS for j in range(S)])
        pos = S - (s1 - np.arange(s0, s1))
        j = np.arange(S)
        mask = (j[None] <= pos[:, None]) & ((j[None] > pos[:, None] - window) if window else True)
        for h in range(Hq):
            g = h // (Hq // Hkv)
            s = np.where(mask, q[s0:s1, h].astype(np.float64) @ kf[slots, g].T * scale, -np.inf)
            full = np.concatenate([s, np.full((s1 - s0, 1), float(sinks[h]))], axis=1)
            p = np.exp(full - full.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[s0:s1, h] = p[:, :-1] @ vf[slots, g]
    return out


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("nt", [1, 2])
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("seqs", [[(1, 1), (37, 1), (50, 13), (20, 20), (70, 2)],
                                  [(1300, 1)]])
def test_paged_attention_sinks_match_reference(isa, nt, window, seqs):
    """The CPU op's sinks on every kernel: decodes and prefill chunks, and a long decode alone,
    whose keys are split across the threads and merged (nt 2); without the sinks the answer
    differs."""
    from pyx.cpu_backend import CpuBackend, isa_supported
    from test_backend_ops import make_paged_batch
    if not isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    be = CpuBackend(isa=isa, num_threads=nt)
    rng = np.random.default_rng(7)
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, seqs, 16, 4, 2, 32)
    sinks = rng.normal(6.0, 2.0, 4).astype(np.float32)    # felt over 1300 keys too
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.3, window, sinks=sinks)
    want = _sinks_reference(q, kc, vc, tables, seq_lens, qsl, 0.3, window, sinks)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    plain = np.empty_like(q)
    be.paged_attention(plain, q, kc, vc, tables, seq_lens, qsl, 0.3, window)
    assert np.abs(plain - want).max() > 1e-2
    with pytest.raises(ValueError, match="sinks"):
        be.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.3, window, sinks=sinks[:3])


class _NamedCuda:
    """The CPU backend under the CUDA backend's name: what a model file decides by the backend's
    name (a refusal) shows here, while every op still runs on the CPU."""
    name = "cuda"

    def __init__(self, cpu):
        self._cpu = cpu

    def __getattr__(self, attr):
        return getattr(self._cpu, attr)


@pytest.mark.parametrize("name", ["gpt_oss", "llama4", "gemma4", "gemma4_moe"])
def test_families_build_on_a_backend_named_cuda(cases, backend, name):
    """GPT-OSS, Llama 4 and Gemma 4 no longer refuse the CUDA backend by name (their kernels there:
    tests/gpu/test_cuda_quirk_families.py), and nothing in their files branches on it: the
    harness gives transformers' logits and tokens."""
    assert_model_forward_matches(cases, _NamedCuda(backend), name, chunk=9)


@pytest.mark.parametrize("name", ["gpt_oss", "llama4"])
def test_fused_experts_match_hf(cases, name):
    """GPT-OSS's experts (with their biases and the clamped SwiGLU) and Llama 4's on the
    grouped-GEMM path (kernels moe=fused, the CPU's reference ops): the path CUDA graphs
    capture."""
    from pyx.cpu_backend import CpuBackend
    assert_model_forward_matches(cases, CpuBackend(kernels="moe=fused"), name, chunk=9)


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


def test_llama4_layer_plan_and_refusals(cases):
    """Llama4TextConfig's defaults for the per-layer plan: every interleave_moe_layer_step-th
    layer sparse, every no_rope_layer_interval-th NoPE, the RoPE layers chunked; a chunk size
    that is not a multiple of the KV block size is refused by name (the CPU op cuts the batch at
    block boundaries)."""
    import json

    from engine.models.model_config import ModelConfig
    with open(f"{cases.dir('llama4')}/config.json") as f:
        config = json.load(f)
    plain = {k: v for k, v in config.items()
             if k not in ("moe_layers", "no_rope_layers", "layer_types")}
    c = ModelConfig.from_dict({**plain, "num_hidden_layers": 8})
    assert c.moe.sparse_layers == [False, True] * 4
    assert c.family.rope_layers == (True, True, True, False) * 2
    assert c.family.chunked_layers == c.family.rope_layers
    assert c.intermediate_size == 192 and c.moe.intermediate_size == 64
    assert not c.rope.is_neox
    from engine.loader.model_loader import load_model
    from pyx.cpu_backend import CpuBackend
    model, _ = load_model(cases.dir("llama4"), CpuBackend(), progress=False)
    with pytest.raises(ValueError, match="attention_chunk_size 16 is not a multiple of the KV "
                                         "block size 12"):
        model.kv_cache_shape(4, 12)


def test_gemma4_layer_plan_and_refusals(cases):
    """Gemma4TextConfig's rules: the full layers' head size and KV heads from per_layer_config
    or global_head_dim / num_global_key_value_heads, every 6th layer and the last full by
    default; the MoE block on every layer with enable_moe_block; every layer's cache the wider
    kind's shape (the pool's size per token counts it)."""
    import json

    from engine.models.model_config import ModelConfig
    with open(f"{cases.dir('gemma4')}/config.json") as f:
        config = json.load(f)
    c = ModelConfig.from_dict(config)
    assert (c.family.full_head_dim, c.family.full_kv_heads, c.family.k_eq_v) == (32, 1, True)
    assert c.sliding_windows == [16, 0] and c.final_softcap == 10.0
    assert c.kv_cache_elements_per_token == 2 * max(2 * 16, 1 * 32)
    plain = {k: v for k, v in config.items() if k not in ("per_layer_config", "layer_types")}
    c = ModelConfig.from_dict({**plain, "num_hidden_layers": 7, "global_head_dim": 64,
                               "num_global_key_value_heads": 2})
    assert c.family.full_layers == (False,) * 5 + (True, True)
    assert (c.family.full_head_dim, c.family.full_kv_heads) == (64, 2)
    assert c.kv_cache_elements_per_token == 2 * 128
    assert c.family.per_layer_input_size == 0 and not any(c.family.kv_shared)
    assert c.num_kv_layers == 7
    absent = ModelConfig.from_dict({k: v for k, v in config.items()
                                    if k != "hidden_size_per_layer_input"})
    assert absent.family.per_layer_input_size == 256      # the config class's default
    assert c.moe is None
    m = ModelConfig.from_dict({**config, "enable_moe_block": True, "num_experts": 8,
                               "top_k_experts": 3, "moe_intermediate_size": 24}).moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.normalize) == (8, 3, 24, True)
    assert m.sparse_layers == [True, True] and m.shared_intermediate_size == 0
    with pytest.raises(ValueError, match="YaRN scaling factor is not supported"):
        ModelConfig.from_dict(config, yarn_scaling_factor=2.0)


def test_gemma4_e_shapes_layer_plan(cases):
    """Gemma4TextConfig.kv_sharing_modes' rule: the last num_kv_shared_layers layers read the
    cache of the last layer of their kind before them; E2B's 35 layers (4 sliding to a full one,
    20 shared) read layers 13 and 14; the pool's layers are the others. A shared kind with no
    layer of its kind before it, too many shared layers, and a per-layer vocabulary smaller than
    the vocabulary are refused by name."""
    import json

    from engine.models.model_config import ModelConfig
    with open(f"{cases.dir('gemma4_e2b')}/config.json") as f:
        config = json.load(f)
    c = ModelConfig.from_dict(config)
    s = c.family
    assert s.kv_sources == (0, 1, 2, 1, 1, 2) and s.kv_shared == (False,) * 3 + (True,) * 3
    assert s.per_layer_input_size == 16 and s.per_layer_vocab_size == 512 and s.double_wide_mlp
    assert c.num_kv_layers == 3 and c.kv_cache_elements_per_token == 2 * 32
    e2b = {**config, "num_hidden_layers": 35, "num_kv_shared_layers": 20,
           "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
           "per_layer_config": None}
    s = ModelConfig.from_dict(e2b).family
    assert s.kv_sources == tuple(range(15)) + tuple(14 if (i + 1) % 5 == 0 else 13
                                                    for i in range(15, 35))
    with pytest.raises(ValueError, match="a shared full-attention layer has no full-attention "
                                         "layer before"):
        ModelConfig.from_dict({**config, "num_kv_shared_layers": 4})
    with pytest.raises(ValueError, match="num_kv_shared_layers 6: between 0 and"):
        ModelConfig.from_dict({**config, "num_kv_shared_layers": 6})
    with pytest.raises(ValueError, match="vocab_size_per_layer_input 256 is smaller than "
                                         "vocab_size 512"):
        ModelConfig.from_dict({**config, "vocab_size_per_layer_input": 256})


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_e4b"])
def test_gemma4_kv_pool_holds_only_unshared_layers(cases, name):
    """The KV pool's bytes per block count the layers that own a cache (3 of E2B-shaped 6, 4 of
    E4B-shaped 6), so the same --mem budget holds that many more blocks; each KV-shared layer's
    cache is its source layer's arrays (it writes none of its own)."""
    from engine import LLM
    from engine.runner.model_runner import ModelRunner
    llm = LLM(cases.dir(name), block_size=16, kv_cache_memory_mb=1)
    config, runner = llm.engine.model_config, llm.engine.runner
    s = config.family
    own = s.kv_shared.count(False)
    width = s.cache_width(config.kv_size)      # values per token in one layer's K (or V)
    assert ModelRunner.kv_bytes_per_block(config, 16) == 16 * 2 * width * 4 * own
    assert llm.engine.block_pool.num_blocks == 2**20 // (16 * 2 * width * 4 * own)
    caches = runner.kv_caches
    assert len(caches) == config.num_hidden_layers
    assert len({id(k) for k, _ in caches}) == own
    for i, src in enumerate(s.kv_sources):
        assert caches[i] is caches[src]
    assert sum(k.nbytes + v.nbytes for k, v in {id(kv[0]): kv for kv in caches}.values()) == \
        llm.engine.block_pool.num_blocks * ModelRunner.kv_bytes_per_block(config, 16)


def test_gemma4_kv_shared_layers_run_only_the_rows_read(cases):
    """The KV-shared layers write no cache, so they run on the rows whose outputs are read: a
    40-token prompt in chunks of 16 passes 16, 16 and 8 rows through the unshared layers and
    only its last row (then each decode row) through the shared ones, with transformers'
    tokens."""
    from engine import LLM, SamplingParams
    llm = LLM(cases.dir("gemma4_e2b"), block_size=8, num_kv_blocks=48, prefill_chunk_size=16,
              max_num_batched_tokens=16)
    model = llm.engine.runner.model
    seen = {"unshared": [], "shared": []}
    for layer, shared in ((model.layers[0], False), (model.layers[-1], True)):
        attention, forward = layer.attention, layer.attention.forward

        def spy(batch, x, out, k_cache, v_cache, ws, forward=forward, shared=shared):
            seen["shared" if shared else "unshared"].append(x.shape[0])
            return forward(batch, x, out, k_cache, v_cache, ws)
        attention.forward = spy
    prompt = prompts_for()[0][:40]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert seen == {"unshared": [16, 16, 8, 1, 1], "shared": [1, 1, 1]}
    ref = hf_greedy(load_hf(cases.dir("gemma4_e2b")), prompt, 3)
    assert_matches(list(out[0].token_ids), ref, min_trusted=3, label="gemma4_e2b")


def test_gemma4_kv_shared_row_skipping_keeps_prompt_logprobs(cases):
    """Prompt logprobs (rows read from the first prompt position on, beside sampled rows of
    other sequences) are those of the forward that runs every row through the shared layers."""
    from engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    prompts = [prompts_for()[0][:40], prompts_for()[1]]

    def run(skip):
        llm = LLM(cases.dir("gemma4_e2b"), block_size=8, num_kv_blocks=48,
                  prefill_chunk_size=16, max_num_batched_tokens=24)
        if not skip:
            llm.engine.runner.model._rows_read = lambda batch, hidden_indices: None
        return llm.generate(prompts, params)
    for got, want in zip(run(True), run(False)):
        assert got.token_ids == want.token_ids
        g = [p.top_logprobs for p in got.prompt_logprobs[1:]]
        w = [p.top_logprobs for p in want.prompt_logprobs[1:]]
        assert len(g) == len(prompts[0 if len(g) == 39 else 1]) - 1
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


def test_gemma4_moe_fused_experts_match_hf(cases):
    """Gemma 4's experts on the grouped-GEMM path (kernels moe=fused) give transformers'
    logits and tokens too."""
    from pyx.cpu_backend import CpuBackend
    assert_model_forward_matches(cases, CpuBackend(kernels="moe=fused"), "gemma4_moe", chunk=9)


def released_gemma4(directory, arch: str = "gemma4"):
    """A tiny Gemma 4 as released, saved in `directory`: Gemma4ForConditionalGeneration, the
    text config (tests/checkpoints.py's `arch`) under text_config, its tensors under
    model.language_model. beside a vision tower, tied embeddings. Returns transformers' model."""
    import transformers

    from checkpoints import ARCHS, TINY, scale_weights
    text = {**TINY, **ARCHS[arch][1], "tie_word_embeddings": True}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None))
    scale_weights(model)
    model.save_pretrained(directory)
    return model.eval()


def released_llama4(directory):
    """A tiny Llama 4 as released, saved in `directory`: Llama4ForConditionalGeneration, the
    text config under text_config, its tensors under language_model. beside a vision model and
    projector. Returns transformers' model."""
    import transformers

    from checkpoints import ARCHS, TINY, scale_weights
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=96)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config={**TINY, **ARCHS["llama4"][1]}, vision_config=vision))
    scale_weights(model)
    model.save_pretrained(directory)
    return model.eval()


def test_gemma4_multimodal_checkpoint_serves_its_text(tmp_path):
    """Gemma 4 as released: Gemma4ForConditionalGeneration, the text config under text_config,
    its tensors under model.language_model. beside a vision tower, tied embeddings. Taper serves
    the text model (the tower not loaded) with transformers' tokens for a text prompt."""
    from engine import LLM, SamplingParams
    model = released_gemma4(tmp_path)
    prompts = prompts_for()
    outs = LLM(str(tmp_path), backend="cpu", num_kv_blocks=32).generate(
        prompts, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(list(out.token_ids), hf_greedy(model, prompt, GEN), min_trusted=8,
                       label=f"Gemma4ForConditionalGeneration prompt {i}")


def test_llama4_multimodal_checkpoint_serves_its_text(tmp_path):
    """Llama 4 as released: Llama4ForConditionalGeneration, the text config under text_config,
    its tensors under language_model. beside a vision model and projector. Taper serves the
    text model (the vision parts not loaded) with transformers' tokens for a text prompt."""
    from engine import LLM, SamplingParams
    model = released_llama4(tmp_path)
    prompts = prompts_for()
    outs = LLM(str(tmp_path), backend="cpu", num_kv_blocks=32, block_size=16).generate(
        prompts, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(list(out.token_ids), hf_greedy(model, prompt, GEN), min_trusted=8,
                       label=f"Llama4ForConditionalGeneration prompt {i}")


@pytest.mark.parametrize("arch", ["llama4", "minimax_m2", "gemma4", "gemma4_e2b"])
def test_server_completion_matches_transformers(tmp_path, arch):
    """The checkpoint (vocabulary = the tokenizer's) served by `python -m server`: a greedy
    completion through the official openai client has transformers' text."""
    from transformers import AutoTokenizer

    from checkpoints import tiny_checkpoint
    from server_fakes import LiveServer, client_for
    from tiny_tokenizers import build_byte_level

    d = tmp_path / arch
    build_byte_level(d)
    hf_tok = AutoTokenizer.from_pretrained(str(d))
    tiny_checkpoint(d, arch=arch, vocab_size=len(hf_tok))
    whole = [i for i in range(3, len(hf_tok)) if "\ufffd" not in hf_tok.decode([i])]
    prompt = np.random.default_rng(5).choice(whole, 40).tolist()
    tokens, trusted, _ = hf_greedy(load_hf(d), prompt, GEN)
    assert trusted >= 8, f"reference near-tie at token {trusted}"
    server = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", arch)
    try:
        out = client_for(server.port).completions.create(
            model=arch, prompt=prompt, max_tokens=trusted, temperature=0,
            extra_body={"ignore_eos": True})
    finally:
        server.close()
    assert out.choices[0].text == hf_tok.decode(tokens[:trusted], skip_special_tokens=True)

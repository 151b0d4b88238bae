"""Tiny random-weight checkpoints written by transformers itself (DESIGN.md section 5).

The *tiny* family: hidden 96, head_dim 16-32, 2 layers, vocab 512. After transformers' init the
weights are scaled up (linear layers x `scale`, embeddings ~ N(0, 0.15^2), norm weights and biases
randomised) so the residual stream is not just the embedding, every feature changes the tokens, and
greedy continuations vary instead of repeating one token.
"""
from __future__ import annotations

import json
import os

TINY = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, vocab_size=512,
            max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

# Multi-head latent attention's dimensions (the DeepSeek-style entries of ARCHS).
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=24,
            qk_rope_head_dim=16, v_head_dim=20, tie_word_embeddings=False)

ARCHS = {
    # GQA 4:2, tied embeddings
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  tie_word_embeddings=True)),
    # qkv bias always on; 3 query heads share 1 KV head
    "qwen2": ("Qwen2Config", dict(num_attention_heads=3, num_key_value_heads=1,
                                  tie_word_embeddings=False)),
    # q/k RMSNorm per head; head_dim 32 * 4 heads != hidden 96
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True)),
    # sliding window on every layer, smaller than the test prompts
    "mistral": ("MistralConfig", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                      sliding_window=16, tie_word_embeddings=False)),
    # (1 + w) norms, sandwich norms, GeGLU, soft-caps, query_pre_attn_scalar != head_dim, the
    # first of two layers sliding with a window shorter than the prompts. Untied embeddings: with
    # the embedding scaled by sqrt(hidden) a tied random head mostly predicts the last token again.
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                    sliding_window=16, query_pre_attn_scalar=96,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    pad_token_id=0, tie_word_embeddings=False)),
    # Gemma-2's layout plus q/k norm, a sliding (local) layer with a RoPE base of its own and a
    # full (global) one with linearly scaled RoPE, no soft-caps
    "gemma3": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, sliding_window=16,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        pad_token_id=0, tie_word_embeddings=False)),
    # fused qkv_proj / gate_up_proj; LongRoPE with the original context (32) under the prompts
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                original_max_position_embeddings=32, pad_token_id=0,
                                tie_word_embeddings=False)),
    # q/k/v bias, half of each head rotated in interleaved pairs, post-norms after attention and
    # the MLP, fused gate_up_proj
    "glm4": ("Glm4Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                partial_rotary_factor=0.5, attention_bias=True, pad_token_id=0,
                                tie_word_embeddings=False)),
    # LayerNorm with bias everywhere, a quarter of each head rotated, q/k/v bias
    "stablelm": ("StableLmConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                        use_qkv_bias=True, partial_rotary_factor=0.25,
                                        layer_norm_eps=1e-5, tie_word_embeddings=False)),
    # Phi-2: parallel residual, LayerNorm with bias, half of each head rotated, q/k/v and dense
    # biases, an ungated gelu_new MLP (fc1/fc2 with biases), a biased lm_head
    "phi": ("PhiConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                              partial_rotary_factor=0.5, layer_norm_eps=1e-5,
                              tie_word_embeddings=False)),
    # GLM-4.5/4.6: ordinary attention (q/k/v bias, per-head q/k RMSNorm, half of each head
    # rotated in rotate-half pairs) with DeepSeek-V3's router (sigmoid, e_score_correction_bias
    # randomised, the best 2 of 4 groups, renormalised, routed_scaling_factor 2.5), a shared
    # expert, and a dense first layer (first_k_dense_replace)
    "glm4_moe": ("Glm4MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                       partial_rotary_factor=0.5, attention_bias=True,
                                       use_qk_norm=True, n_routed_experts=8, n_shared_experts=1,
                                       num_experts_per_tok=2, moe_intermediate_size=64,
                                       first_k_dense_replace=1, n_group=4, topk_group=2,
                                       norm_topk_prob=True, routed_scaling_factor=2.5,
                                       tie_word_embeddings=False)),
    # GPT-OSS: attention sinks, a sliding layer (window 16, under the prompts) then a full one,
    # q/k/v/o biases, YaRN without truncation, 4 experts (2 per token) with biases, the clamped
    # SwiGLU (limit 2, which the projections reach), a router with a bias
    "gpt_oss": ("GptOssConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                     intermediate_size=64, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=16, swiglu_limit=2.0,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                                      "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 64},
                                     tie_word_embeddings=False)),
    # Llama 4 text: layer 0 RoPE with chunked attention (chunks of 16, under the prompts) and
    # the L2 q/k norm, a dense MLP of intermediate_size_mlp; layer 1 NoPE, full attention, the
    # temperature (floor_scale 8, attn_scale 0.5: it grows across the prompts) and the MoE
    # (interleave_moe_layer_step 2): 4 experts, top-1 by sigmoid on the input, a shared expert
    "llama4": ("Llama4TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                        intermediate_size=64, intermediate_size_mlp=192,
                                        num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                                        attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
                                        pad_token_id=0, tie_word_embeddings=False)),
    # MiniMax-M2: q/k RMSNorm over all heads, half of each head rotated (rotary_dim), 8 experts
    # (2 per token) chosen by sigmoid + e_score_correction_bias (randomised), renormalised
    "minimax_m2": ("MiniMaxM2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=24, rotary_dim=12, intermediate_size=64,
                                           num_local_experts=8, num_experts_per_tok=2,
                                           pad_token_id=0, tie_word_embeddings=False)),
    # Gemma 4 text: a sliding layer (heads of 16, 2 KV heads, window 16) then a full one with
    # heads of 32 and one KV head whose values are its keys (attention_k_eq_v), proportional
    # RoPE on a quarter of its pairs; q/k/v norms, unscaled scores, layer_scalar (randomised),
    # a final soft-cap; no per-layer input embeddings
    "gemma4": ("Gemma4TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        global_head_dim=32, num_global_key_value_heads=1,
                                        attention_k_eq_v=True, hidden_size_per_layer_input=0,
                                        sliding_window=16, final_logit_softcapping=10.0,
                                        layer_types=["sliding_attention", "full_attention"],
                                        pad_token_id=0, tie_word_embeddings=False)),
    # Gemma 4 E2B's shape: one KV head, per-layer input embeddings (16 per layer), the last 3
    # of 6 layers KV-shared (sliding, sliding, full: reading layers 1 and 2's caches) with
    # double-wide MLPs; no attention_k_eq_v
    "gemma4_e2b": ("Gemma4TextConfig", dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        global_head_dim=32, attention_k_eq_v=False, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512, num_kv_shared_layers=3, use_double_wide_mlp=True,
        sliding_window=16, final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        pad_token_id=0, tie_word_embeddings=False)),
    # Gemma 4 E4B's shape: two KV heads, per-layer input embeddings, five sliding layers to a
    # full one, the last 2 KV-shared (reading layers 3 and 1's caches), MLPs of one width
    "gemma4_e4b": ("Gemma4TextConfig", dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, attention_k_eq_v=False, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=False,
        sliding_window=16, final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 3
        + ["full_attention"], pad_token_id=0, tie_word_embeddings=False)),
    # mixtures of experts: 4 experts, 2 per token
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None, tie_word_embeddings=False)),
    # a sigmoid-gated shared expert beside the routed ones; top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_attention_heads=3, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64,
                                         shared_expert_intermediate_size=128,
                                         norm_topk_prob=False, tie_word_embeddings=False)),
    # renormalised top-k (norm_topk_prob); layer 0 keeps a dense MLP (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64, norm_topk_prob=True,
                                         mlp_only_layers=[0], tie_word_embeddings=True)),
    # multi-head latent attention (tests/test_models_mla.py): a latent of 32 and a rotary part
    # of 16 per token, heads of 24 + 16 (q/k) and 20 (v); DeepSeekMoE with 8 routed experts (2
    # per token) and a shared one after a dense first layer. V2: q_lora_rank, softmax routing
    # limited to the best of 4 groups (with 2 the top-2 experts' groups would always be kept),
    # routed_scaling_factor
    "deepseek_v2": ("DeepseekV2Config", dict(**_MLA, q_lora_rank=48, n_routed_experts=8,
                                             n_shared_experts=1, num_experts_per_tok=2,
                                             moe_intermediate_size=64, first_k_dense_replace=1,
                                             topk_method="group_limited_greedy", n_group=4,
                                             topk_group=1, routed_scaling_factor=1.5)),
    # V2-Lite's shape: no q_lora_rank (one q_proj), greedy softmax top-k, two shared experts
    "deepseek_v2_lite": ("DeepseekV2Config", dict(**_MLA, q_lora_rank=None, n_routed_experts=8,
                                                  n_shared_experts=2, num_experts_per_tok=2,
                                                  moe_intermediate_size=32,
                                                  first_k_dense_replace=1, topk_method="greedy")),
    # V3: sigmoid routing with e_score_correction_bias (randomised) over the best 2 of 4 groups,
    # renormalised, routed_scaling_factor 2.5; YaRN with mscale != mscale_all_dim (the cos/sin
    # factor and the softmax scale both move); rope_interleave
    "deepseek_v3": ("DeepseekV3Config", dict(
        **_MLA, q_lora_rank=48, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=64, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.8,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    # GLM-4.7-Flash: V3's attention and router (one group), mlp_layer_types
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(
        **_MLA, q_lora_rank=48, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=64, n_group=1, topk_group=1, routed_scaling_factor=1.8,
        mlp_layer_types=["dense", "sparse"])),
}


# hybrid linear attention (gated DeltaNet beside gated full attention): 4 layers, 2 key heads of
# 16 serving 4 value heads of 24 (grouped), a width-4 convolution, a quarter of each attention
# head rotated (the configs' default)
_LINEAR = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=24, linear_conv_kernel_dim=4, tie_word_embeddings=False)
ARCHS.update({
    # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head; MoE with a sigmoid-gated
    # shared expert, layer 1 dense (mlp_only_layers); layers linear, linear, linear, full
    "qwen3_next": ("Qwen3NextConfig", dict(_LINEAR, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64,
                                           mlp_only_layers=[1])),
    # Qwen3.5: split in_proj_qkv/z/b/a, dense MLPs; a full-attention layer second
    "qwen3_5": ("Qwen3_5TextConfig", dict(_LINEAR, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "linear_attention"])),
    # Qwen3.5-MoE: every layer sparse, top-k renormalised, a shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(_LINEAR, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=64,
                                                 shared_expert_intermediate_size=64)),
})


def tiny_config(arch: str = "llama", **overrides):
    import transformers

    cls_name, arch_kwargs = ARCHS[arch]
    kwargs = {**TINY, **arch_kwargs, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def scale_weights(model, scale: float = 8.0, seed: int = 0, embed_std: float = 0.15):
    """In place: linear weights x scale, embeddings ~ N(0, 0.15^2), norms ~ 1 + N(0, 0.2^2),
    biases ~ N(0, 0.5^2)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
                # gated DeltaNet decays exp(-exp(A_log) * softplus(a + dt_bias)) spread over
                # about (0.2, 1): the state carries some tokens, forgets others
                p.copy_(torch.log(0.02 + 0.48 * torch.rand(p.shape, generator=gen))
                        if name.endswith("A_log") else 0.5 * noise)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(embed_std * noise)
            else:
                p.mul_(scale)
        for name, buf in model.named_buffers():   # DeepSeek-V3's router bias: zero at init
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen, dtype=torch.float32))
    return model


def _phi_weights(model, seed: int):
    """Phi-2's parallel residual and LayerNorm biases settle a tiny model on one repeated token
    under scale_weights alone: LayerNorm biases ~ N(0, 0.5^2) (not 1 + noise, which every
    position shares), embeddings ~ N(0, 1), the lm_head's bias x 0.1."""
    import torch

    gen = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        model.model.embed_tokens.weight.normal_(0.0, 1.0, generator=gen)
        model.lm_head.bias.mul_(0.1)


def _gpt_oss_weights(model, seed: int):
    """GPT-OSS's expert biases (named *_bias, zero at init) ~ N(0, 0.5^2) like other biases, and
    its sinks ~ N(1, 1) so that they weigh against the scores."""
    import torch

    gen = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("self_attn.sinks"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen))


def _gemma4_weights(model, seed: int):
    """Gemma 4's layer_scalar buffers (one at init) ~ U(0.5, 1.5); with the MoE block, the
    router's scale (ones at init, then x scale) ~ 8 U(0.5, 1.5) per dimension, so that the router
    logits spread well beyond near-ties, and per_expert_scale ~ U(0.5, 1.5)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
            if getattr(layer, "enable_moe_block", False):
                r = layer.router
                r.scale.copy_(8.0 * (0.5 + torch.rand(r.scale.shape, generator=gen)))
                r.per_expert_scale.copy_(0.5 + torch.rand(r.per_expert_scale.shape,
                                                          generator=gen))


# per architecture: (scale for scale_weights, a further adjustment after it)
_ADJUST = {"phi": (4.0, _phi_weights), "gpt_oss": (8.0, _gpt_oss_weights),
           "gemma4": (8.0, _gemma4_weights), "gemma4_e2b": (8.0, _gemma4_weights),
           "gemma4_e4b": (8.0, _gemma4_weights)}


def tiny_checkpoint(directory, arch: str = "llama", dtype: str = "float32", seed: int = 0,
                    scale: float = 8.0, **overrides) -> str:
    """Write a tiny `arch` checkpoint (config overrides as keyword arguments) to `directory` with
    save_pretrained, in float32 or bfloat16. Returns the directory as a string."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    adjust = None
    if arch in _ADJUST:
        scale, adjust = _ADJUST[arch]
    scale_weights(model, scale=scale, seed=seed)
    if adjust is not None:
        adjust(model, seed)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"dtype {dtype!r}: float32 or bfloat16")
    directory = str(directory)
    model.save_pretrained(directory)
    return directory


def edit_config(directory, fn) -> dict:
    """Rewrite config.json as fn(config dict) returns it."""
    path = os.path.join(str(directory), "config.json")
    with open(path) as f:
        config = fn(json.load(f))
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return config


def to_legacy_rope(config: dict) -> dict:
    """Nested `rope_parameters` (what transformers 5 writes) -> legacy rope_theta + rope_scaling."""
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = None if params["type"] == "default" else params
    return config


# ---- the *tiny-256* family (DESIGN.md section 5): hidden 256, intermediate 768, 4 heads of
# head_dim 64, 2 KV heads, 2 layers, vocab 512; for quantized formats and GPU kernels (head_dim 64
# is one of the CUDA kernels' compiled head sizes).

TINY_256 = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, vocab_size=512,
                max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)

ARCHS_256 = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),     # qkv bias
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),      # q/k RMSNorm per head
    "mistral": ("MistralConfig", dict(sliding_window=16, tie_word_embeddings=False)),
    # the families of issue 16 with the tiny family's quirks (head_dim 64 throughout)
    "gemma2": ("Gemma2Config", dict(sliding_window=16, query_pre_attn_scalar=256,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    pad_token_id=0, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=16, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        tie_word_embeddings=False)),
    "phi3": ("Phi3Config", dict(
        original_max_position_embeddings=32, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.02 * i for i in range(32)],
                         "long_factor": [1.0 + 0.25 * i for i in range(32)]})),
    "glm4": ("Glm4Config", dict(partial_rotary_factor=0.5, attention_bias=True, pad_token_id=0,
                                tie_word_embeddings=False)),
    "stablelm": ("StableLmConfig", dict(use_qkv_bias=True, partial_rotary_factor=0.25,
                                        use_parallel_residual=True, layer_norm_eps=1e-5,
                                        tie_word_embeddings=False)),
    # mixture of experts for the fused CUDA path (issue 16): Mixtral's top-2 of 8 (experts of the
    # family's intermediate 768), Qwen3-MoE's renormalised top-4 of 16 (experts of 128)
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=None, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=16, num_experts_per_tok=4,
                                         moe_intermediate_size=128, norm_topk_prob=True,
                                         tie_word_embeddings=True)),
    # MiniMax-M2: q/k RMSNorm over all heads, half of each head rotated, a sigmoid router with
    # its correction bias over 8 experts of 128 (2 per token)
    "minimax_m2": ("MiniMaxM2Config", dict(rotary_dim=32, intermediate_size=128,
                                           num_local_experts=8, num_experts_per_tok=2,
                                           pad_token_id=0, tie_word_embeddings=False)),
    # Gemma 4 E2B's shape (heads of 64 sliding, 128 full, one KV head): per-layer input
    # embeddings of 64, the last 3 of 6 layers KV-shared with double-wide MLPs
    "gemma4_e2b": ("Gemma4TextConfig", dict(
        num_hidden_layers=6, num_key_value_heads=1, global_head_dim=128, attention_k_eq_v=False,
        hidden_size_per_layer_input=64, vocab_size_per_layer_input=512, num_kv_shared_layers=3,
        use_double_wide_mlp=True, sliding_window=16, final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        pad_token_id=0, tie_word_embeddings=False)),
    # StableLM-2 12B's per-head q/k LayerNorm
    "stablelm_qk": ("StableLmConfig", dict(qk_layernorm=True, partial_rotary_factor=0.25,
                                           use_parallel_residual=True, layer_norm_eps=1e-5,
                                           tie_word_embeddings=False)),
}

# the quirk families of issue 29 item 4 on CUDA (tests/gpu/test_cuda_quirk_families.py), their
# tiny checkpoints' quirks (tests/checkpoints.py ARCHS) at head_dim 64. GPT-OSS: sinks, a sliding
# layer (window 16) then a full one, 4 experts of 128 (2 per token) with biases, the clamped
# SwiGLU at limit 2; Llama 4: a chunked RoPE layer (chunks of 16) with the L2 q/k norm and a dense
# MLP, then a NoPE layer with the temperature and the MoE (4 experts, top-1, a shared expert);
# Gemma 4: a sliding layer (window 16) then a full one with Gemma 4's released head of 512 (over
# the tuned CUDA kernels' 256) and one KV head whose values are its keys; its MoE form too.
_GEMMA4_256 = dict(head_dim=64, global_head_dim=512, num_global_key_value_heads=1,
                   attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=16,
                   final_logit_softcapping=10.0,
                   layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
                   tie_word_embeddings=False)
ARCHS_256.update({
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=128, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=16, swiglu_limit=2.0,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                                      "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 64},
                                     tie_word_embeddings=False)),
    "llama4": ("Llama4TextConfig", dict(intermediate_size=128, intermediate_size_mlp=768,
                                        num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                                        attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
                                        pad_token_id=0, tie_word_embeddings=False)),
    "gemma4": ("Gemma4TextConfig", _GEMMA4_256),
    "gemma4_moe": ("Gemma4TextConfig", dict(_GEMMA4_256, enable_moe_block=True, num_experts=4,
                                            top_k_experts=2, moe_intermediate_size=64)),
})

# hybrid linear attention at head_dim 64 (a compiled CUDA head size): 4 layers, 2 key heads of
# 32 serving 4 value heads of 32
_LINEAR_256 = dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                   tie_word_embeddings=False)
ARCHS_256.update({
    "qwen3_next": ("Qwen3NextConfig", dict(_LINEAR_256, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=128,
                                           shared_expert_intermediate_size=128)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(_LINEAR_256, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "linear_attention"])),
})

# Scaling after transformers' init: linear weights x 4 (the tiny family's x 8 is tuned for hidden
# 96), embeddings ~ N(0, 0.06^2), and the final norm's weights x 0.4 so the logits have a std of
# about 0.4-0.6. The GPU tests compare bf16-activation greedy tokens with the CPU's f32 activations
# and stop where the CPU's top-two logit margin is under 0.05; with logits this size bf16 rounding
# moves that margin by under ~0.04 (measured against transformers' own bf16 run), so the stop rule
# holds, and prompts still give varied continuations.
TINY_256_SCALE = 4.0
TINY_256_EMBED_STD = 0.06
TINY_256_FINAL_NORM_SCALE = 0.4


def tiny256_config(arch: str = "llama", **overrides):
    import transformers

    cls_name, arch_kwargs = ARCHS_256[arch]
    kwargs = {**TINY_256, **arch_kwargs, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def tiny256_checkpoint(directory, arch: str = "llama", dtype: str = "bfloat16", seed: int = 0,
                       scale: float = TINY_256_SCALE, embed_std: float = TINY_256_EMBED_STD,
                       final_norm_scale: float = TINY_256_FINAL_NORM_SCALE, **overrides) -> str:
    """Write a tiny-256 `arch` checkpoint (config overrides as keyword arguments) to `directory`
    with save_pretrained, in bfloat16 (default) or float32. Returns the directory as a string."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny256_config(arch, **overrides))
    scale_weights(model, scale=scale, seed=seed, embed_std=embed_std)
    family = arch.split("_moe")[0] if arch.startswith("gemma4") else arch
    if family in _ADJUST:       # the family's quirk weights (sinks, biases, layer scalars)
        _ADJUST[family][1](model, seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(final_norm_scale)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"dtype {dtype!r}: float32 or bfloat16")
    directory = str(directory)
    model.save_pretrained(directory)
    return directory

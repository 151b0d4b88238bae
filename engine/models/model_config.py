"""What a checkpoint's config.json says about the model graph, normalised across families.

Reads both config styles transformers has used: legacy `rope_theta` + `rope_scaling` and the v5
nested `rope_parameters`; the architecture-specific rules (Qwen2's fixed qkv bias, Qwen sliding
window layers, Qwen3 and Gemma-3 q/k norm, Gemma's layer types, soft-caps and query scale, Gemma-3's
local RoPE base, Phi-3's LongRoPE) follow transformers 5.x's own configuration and modeling code.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from engine.models.registry import ARCHITECTURES, BASE_MODELS, TEXT_MODELS
from engine.vision.config import (VISION_ARCHITECTURES, VisionConfig, parse_vision_config,
                                  text_config_of)
from engine.models.deepseek_config import (GROUPED_MOE_ARCHITECTURES, MLA_ARCHITECTURES,
                                           MLA_MODEL_TYPES, GroupedRouting,
                                           MlaConfig, parse_deepseek_moe, parse_mla, rope_is_neox)
from engine.models.registry import ARCHITECTURES, BASE_MODELS
from engine.models import family_config

# config.json without `architectures`: its model_type names the graph.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "phi3": "Phi3ForCausalLM", "glm4": "Glm4ForCausalLM",
                "stablelm": "StableLmForCausalLM", "phi": "PhiForCausalLM",
                "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "llama4_text": "Llama4ForCausalLM",
                "minimax_m2": "MiniMaxM2ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                **MLA_MODEL_TYPES}

# Architectures whose attention applies RMSNorm to each q/k head before RoPE.
_QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                  "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
_GEMMA_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

# The configuration classes' head_dim when config.json has none (Qwen3Config and the Gemma
# configs default to a fixed size, not hidden_size / heads).
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128, "Qwen3MoeForCausalLM": 128, "Gemma2ForCausalLM": 256,
                     "Gemma3ForCausalLM": 256, "Glm4ForCausalLM": 128, "GptOssForCausalLM": 64,
                     "MiniMaxM2ForCausalLM": 128, "Gemma4ForCausalLM": 256}

# hidden_act / hidden_activation names -> the gated activation op of the MLP.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}   # gelu_new: the tanh form


@dataclass(slots=True)
class RopeConfig:
    rope_type: str = "default"          # default | linear | dynamic | llama3 | yarn | longrope
    theta: float = 10000.0
    rot_dim: int = 0                    # rotated dims per head (head_dim * partial_rotary_factor)
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0        # llama3
    high_freq_factor: float = 4.0       # llama3
    beta_fast: float = 32.0             # yarn
    beta_slow: float = 1.0              # yarn
    mscale: float | None = None         # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: explicit cos/sin multiplier
    truncate: bool = True               # yarn: floor/ceil the correction range
    is_neox: bool = True                # rotate halves (HF rotate_half), not interleaved pairs
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original
    long_factor: tuple[float, ...] = ()   # context, and beyond it


@dataclass(slots=True)
class MoeConfig:
    num_experts: int
    top_k: int                          # experts per token
    intermediate_size: int              # each expert's
    normalize: bool                     # renormalise the top-k probabilities to sum to 1
    sparse_layers: list[bool]           # per layer: MoE (True) or the dense MLP
    shared_intermediate_size: int = 0   # the shared expert's (0: none)
    shared_expert_gate: bool = True     # Qwen2-MoE gates it by a sigmoid; DeepSeek's add it as is
    grouped: GroupedRouting | None = None  # DeepSeekMoE's router (engine/models/deepseek_config.py)
    clamped_swiglu: tuple[float, float] | None = None  # GPT-OSS's experts: (alpha, limit)


@dataclass(slots=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5) beside full-attention ones: each keeps a short
    causal convolution's last inputs and a recurrent state per sequence instead of K/V."""
    layer_types: list[str]              # per layer: "linear_attention" | "full_attention"
    num_k_heads: int
    num_v_heads: int                    # a multiple of num_k_heads (grouped value heads)
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int                    # the causal convolution's width
    split_projections: bool             # Qwen3.5: in_proj_qkv/z/b/a; Qwen3-Next: in_proj_qkvz/ba

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:          # the convolved channels: q, k and v
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    def state_floats(self) -> int:
        """float32 values one sequence's state holds over every linear layer: the convolution's
        last conv_kernel - 1 inputs and the (head_k_dim, head_v_dim) state of each value head."""
        per_layer = ((self.conv_kernel - 1) * self.conv_dim
                     + self.num_v_heads * self.head_k_dim * self.head_v_dim)
        return per_layer * self.num_linear_layers


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: list[int]          # per layer; 0 = full attention
    max_position_embeddings: int
    max_model_len: int                  # positions the RoPE cache covers (vLLM's derived length)
    rope: RopeConfig
    local_rope: RopeConfig | None = None  # RoPE of the sliding-window layers when theirs differs
    hidden_act: str = "silu"            # the MLP's gate activation: silu | gelu_tanh
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim's)
    attn_softcap: float = 0.0           # attention scores capped to c * tanh(s / c); 0 = off
    final_softcap: float = 0.0          # the same on the final logits
    parallel_residual: bool = False     # h += attn(norm(h)) + mlp(norm(h)) (StableLM)
    qk_layernorm: bool = False          # q/k LayerNorm with a weight per head (StableLM)
    dtype: str = "float32"              # the checkpoint's dtype name
    quantization: str | None = None     # quantization_config.quant_method, if any
    quantization_config: dict | None = None  # the whole quantization_config, for the loader
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoeConfig | None = None        # mixture-of-experts layers, if any
    has_lm_head: bool = True            # False: a headless transformer (LlamaModel, ...)
    vision: VisionConfig | None = None  # a vision-language model's vision tower (engine/vision/)
    # A tensor-parallel rank's config (engine/parallel/sharding.py): heads, sizes and vocab_size
    # are the rank's share, and this a TensorParallel saying of what; None: the whole model.
    tensor_parallel: object = None
    # A pipeline stage's config (engine/parallel/pipeline.py): its layers, renumbered from 0, and
    # this a PipelineStage saying which; None: every layer.
    pipeline: object = None
    linear_attention: LinearAttentionConfig | None = None  # hybrid models' gated DeltaNet layers
    family: object = None               # one family's own settings (engine/models/family_config.py)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged K/V cache (a hybrid model's full-attention layers; Gemma 4's
        layers that do not read another layer's cache)."""
        if isinstance(self.family, family_config.Gemma4Settings):
            return self.family.num_cache_layers
        if self.linear_attention is None:
            return self.num_hidden_layers
        return self.linear_attention.layer_types.count("full_attention")
    # Multi-head latent attention (DeepSeek-V2/V3): its cache is one "KV head" of the latent and
    # the rotary part (num_key_value_heads 1, head_dim mla.latent_dim), not K and V.
    mla: MlaConfig | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def kv_cache_elements_per_token(self) -> int:
        """Cached values per token and layer: K and V of every KV head, or MLA's latent."""
        if self.mla is not None:
            return self.mla.latent_dim
        if isinstance(self.family, family_config.Gemma4Settings):
            return 2 * self.family.cache_width(self.kv_size)
        return 2 * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str, yarn_scaling_factor: float | None = None) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {model_dir}")
        try:            # a bad config (not JSON, an unknown architecture) names its file
            with open(path) as f:
                config = cls.from_dict(json.load(f), yarn_scaling_factor=yarn_scaling_factor)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                for eos in _as_list(json.load(f).get("eos_token_id")):
                    if eos not in config.eos_token_ids:
                        config.eos_token_ids.append(eos)
        return config

    @classmethod
    def from_dict(cls, cfg: dict, yarn_scaling_factor: float | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs and cfg.get("model_type") in _MODEL_TYPES:
            archs = [_MODEL_TYPES[cfg["model_type"]]]
        arch = next((a for a in archs if a in ARCHITECTURES or a in BASE_MODELS
                     or a in TEXT_MODELS), None)
        if arch in VISION_ARCHITECTURES:   # its language model by its causal LM's rules
            config = cls.from_dict(text_config_of(arch, cfg), yarn_scaling_factor)
            config.architecture = arch
            config.vision = parse_vision_config(arch, cfg, config.rope.rot_dim)
            return config
        if arch is None:
            known = sorted([*ARCHITECTURES, *BASE_MODELS, *TEXT_MODELS])
            raise ValueError(f"unsupported architecture {', '.join(archs) or '(none given)'}; "
                             f"supported: {', '.join(known)}")
        if arch in TEXT_MODELS:      # a multimodal checkpoint: its language model's config
            outer = {k: cfg[k] for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id",
                                         "quantization_config", "dtype") if k in cfg}
            cfg = {**(cfg.get("text_config") or {}), **outer}
            arch = TEXT_MODELS[arch]
        # A headless transformer follows its causal LM's config rules (biases, q/k norm, ...).
        has_lm_head = arch not in BASE_MODELS
        arch = BASE_MODELS.get(arch, arch)
        if arch in _HYBRID_DEFAULTS:      # the config classes' defaults for keys left out
            cfg = {**_HYBRID_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch, hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        max_pos = cfg.get("max_position_embeddings", 2048)
        mla = parse_mla(arch, cfg) if arch in MLA_ARCHITECTURES else None
        if mla is not None:   # one cached "head": the latent and the rotary part
            num_kv_heads, head_dim = 1, mla.latent_dim
            if cfg.get("mlp_bias"):
                raise ValueError(f"{arch}: mlp_bias is not supported")

        if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
            qkv_bias, o_bias = True, False
        elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            qkv_bias = o_bias = False
        elif arch == "Glm4ForCausalLM":     # attention_bias (default on) covers q/k/v only
            qkv_bias, o_bias = bool(cfg.get("attention_bias", True)), False
        elif arch == "StableLmForCausalLM":
            qkv_bias, o_bias = bool(cfg.get("use_qkv_bias", False)), False
        elif arch == "Glm4MoeForCausalLM":  # attention_bias covers q/k/v only
            qkv_bias, o_bias = bool(cfg.get("attention_bias", False)), False
        elif arch == "GptOssForCausalLM":   # attention_bias (default on) covers o_proj too
            qkv_bias = o_bias = bool(cfg.get("attention_bias", True))
        elif arch == "PhiForCausalLM":      # biases on q/k/v and dense, always
            qkv_bias = o_bias = True
            if cfg.get("qk_layernorm"):
                raise ValueError(f"{arch}: qk_layernorm (a LayerNorm with bias on each q/k "
                                 "head) is not supported")
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False))

        act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act_name not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {act_name!r} for {arch}; "
                             f"supported: {', '.join(sorted(_ACTIVATIONS))}")
        rope, local_rope = _ropes(arch, cfg, head_dim, max_pos, yarn_scaling_factor, mla)
        gemma = arch in _GEMMA_ARCHS
        eos = _as_list(cfg.get("eos_token_id"))
        return cls(
            architecture=arch, hidden_size=hidden, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
            intermediate_size=_dense_intermediate_size(arch, cfg), vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
            qk_norm=arch in _QK_NORM_ARCHS
            or arch == "Glm4MoeForCausalLM" and bool(cfg.get("use_qk_norm", False)),
            sliding_windows=_sliding_windows(arch, cfg, num_layers),
            max_position_embeddings=max_pos, max_model_len=_rope_max_len(rope, max_pos), rope=rope,
            local_rope=local_rope, hidden_act=_ACTIVATIONS[act_name],
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim) if gemma
            else None,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0)
            if gemma or arch == "Gemma4ForCausalLM" else 0.0,
            parallel_residual=arch == "PhiForCausalLM"
            or bool(cfg.get("use_parallel_residual", False)),
            qk_layernorm=arch == "StableLmForCausalLM" and bool(cfg.get("qk_layernorm", False)),
            dtype=_dtype_name(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            quantization=(cfg.get("quantization_config") or {}).get("quant_method"),
            quantization_config=cfg.get("quantization_config"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos, has_lm_head=has_lm_head,
            moe=parse_moe(arch, cfg, num_layers),
            linear_attention=parse_linear_attention(arch, cfg, num_layers), mla=mla,
            family=_family_settings(arch, cfg, num_layers))


def _dense_intermediate_size(arch: str, cfg: dict) -> int:
    """The dense MLP's width (Llama 4's intermediate_size is its experts')."""
    if arch == "Llama4ForCausalLM":
        return int(cfg.get("intermediate_size_mlp", 16384))
    return cfg["intermediate_size"]


def _family_settings(arch: str, cfg: dict, num_layers: int):
    if arch == "Llama4ForCausalLM":
        return family_config.parse_llama4(cfg, num_layers)
    if arch == "Gemma4ForCausalLM":
        head_dim = cfg.get("head_dim") or _DEFAULT_HEAD_DIM[arch]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        return family_config.parse_gemma4(cfg, num_layers, head_dim, kv_heads)
    return None


# Config-class defaults transformers 5 fills in when config.json leaves a key out.
_MOE_DEFAULTS = {
    "Qwen2MoeForCausalLM": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                                norm_topk_prob=False, shared_expert_intermediate_size=5632),
    "Qwen3MoeForCausalLM": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                norm_topk_prob=False, shared_expert_intermediate_size=0),
    "Qwen3NextForCausalLM": dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                                 norm_topk_prob=True, shared_expert_intermediate_size=512),
    # Qwen3.5-MoE: every layer sparse, the top-k always renormalised (its config has neither
    # decoder_sparse_step, mlp_only_layers nor norm_topk_prob)
    "Qwen3_5MoeForCausalLM": dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                  norm_topk_prob=True, shared_expert_intermediate_size=512,
                                  decoder_sparse_step=1, mlp_only_layers=[]),
}

# Qwen3NextConfig's (and the Qwen3.5 text configs') defaults for the keys a config.json may leave
# out; partial_rotary_factor as their __post_init__ sets it.
_HYBRID_COMMON = dict(head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_num_key_heads=16,
                      linear_num_value_heads=32, partial_rotary_factor=0.25)
_HYBRID_DEFAULTS = {
    "Qwen3NextForCausalLM": dict(_HYBRID_COMMON, intermediate_size=5632),
    "Qwen3_5ForCausalLM": dict(_HYBRID_COMMON, intermediate_size=12288),
    "Qwen3_5MoeForCausalLM": dict(_HYBRID_COMMON, intermediate_size=0),   # no dense MLP
}


def parse_linear_attention(arch: str, cfg: dict, num_layers: int) -> LinearAttentionConfig | None:
    """The gated DeltaNet layers as Qwen3NextConfig reads them: layer_types, else every
    full_attention_interval-th layer (default 4) full attention and the others linear."""
    if arch not in _HYBRID_DEFAULTS:
        return None
    interval = int(cfg.get("full_attention_interval") or 4)
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types: unsupported layer type {unknown[0]!r}; supported: "
                         "linear_attention, full_attention")
    la = LinearAttentionConfig(
        list(layer_types), int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
        int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]),
        int(cfg["linear_conv_kernel_dim"]), split_projections=arch != "Qwen3NextForCausalLM")
    if la.num_v_heads % la.num_k_heads:
        raise ValueError(f"linear_num_value_heads {la.num_v_heads} is not a multiple of "
                         f"linear_num_key_heads {la.num_k_heads}")
    if la.conv_kernel < 1:
        raise ValueError(f"linear_conv_kernel_dim must be at least 1, got {la.conv_kernel}")
    return la


# GptOssConfig.__post_init__'s RoPE when config.json has none.
_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)


def parse_moe(arch: str, cfg: dict, num_layers: int) -> MoeConfig | None:
    """The MoE settings as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE read them."""
    if arch == "GptOssForCausalLM":
        # GptOssTopKRouter: softmax over the top-k logits (= renormalised), every layer sparse;
        # experts of intermediate_size with the clamped SwiGLU.
        return MoeConfig(int(cfg.get("num_local_experts", 128)),
                         int(cfg.get("num_experts_per_tok", 4)), int(cfg["intermediate_size"]),
                         True, [True] * num_layers,
                         clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)),
                                         float(cfg.get("swiglu_limit", 7.0))))
    if arch == "Llama4ForCausalLM":
        # Llama4TextMoe: sigmoid of each token's top-k router logits scales the expert's input;
        # a shared expert of intermediate_size, ungated; dense layers between (moe_layers).
        size = int(cfg.get("intermediate_size", 8192))
        return MoeConfig(int(cfg.get("num_local_experts", 16)),
                         int(cfg.get("num_experts_per_tok", 1)), size, False,
                         family_config.llama4_moe_layers(cfg, num_layers),
                         shared_intermediate_size=size, shared_expert_gate=False)
    if arch == "MiniMaxM2ForCausalLM":
        # MiniMaxM2TopKRouter: sigmoid scores, the choice by score + e_score_correction_bias,
        # the chosen scores renormalised; no groups, no scaling, every layer sparse.
        return MoeConfig(int(cfg.get("num_local_experts", 256)),
                         int(cfg.get("num_experts_per_tok", 8)),
                         int(cfg.get("intermediate_size", 1536)), True, [True] * num_layers,
                         grouped=GroupedRouting("sigmoid", "greedy", 1, 1, 1.0, True))
    if arch == "Gemma4ForCausalLM":
        # Gemma4TextRouter: softmax, top-k renormalised (then per_expert_scale, gemma4.py); with
        # enable_moe_block every layer has the experts beside its dense MLP
        if not cfg.get("enable_moe_block"):
            return None
        return MoeConfig(int(cfg["num_experts"]), int(cfg["top_k_experts"]),
                         int(cfg["moe_intermediate_size"]), True, [True] * num_layers)
    if arch == "MixtralForCausalLM":      # softmax, top-k, always renormalised; every layer
        return MoeConfig(int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2)),
                         int(cfg["intermediate_size"]), True, [True] * num_layers)
    if arch in GROUPED_MOE_ARCHITECTURES:
        return MoeConfig(**parse_deepseek_moe(arch, cfg, num_layers))
    if arch not in _MOE_DEFAULTS:
        return None
    get = {**_MOE_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}.get
    # A layer is sparse unless listed in mlp_only_layers, and then only every
    # decoder_sparse_step-th one (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer).
    step = int(get("decoder_sparse_step", 1) or 1)
    dense = set(get("mlp_only_layers", []) or [])
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; checkpoints say
    # num_experts.
    num_experts = int(cfg.get("num_experts") or get("num_local_experts", get("num_experts")))
    sparse = [i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    if arch == "Qwen3_5MoeForCausalLM":   # Qwen3_5MoeDecoderLayer: always the sparse block,
        sparse = [True] * num_layers      # whose router always renormalises
        cfg = {**cfg, "norm_topk_prob": True}
        get = {**_MOE_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}.get
    return MoeConfig(num_experts, int(get("num_experts_per_tok")), int(get("moe_intermediate_size")),
                     bool(get("norm_topk_prob")), sparse, int(get("shared_expert_intermediate_size")))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dtype_name(value) -> str:
    name = str(value).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
            "fp32": "float32"}.get(name, name)


def _sliding_windows(arch: str, cfg: dict, num_layers: int) -> list[int]:
    """Per-layer attention window, as transformers' modeling code applies it (0 = full)."""
    window = int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window", False) else 0
    if arch == "Qwen3MoeForCausalLM":     # one mask for every layer, as Mixtral and Mistral
        return [window] * num_layers
    if arch == "Qwen2MoeForCausalLM":
        # Qwen2MoeConfig.__post_init__: layer_types, when absent, marks even-indexed layers
        # below max_window_layers as sliding.
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 and i < cfg.get("max_window_layers", 28) and window
            else "full_attention" for i in range(num_layers)]
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        # MistralModel builds one mask from config.sliding_window for every layer (layer_types is
        # ignored by Mistral; transformers warns to use Ministral for alternating patterns).
        return [int(cfg.get("sliding_window") or 0)] * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen2Config/Qwen3Config.__post_init__: sliding_window is nulled unless use_sliding_window;
        # layer_types, when absent, marks layers i >= max_window_layers as sliding.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
            else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return [int(window) if t == "sliding_attention" and window else 0 for t in layer_types]
    if arch in _GEMMA_ARCHS:
        # Gemma2Config / Gemma3TextConfig.__post_init__: absent layer_types make every
        # `sliding_window_pattern`-th layer (2 for Gemma-2, 6 for Gemma-3) full, the rest sliding.
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        window = int(cfg.get("sliding_window") or 0)
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    if arch == "GptOssForCausalLM":
        # GptOssConfig.__post_init__: absent layer_types alternate sliding (even layers) and full.
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        window = int(cfg.get("sliding_window") or 128)
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    if arch == "Gemma4ForCausalLM":     # Gemma4TextConfig: the full layers as parse_gemma4 has them
        full = family_config.parse_gemma4(cfg, num_layers, 1, 1).full_layers
        return [0 if f else int(cfg.get("sliding_window") or 512) for f in full]
    if arch == "Phi3ForCausalLM":
        # Phi3Attention passes config.sliding_window to every layer.
        return [int(cfg.get("sliding_window") or 0)] * num_layers
    return [0] * num_layers


def _ropes(arch: str, cfg: dict, head_dim: int, max_pos: int, yarn_scaling_factor: float | None,
           mla: MlaConfig | None = None) -> tuple[RopeConfig, RopeConfig | None]:
    """(RoPE of the full-attention layers, RoPE of the sliding layers when it differs)."""
    if mla is not None:   # only the qk_rope_head_dim part of each head rotates
        rope = parse_rope(cfg, mla.qk_rope_head_dim, max_pos, yarn_scaling_factor)
        rope.is_neox = rope_is_neox(arch, cfg)
        return rope, None
    if arch == "StableLmForCausalLM":     # StableLmConfig: a quarter of the head by default
        cfg = {"partial_rotary_factor": 0.25, **cfg}
    if arch == "GptOssForCausalLM" and not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        cfg = {**cfg, "rope_parameters": dict(_GPT_OSS_ROPE, rope_theta=cfg.get("rope_theta")
                                              or 150000.0)}
    if arch in ("PhiForCausalLM", "Glm4MoeForCausalLM"):   # their configs: half of it
        cfg = {"partial_rotary_factor": 0.5, **cfg}
    if arch == "Gemma4ForCausalLM":     # the sliding layers' RoPE; gemma4.py builds the full ones'
        if yarn_scaling_factor is not None:
            raise ValueError(f"{arch}: a YaRN scaling factor is not supported (its full layers' "
                             "RoPE is proportional)")
        sliding = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        return parse_rope({"rope_theta": sliding.get("rope_theta", 10_000.0)}, head_dim,
                          max_pos), None
    if arch == "MiniMaxM2ForCausalLM":
        # MiniMaxM2Config: rotary_dim gives the rotated part when partial_rotary_factor is absent
        cfg = {"rope_theta": 5_000_000.0, **cfg}
        if cfg.get("rotary_dim") and not cfg.get("partial_rotary_factor"):
            cfg["partial_rotary_factor"] = cfg["rotary_dim"] / head_dim
    if arch == "Llama4ForCausalLM":     # rotated as complex pairs (x[2i], x[2i+1])
        rope = parse_rope({"rope_theta": 500000.0, **cfg}, head_dim, max_pos,
                          yarn_scaling_factor)
        rope.is_neox = False
        return rope, None
    if arch == "Glm4ForCausalLM":
        # Glm4Config: half the head rotates by default, in interleaved pairs (x[2i], x[2i+1]).
        cfg = {"partial_rotary_factor": 0.5, **cfg}
        rope = parse_rope(cfg, head_dim, max_pos, yarn_scaling_factor)
        rope.is_neox = False
        return rope, None
    if arch != "Gemma3ForCausalLM":
        return parse_rope(cfg, head_dim, max_pos, yarn_scaling_factor), None
    # Gemma3TextConfig: nested per-layer-type rope_parameters, or the legacy rope_theta (global,
    # default 1e6) + rope_local_base_freq (default 1e4), rope_scaling applying to global layers.
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta"))
        local = {"rope_theta": cfg.get("rope_local_base_freq")}
    full["rope_theta"] = full.get("rope_theta") or 1_000_000.0
    local["rope_theta"] = local.get("rope_theta") or 10_000.0
    return (parse_rope({"rope_parameters": full}, head_dim, max_pos, yarn_scaling_factor),
            parse_rope({"rope_parameters": local}, head_dim, max_pos))


def parse_rope(cfg: dict, head_dim: int, max_pos: int,
               yarn_scaling_factor: float | None = None) -> RopeConfig:
    """RoPE settings from either config form; `rope_scaling` wins over `rope_parameters` as in
    transformers' convert_rope_params_to_dict."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0
    rope = RopeConfig(rope_type=rope_type, theta=theta, rot_dim=int(head_dim * partial))
    if rope_type == "su":           # Phi-3's early name for LongRoPE (Phi3Config renames it)
        rope_type = rope.rope_type = "longrope"
    if rope_type in ("llama3", "yarn", "longrope"):
        # A top-level original_max_position_embeddings takes priority (transformers, Phi3 case).
        rope.original_max_position_embeddings = int(
            cfg.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings") or max_pos)

    if yarn_scaling_factor is not None:
        if rope_type != "yarn":
            params = {}
            rope.original_max_position_embeddings = max_pos
        rope.rope_type = rope_type = "yarn"
        params["factor"] = float(yarn_scaling_factor)

    if rope_type == "default":
        return rope
    if rope_type in ("linear", "dynamic"):
        rope.factor = float(params["factor"])
    elif rope_type == "llama3":
        rope.factor = float(params["factor"])
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
    elif rope_type == "yarn":
        factor = params.get("factor")
        rope.factor = float(factor if factor is not None
                            else max_pos / rope.original_max_position_embeddings)
        rope.beta_fast = float(params.get("beta_fast") or 32)
        rope.beta_slow = float(params.get("beta_slow") or 1)
        rope.mscale = params.get("mscale")
        rope.mscale_all_dim = params.get("mscale_all_dim")
        rope.attention_factor = params.get("attention_factor")
        rope.truncate = bool(params.get("truncate", True))
    elif rope_type == "longrope":
        # factor defaults to max_position_embeddings / original (transformers' Phi-3 note).
        factor = params.get("factor")
        rope.factor = float(factor if factor is not None
                            else max_pos / rope.original_max_position_embeddings)
        rope.attention_factor = params.get("attention_factor")
        rope.short_factor = tuple(float(f) for f in params["short_factor"])
        rope.long_factor = tuple(float(f) for f in params["long_factor"])
        for name in ("short_factor", "long_factor"):
            if len(getattr(rope, name)) != rope.rot_dim // 2:
                raise ValueError(f"rope {name} has {len(getattr(rope, name))} entries, expected "
                                 f"rotary dims / 2 = {rope.rot_dim // 2}")
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}; "
                         "supported: default, linear, dynamic, llama3, yarn, longrope")
    return rope


def _rope_max_len(rope: RopeConfig, max_pos: int) -> int:
    """The context the scaled RoPE is meant for, as vLLM derives it: linear/dynamic stretch
    max_position_embeddings by factor, yarn stretches the original context, llama3 keeps it."""
    if rope.rope_type in ("linear", "dynamic"):
        return int(max_pos * rope.factor)
    if rope.rope_type == "yarn":
        return max(max_pos, int(rope.original_max_position_embeddings * rope.factor))
    return max_pos

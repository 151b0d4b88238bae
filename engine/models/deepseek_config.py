"""The config keys of the multi-head latent attention (MLA) families: DeepSeek-V2, DeepSeek-V3 and
GLM-4.7-Flash (Glm4MoeLiteForCausalLM), read as transformers 5's DeepseekV2/V3 and Glm4MoeLite
configuration and modeling code reads them.

MLA: queries come from q_proj (q_lora_rank absent, V2-Lite) or q_a_proj -> RMSNorm -> q_b_proj;
keys and values from a per-token latent, kv_a_proj_with_mqa's first kv_lora_rank outputs after
kv_a_layernorm, up-projected per head by kv_b_proj, beside a rotary part (qk_rope_head_dim) shared
by all heads. The KV cache holds the latent and the rotated rotary part: kv_lora_rank +
qk_rope_head_dim values per token and layer, whatever the head count.

The softmax scale is qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when the RoPE
is scaled and mscale_all_dim is set (transformers' yarn_apply_mscale); the cos/sin multiplier
(mscale / mscale_all_dim) is the RoPE cache's, as for any YaRN model.

DeepSeekMoE routing, per transformers' routers:
  V2 (DeepseekV2TopkRouter): softmax scores; topk_method "greedy" takes the top_k, and
    "group_limited_greedy" first keeps the topk_group groups with the highest maximum score; the
    weights are the scores, never renormalised (V2's router ignores norm_topk_prob), times
    routed_scaling_factor.
  V3 and GLM-4.7-Flash (DeepseekV3TopkRouter): sigmoid scores; the choice adds
    e_score_correction_bias, keeps the topk_group groups with the highest sum of their two best
    biased scores, and takes the top_k of those; the weights are the unbiased scores,
    renormalised when norm_topk_prob (sum + 1e-20), times routed_scaling_factor.
The shared experts (n_shared_experts of moe_intermediate_size, one MLP) are added ungated. Layer i
is sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek's and vLLM's rule;
transformers ignores moe_layer_freq, which is 1 in every released checkpoint); GLM-4.7-Flash
reads mlp_layer_types ("dense"/"sparse", default: the first layer dense).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
MLA_MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                   "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
# DeepSeekMoE's router and shared experts beside ordinary attention (GLM-4.5/4.6:
# engine/models/glm4_moe.py): V3's rules, first_k_dense_replace.
GROUPED_MOE_ARCHITECTURES = (*MLA_ARCHITECTURES, "Glm4MoeForCausalLM")

# transformers 5's configuration defaults for the keys below, per architecture.
_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407,
        num_experts_per_tok=None, routed_scaling_factor=1.0, topk_method="greedy", n_group=None,
        topk_group=None, norm_topk_prob=False, first_k_dense_replace=0, rope_interleave=True),
    "DeepseekV3ForCausalLM": dict(
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
        num_experts_per_tok=8, routed_scaling_factor=2.5, topk_method="noaux_tc", n_group=8,
        topk_group=4, norm_topk_prob=True, first_k_dense_replace=3, rope_interleave=True,
        num_nextn_predict_layers=1),
    "Glm4MoeLiteForCausalLM": dict(
        kv_lora_rank=512, q_lora_rank=768, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, n_routed_experts=64, n_shared_experts=1, moe_intermediate_size=1536,
        num_experts_per_tok=4, routed_scaling_factor=1.8, topk_method="noaux_tc", n_group=1,
        topk_group=1, norm_topk_prob=True, rope_interleave=True),
    "Glm4MoeForCausalLM": dict(
        n_routed_experts=128, n_shared_experts=1, moe_intermediate_size=1408,
        num_experts_per_tok=8, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=1),
}


@dataclass(slots=True)
class MlaConfig:
    q_lora_rank: int | None            # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int                  # the latent's size
    qk_nope_head_dim: int              # per head: the query/key part without RoPE
    qk_rope_head_dim: int              # per head: the rotated part (one key part for all heads)
    v_head_dim: int
    softmax_scale: float
    attention_bias: bool               # q_a_proj / kv_a_proj_with_mqa / o_proj biases
    num_mtp_layers: int = 0            # multi-token-prediction layers after the decoder's

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token and layer: the latent and the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(slots=True)
class GroupedRouting:
    """DeepSeekMoE's router (module docstring)."""
    scoring: str                       # "softmax" (V2) | "sigmoid" (V3, GLM-4.7-Flash)
    method: str                        # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    correction_bias: bool              # e_score_correction_bias (sigmoid routers)


def _getter(arch: str, cfg: dict):
    merged = {**_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}
    return merged.get


def _rope_params(cfg: dict) -> dict:
    return dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})


def parse_mla(arch: str, cfg: dict) -> MlaConfig:
    get = _getter(arch, cfg)
    q_lora = cfg.get("q_lora_rank", _DEFAULTS[arch]["q_lora_rank"])
    nope, rope, v = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim")), int(get("v_head_dim"))
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim {rope} must be even (RoPE rotates pairs)")
    scale = (nope + rope) ** -0.5
    params = _rope_params(cfg)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    num_mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers")
                  or _DEFAULTS[arch].get("num_nextn_predict_layers", 0))
    return MlaConfig(None if q_lora is None else int(q_lora), int(get("kv_lora_rank")), nope, rope,
                     v, scale, bool(cfg.get("attention_bias", False)), num_mtp)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_is_neox(arch: str, cfg: dict) -> bool:
    """V2 rotates interleaved pairs (x[2i], x[2i+1]) as complex numbers; V3 and GLM-4.7-Flash do
    too with rope_interleave (their default), else halves. V3's interleaved form writes its
    output de-interleaved, a permutation applied to queries and keys alike, so the scores are the
    pairwise rotation's."""
    if arch == "DeepseekV2ForCausalLM":
        return False
    return not bool(_getter(arch, cfg)("rope_interleave"))


def parse_deepseek_moe(arch: str, cfg: dict, num_layers: int) -> dict:
    """MoeConfig's keyword arguments for an MLA family (module docstring)."""
    get = _getter(arch, cfg)
    num_experts = int(get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    top_k = get("num_experts_per_tok")
    if not num_experts or top_k is None:
        raise ValueError(f"{arch}: n_routed_experts and num_experts_per_tok are needed")
    if arch == "Glm4MoeLiteForCausalLM":
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
        if len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types {types}: need {num_layers} of dense/sparse")
        sparse = [t == "sparse" for t in types]
    else:
        first_dense = int(get("first_k_dense_replace") or 0)
        freq = int(get("moe_layer_freq") or 1)
        sparse = [i >= first_dense and i % freq == 0 for i in range(num_layers)]
    if arch == "DeepseekV2ForCausalLM":
        method = get("topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{arch}: topk_method {method!r}; transformers' V2 router knows "
                             f"greedy and group_limited_greedy")
        scoring, normalize, bias = "softmax", False, False
    else:
        method, scoring, normalize, bias = "noaux_tc", "sigmoid", bool(get("norm_topk_prob")), True
    groups, topk_groups = int(get("n_group") or 1), int(get("topk_group") or 1)
    if method != "greedy":
        if num_experts % groups or not 1 <= topk_groups <= groups:
            raise ValueError(f"{arch}: {num_experts} experts in n_group {groups} groups, "
                             f"topk_group {topk_groups}: need equal groups and 1 <= topk_group "
                             f"<= n_group")
        if method == "noaux_tc" and num_experts // groups < 2:
            raise ValueError(f"{arch}: each of the n_group {groups} groups needs 2 or more of "
                             f"the {num_experts} experts (a group's score sums its best two)")
    shared = int(get("n_shared_experts") or 0) * int(get("moe_intermediate_size"))
    routing = GroupedRouting(scoring, method, groups, topk_groups,
                             float(get("routed_scaling_factor")), bias)
    return dict(num_experts=num_experts, top_k=int(top_k),
                intermediate_size=int(get("moe_intermediate_size")), normalize=normalize,
                sparse_layers=sparse, shared_intermediate_size=shared, shared_expert_gate=False,
                grouped=routing)

"""GGUF `deepseek2` files (DeepSeek-V2/V3, GLM-4.7-Flash) as llama.cpp's convert_hf_to_gguf.py
writes them and llama.cpp reads them back (src/models/deepseek2.cpp), as the config and the
Hugging Face tensors of engine/models/deepseek.py.

What the converter changes, put back here:
- kv_b_proj is split per head into attn_k_b (Hq, L, N: each head's key part, transposed) and
  attn_v_b (Hq, V, L); the two are joined again into kv_b_proj (Hq * (N + V), L), in float
  (MLA splits it per head itself; a quantized pair is dequantized). Old files' unsplit attn_kv_b
  is kv_b_proj as it is (in float as well). The engine's loader takes kv_b_proj deferred (KvB):
  a tensor-parallel rank's cut by head (engine/parallel/sharding_mla.py) and a pipeline stage's
  choice of layers are made before anything is read, so each rank dequantizes only its heads'
  slices of its layers' attn_k_b / attn_v_b (or attn_kv_b rows) from the memory-mapped file.
- The cache layout is written as MQA: head_count_kv 1, key_length L + R, value_length L; the
  per-head sizes are key_length_mla (N + R) and value_length_mla (V), the rotary part
  rope.dimension_count (R).
- The router: expert_gating_func 2 (sigmoid) is DeepSeek-V3's (DeepseekV3ForCausalLM: the
  correction bias exp_probs_b, groups), 1 or none DeepSeek-V2's softmax (greedy, or
  group_limited_greedy when the file limits groups), except that llama.cpp reads a file without
  the key as sigmoid for GLM-4.7-Flash's shapes (47 or 48 layers, vocabulary 154880), and so do
  we. expert_weights_scale is routed_scaling_factor, expert_weights_norm norm_topk_prob,
  leading_dense_block_count first_k_dense_replace.
- YaRN: the converter stores 0.1 * mscale_all_dim as rope.scaling.yarn_log_multiplier, and
  llama.cpp assumes mscale = mscale_all_dim (its cos/sin factor is 1, DeepSeek's releases' case);
  so do we.
- Multi-token-prediction layers (nextn_predict_layers, GLM-4.7-Flash's files): block_count counts
  them; they come back as model.layers.{N}.* (the blk.N.nextn.* tensors as eh_proj, enorm, hnorm,
  embed_tokens, shared_head.head, shared_head.norm) and the model keeps them unused.
RoPE: llama.cpp rotates DeepSeek's heads in interleaved pairs, as transformers does
(rope_interleave); the converter permutes no rows.
"""
from __future__ import annotations

import re

import numpy as np
from gguf import ReaderTensor, quants

ARCH = "deepseek2"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm",
                "embed_tokens": "embed_tokens", "shared_head_head": "shared_head.head",
                "shared_head_norm": "shared_head.norm"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_NEXTN_RE = re.compile(r"^blk\.(\d+)\.nextn\.(\w+)\.weight$")
_KV_B_PARTS = ("attn_k_b", "attn_v_b")
_GLM_LITE = ((47, 48), 154880)       # llama.cpp's sigmoid default: layers, vocabulary


def config(path: str, meta, tensors: dict, base: dict) -> dict:
    """The config.json keys of a deepseek2 file over `base` (the keys every architecture
    shares: hidden size, heads, vocabulary, RoPE base and scaling, norms)."""
    def need(key):
        return int(meta.require(key))

    nextn = int(meta.get("nextn_predict_layers") or 0)
    layers = base["num_hidden_layers"] - nextn
    R = need("rope.dimension_count")
    nope = need("attention.key_length_mla") - R
    kv_lora = need("attention.kv_lora_rank")
    if need("attention.key_length") != kv_lora + R or need("attention.value_length") != kv_lora:
        raise ValueError(f"{path}: key_length / value_length are not kv_lora_rank + "
                         f"rope.dimension_count / kv_lora_rank: not an MLA file Taper reads")
    gating = meta.get("expert_gating_func")
    if gating is None:
        glm_lite = layers in _GLM_LITE[0] and base["vocab_size"] == _GLM_LITE[1]
        gating = 2 if glm_lite else 1
    if gating not in (1, 2):
        raise ValueError(f"{path}: deepseek2.expert_gating_func {gating} is not supported "
                         f"(1 softmax, 2 sigmoid)")
    groups = int(meta.get("expert_group_count") or 1)
    groups_used = int(meta.get("expert_group_used_count") or groups)
    out = {k: v for k, v in base.items() if k not in ("head_dim", "partial_rotary_factor")}
    out.update(
        architectures=["DeepseekV3ForCausalLM" if gating == 2 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if gating == 2 else "deepseek_v2",
        num_hidden_layers=layers, num_key_value_heads=base["num_attention_heads"],
        q_lora_rank=meta.get("attention.q_lora_rank"), kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope, qk_rope_head_dim=R,
        v_head_dim=need("attention.value_length_mla"),
        n_routed_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
        moe_intermediate_size=int(meta.uniform("expert_feed_forward_length")),
        n_shared_experts=int(meta.get("expert_shared_count") or 0),
        routed_scaling_factor=float(meta.get("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
        first_k_dense_replace=int(meta.get("leading_dense_block_count") or 0),
        n_group=groups, topk_group=groups_used, num_nextn_predict_layers=nextn,
        attention_bias="blk.0.attn_kv_a_mqa.bias" in tensors)
    if gating == 1:
        out["topk_method"] = "group_limited_greedy" if groups_used < groups else "greedy"
    scaling = base.get("rope_scaling")
    log_mul = meta.get("rope.scaling.yarn_log_multiplier")
    if scaling and scaling.get("rope_type") == "yarn" and log_mul:
        m = float(np.float32(log_mul) / np.float32(0.1))
        scaling = {**scaling, "mscale": round(m, 6), "mscale_all_dim": round(m, 6)}
        scaling.pop("attention_factor", None)
        out["rope_scaling"] = scaling
    return out


def hf_weights(name: str, weight) -> dict:
    """{Hugging Face name: value} of GGUF tensor `name` (not the merged experts, which
    engine/loader/gguf.py splits); attn_k_b / attn_v_b (given as the file's tensors, unread)
    under provisional names that join_kv_b turns into kv_b_proj, as it turns an old file's
    attn_kv_b (unread as well)."""
    if name in _GLOBAL_NAMES:
        return {_GLOBAL_NAMES[name]: weight}
    m = _NEXTN_RE.match(name)
    if m:
        if m.group(2) not in _NEXTN_NAMES:
            raise ValueError(f"GGUF tensor {name}: unknown multi-token-prediction tensor")
        return {f"model.layers.{m.group(1)}.{_NEXTN_NAMES[m.group(2)]}.weight": weight}
    m = _LAYER_RE.match(name)
    if m is None:
        return {name: weight}
    layer, kind, suffix = m.groups()
    p = f"model.layers.{layer}."
    if kind == "exp_probs_b":
        return {f"{p}mlp.gate.e_score_correction_bias": weight}
    if kind in _KV_B_PARTS:
        return {f"{p}self_attn.{kind}": weight}
    if kind not in _LAYER_NAMES:
        return {name: weight}
    return {f"{p}{_LAYER_NAMES[kind]}.{suffix}": weight}


def is_kv_b(name: str) -> bool:
    """Whether GGUF tensor `name` is attn_k_b, attn_v_b or an old file's attn_kv_b, handed on
    as the file's tensor: join_kv_b reads it into kv_b_proj in float32 (MLA splits it per
    head), or defers that to the rank's cut."""
    m = _LAYER_RE.match(name)
    return m is not None and m.group(2) in (*_KV_B_PARTS, "attn_kv_b")


def _dims(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


class KvB:
    """One layer's kv_b_proj (Hq * (N + V), L) in float32, or its rows [r0, r1), not yet read.
    From the per-head pair attn_k_b (Hq, L, N) and attn_v_b (Hq, V, L) (rows along whole
    heads): read() dequantizes those heads' slices (whole rows of the file's tensors, blocks and
    all) and joins them, head h's rows its key part transposed, then its value part. From an
    old file's unsplit attn_kv_b: its rows, dequantized (the blocks run along L)."""

    def __init__(self, name: str, parts: tuple, rows: tuple[int, int] | None = None):
        self.name, self.parts = name, parts
        if len(parts) == 2:
            k_b, v_b = parts
            if len(k_b.shape) != 3 or len(v_b.shape) != 3:
                raise ValueError(f"GGUF: {name} {_dims(k_b)} and attn_v_b {_dims(v_b)} are not "
                                 f"(heads, kv_lora_rank, nope) and (heads, v, kv_lora_rank)")
            (Hq, L, N), (Hv, V, Lv) = _dims(k_b), _dims(v_b)
            if (Hq, L) != (Hv, Lv):
                raise ValueError(f"GGUF: {name} {(Hq, L, N)} and attn_v_b {(Hv, V, Lv)} are not "
                                 f"(heads, kv_lora_rank, nope) and (heads, v, kv_lora_rank)")
            self.per_head, self.widths, total = N + V, (N, V), Hq * (N + V)
        else:
            (kv_b,) = parts
            total, L = _dims(kv_b)
            self.per_head = 1           # (any rows: a cut's are whole heads' anyway)
        self.rows = rows or (0, total)
        self.shape = (self.rows[1] - self.rows[0], L)
        self.dtype = np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        return 2

    def take_cut(self, cut) -> "KvB":
        """The rows of a tensor-parallel Cut (engine/parallel/cuts.py), whole heads, still
        unread."""
        a, b = cut.ranges[0]
        if (cut.axis != 0 or len(cut.ranges) != 1 or cut.pad_to or a % self.per_head
                or b % self.per_head or b > self.shape[0]):
            raise ValueError(f"tensor parallel: {self.name} (kv_b_proj) is cut along whole "
                             f"heads of {self.per_head} rows; got {cut}")
        r0 = self.rows[0]
        return KvB(self.name, self.parts, (r0 + a, r0 + b))

    def read(self) -> np.ndarray:
        r0, r1 = self.rows
        L = self.shape[1]
        if len(self.parts) == 1:
            (kv_b,) = self.parts
            return np.ascontiguousarray(_dequantize(kv_b, r0, r1).reshape(r1 - r0, L))
        (N, V), (h0, h1) = self.widths, (r0 // self.per_head, r1 // self.per_head)
        k_b = _dequantize(self.parts[0], h0, h1).reshape(h1 - h0, L, N)
        v_b = _dequantize(self.parts[1], h0, h1).reshape(h1 - h0, V, L)
        return np.ascontiguousarray(
            np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, L))


def _dequantize(t, first: int, end: int) -> np.ndarray:
    """Entries [first, end) of GGUF tensor t's outermost dimension, float32 (only their bytes
    are read from the memory-mapped file)."""
    return np.asarray(quants.dequantize(t.data[first:end], t.tensor_type), np.float32)


def join_kv_b(weights: dict, deferred: bool = False) -> None:
    """In place: each layer's attn_k_b (Hq, L, N) and attn_v_b (Hq, V, L), or its unsplit
    attn_kv_b (the file's tensors), as kv_b_proj (Hq * (N + V), L), float32; deferred: as a
    KvB, read when read_deferred is called (after the rank's cut)."""
    for name in [n for n in weights if n.endswith(".self_attn.attn_k_b")]:
        stem = name.removesuffix("attn_k_b")
        k_b, v_b = weights.pop(name), weights.pop(f"{stem}attn_v_b", None)
        if v_b is None:
            raise ValueError(f"GGUF: {name} has no attn_v_b beside it")
        kv_b = KvB(name, (k_b, v_b))
        weights[f"{stem}kv_b_proj.weight"] = kv_b if deferred else kv_b.read()
    for name in [n for n in weights if n.endswith(".self_attn.kv_b_proj.weight")]:
        if isinstance(weights[name], ReaderTensor):        # an old file's attn_kv_b
            kv_b = KvB(name, (weights[name],))
            weights[name] = kv_b if deferred else kv_b.read()


def read_deferred(weights: dict) -> None:
    """In place: every deferred kv_b_proj (KvB) read, as float32."""
    for name, w in weights.items():
        if isinstance(w, KvB):
            weights[name] = w.read()

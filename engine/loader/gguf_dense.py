"""GGUF files of the dense families of issue 16 (Gemma-2, Gemma-3 text, Phi-3, GLM-4, StableLM)
as llama.cpp's convert_hf_to_gguf.py writes them and llama.cpp reads them back.

engine/loader/gguf.py reads the keys every architecture shares; this module adds what each of
these families stores (or leaves out) differently:

- Gemma-2/3: the converter adds 1 to every norm weight (Gemma's RMSNorm multiplies by 1 + w), so
  we subtract it again (exact in float32 for the weights' range: Sterbenz). The soft-caps, the
  window and Gemma-3's local RoPE base (`rope.freq_base_swa`, default 1e4) are keys; the layer
  pattern is a key only when the file has one (`attention.sliding_window_pattern`, a period or
  per-layer flags), else llama.cpp's fixed one: every 2nd layer global for Gemma-2, every 6th for
  Gemma-3. The attention scale is not stored: llama.cpp uses head_dim ** -0.5, or
  (hidden / heads) ** -0.5 for the 27B models (46 and 62 layers), as Google's configs do.
- Phi-3: LongRoPE is stored as the tensors rope_factors_long/short (one factor per rotated pair)
  with `rope.scaling.original_context_length` and `rope.scaling.attn_factor`; there is no scaling
  type key. qkv and gate_up stay fused (attn_qkv, ffn_up). llama.cpp currently ignores Phi-3's
  sliding window; we apply it, as transformers does.
- GLM-4: half of each head rotates (rope.dimension_count), in interleaved pairs (no permutation
  for text models); gate_up fused as ffn_up; post-attention and post-MLP norms.
- StableLM: LayerNorm with bias (`attention.layer_norm_epsilon`), partial rotary, the parallel
  residual flag, no RoPE base key (llama.cpp's 1e4), per-head q/k LayerNorm weights stacked as
  attn_q_norm/attn_k_norm (heads, head_dim).
"""
from __future__ import annotations

import numpy as np

# general.architecture -> (Hugging Face architecture, model_type)
ARCHS = {"gemma2": ("Gemma2ForCausalLM", "gemma2"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
         "phi3": ("Phi3ForCausalLM", "phi3"), "glm4": ("Glm4ForCausalLM", "glm4"),
         "stablelm": ("StableLmForCausalLM", "stablelm")}

_SANDWICH = {"post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
# GGUF layer tensor -> Hugging Face name, where a family differs from the llama-style table
LAYER_NAMES = {
    "gemma2": _SANDWICH, "gemma3": _SANDWICH,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "glm4": {"post_attention_norm": "post_self_attn_layernorm",
             "ffn_norm": "post_attention_layernorm", "post_ffw_norm": "post_mlp_layernorm",
             "ffn_up": "mlp.gate_up_proj"},
    "stablelm": {"attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"},
}
# tensors folded into the config, not weights
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}      # llama.cpp's load_swa_pattern defaults
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA2_DEFAULT_WINDOW = 4096                    # llama_model_gemma2::load_arch_hparams


def family_config(path: str, meta, tensors: dict, config: dict, rot_dim: int) -> None:
    """In place: the config.json keys of `meta.arch` (one of ARCHS) that the shared keys miss."""
    arch = meta.arch
    head_dim, num_layers = config["head_dim"], config["num_hidden_layers"]
    config["partial_rotary_factor"] = rot_dim / head_dim    # GLM-4/StableLM default otherwise
    if arch in _GEMMA_PATTERN:
        _gemma(path, meta, config, num_layers)
    elif arch == "phi3":
        _phi3(path, meta, tensors, config, rot_dim)
    elif arch == "glm4":
        if meta.get("rope.dimension_sections") is not None:
            raise ValueError(f"{path}: glm4.rope.dimension_sections is set (M-RoPE, GLM-4V: the "
                             "converter reorders its q/k rows); only text GLM-4 is supported")
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    elif arch == "stablelm":
        eps = meta.get("attention.layer_norm_epsilon")
        if eps is None:
            raise ValueError(f"{path}: metadata key stablelm.attention.layer_norm_epsilon is "
                             "missing")
        config.update(
            layer_norm_eps=float(eps), rms_norm_eps=float(eps),
            use_qkv_bias="blk.0.attn_q.bias" in tensors,
            # llama.cpp runs the parallel residual where a layer has no ffn_norm
            use_parallel_residual=bool(meta.get("use_parallel_residual",
                                                "blk.0.ffn_norm.weight" not in tensors)),
            qk_layernorm="blk.0.attn_q_norm.weight" in tensors)


def _gemma(path: str, meta, config: dict, num_layers: int) -> None:
    arch = meta.arch
    config["hidden_activation"] = "gelu_pytorch_tanh"
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    config["query_pre_attn_scalar"] = (hidden // heads if num_layers == _GEMMA_27B_LAYERS[arch]
                                       else config["head_dim"])
    config["final_logit_softcapping"] = meta.get("final_logit_softcapping")
    if arch == "gemma2":
        config["attn_logit_softcapping"] = meta.get("attn_logit_softcapping")
        swa_base = meta.get("rope.freq_base_swa")
        if swa_base is not None and float(swa_base) != config["rope_theta"]:
            raise ValueError(f"{path}: gemma2.rope.freq_base_swa {swa_base} differs from "
                             f"rope.freq_base {config['rope_theta']}; Gemma-2 has one RoPE base")
        window = int(meta.get("attention.sliding_window") or _GEMMA2_DEFAULT_WINDOW)
    else:
        config["rope_local_base_freq"] = float(meta.get("rope.freq_base_swa") or 10000.0)
        window = int(meta.get("attention.sliding_window") or 0)
    config.pop("use_sliding_window", None)
    config["sliding_window"] = window or None
    pattern = meta.get("attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{path}: {arch}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:       # llama_hparams::set_swa_pattern: layer i is local unless i % n == n - 1
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    config["layer_types"] = ["sliding_attention" if s and window else "full_attention"
                             for s in sliding]


def _phi3(path: str, meta, tensors: dict, config: dict, rot_dim: int) -> None:
    window = int(meta.get("attention.sliding_window") or 0)
    config["sliding_window"] = window or None
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    long, short = (tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is None and short is None:
        return
    if long is None or short is None or original is None:
        raise ValueError(f"{path}: LongRoPE needs rope_factors_long, rope_factors_short and "
                         "phi3.rope.scaling.original_context_length; the file lacks some")
    factors = {}
    for name, t in (("long_factor", long), ("short_factor", short)):
        values = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if values.size != rot_dim // 2:
            raise ValueError(f"{path}: {t.name} has {values.size} factors for {rot_dim} "
                             "rotated dims (expected one per pair)")
        factors[name] = [float(str(v)) for v in values]
    if config["rope_scaling"] is not None:
        raise ValueError(f"{path}: both LongRoPE factors and another RoPE scaling")
    config["rope_scaling"] = {"rope_type": "longrope", "rope_theta": config["rope_theta"],
                              "original_max_position_embeddings": int(original), **factors}
    attn_factor = meta.get("rope.scaling.attn_factor")
    if attn_factor is not None:
        config["rope_scaling"]["attention_factor"] = float(attn_factor)


def hf_weights(arch: str, name: str, hf: str, weight) -> dict:
    """{Hugging Face name: value} of GGUF tensor `name` (Hugging Face name `hf`), with what the
    converter changed put back: Gemma's norms less the 1 it added, StableLM's stacked per-head
    q/k norms (heads, head_dim) split into transformers' norms.{h}."""
    if arch in _GEMMA_PATTERN and name.endswith("norm.weight"):
        return {hf: np.asarray(weight, dtype=np.float32) - np.float32(1.0)}
    if arch == "stablelm" and hf.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        stem = hf.removesuffix(".weight")
        return {f"{stem}.norms.{h}.weight": row for h, row in enumerate(np.asarray(weight))}
    return {hf: weight}

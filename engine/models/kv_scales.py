"""The FP8 KV cache's per-KV-head scales, as checkpoints store them beside each layer's weights.

The model pops them from the weight dict while it builds its attention layers (take_kv_scales);
without them the FP8 cache uses 1.0.
"""
from __future__ import annotations

import numpy as np

# Per layer, (K name, V name) under "model.layers.{i}.", as checkpoints spell them (vLLM's
# maybe_remap_kv_scale_name and compressed-tensors' get_cache_scale): llm-compressor / HF, ModelOpt,
# compressed-tensors' older kv_cache_scheme and Quark, and the deprecated single kv_scale (used
# for both, as vLLM does).
KV_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)


def _head_scales(name: str, value, num_kv_heads: int) -> np.ndarray:
    s = np.asarray(value, dtype=np.float32).ravel()
    if s.size == 1:
        s = np.repeat(s, num_kv_heads)
    if s.size != num_kv_heads:
        raise ValueError(f"KV cache scale {name} has {s.size} values; expected 1 or one per KV "
                         f"head ({num_kv_heads})")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"KV cache scale {name} must be finite and positive, got {s.tolist()}")
    return np.array(s, dtype=np.float32)  # an owned copy, not a view of the file


def take_kv_scales(weights: dict, layer: int, num_kv_heads: int):
    """Pops layer `layer`'s K and V cache scales from the weight dict: ((Hkv,), (Hkv,)) float32, or
    None when the checkpoint has none (the FP8 cache then uses 1.0)."""
    prefix = f"model.layers.{layer}."
    found = None
    for k_name, v_name in KV_SCALE_NAMES:
        k = weights.pop(prefix + k_name, None)
        v = k if v_name == k_name else weights.pop(prefix + v_name, None)
        if k is None and v is None:
            continue
        if k is None or v is None:
            raise ValueError(f"checkpoint has {prefix + (k_name if k is not None else v_name)} "
                             f"but not {prefix + (v_name if k is not None else k_name)}")
        if found is None:
            found = (_head_scales(prefix + k_name, k, num_kv_heads),
                     _head_scales(prefix + v_name, v, num_kv_heads))
    return found

"""Config keys that only one family's quirk file reads, parsed from config.json as transformers'
configuration class reads them (its defaults for keys left out). ModelConfig.family holds the
result; the family's file in engine/models/ applies it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Llama4Settings:
    """Llama 4 text (Llama4TextConfig): per layer, RoPE or none (NoPE: no_rope_layers 0) and
    chunked or full attention (layer_types); the query heads' L2 norm after RoPE on the RoPE
    layers (use_qk_norm); the NoPE layers' attention temperature: q *= 1 + attn_scale *
    log1p(floor((position + 1) / floor_scale)) (attn_temperature_tuning)."""
    rope_layers: tuple[bool, ...]
    chunked_layers: tuple[bool, ...]
    attention_chunk_size: int           # keys visible to a query: its own chunk's, up to it
    qk_l2_norm: bool
    temperature: tuple[float, float] | None    # (attn_scale, floor_scale); None: off


def parse_llama4(cfg: dict, num_layers: int) -> Llama4Settings:
    """Llama4TextConfig.__post_init__'s rules: absent no_rope_layers make every
    no_rope_layer_interval-th layer NoPE; absent layer_types make the RoPE layers chunked."""
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    types = cfg.get("layer_types") or ["chunked_attention" if r else "full_attention"
                                       for r in rope]
    for name, value in (("no_rope_layers", rope), ("layer_types", types)):
        if len(value) != num_layers:
            raise ValueError(f"{name} has {len(value)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types: unsupported layer type {unknown[0]!r}; supported: "
                         "chunked_attention, full_attention")
    chunk = cfg.get("attention_chunk_size", 8192)
    chunked = tuple(t == "chunked_attention" and bool(chunk) for t in types)
    temperature = None
    if cfg.get("attn_temperature_tuning", True):
        temperature = (float(cfg.get("attn_scale", 0.1)), float(cfg.get("floor_scale", 8192)))
    return Llama4Settings(tuple(bool(r) for r in rope), chunked, int(chunk or 0),
                          bool(cfg.get("use_qk_norm", True)), temperature)


def llama4_moe_layers(cfg: dict, num_layers: int) -> list[bool]:
    """moe_layers, else every interleave_moe_layer_step-th layer (Llama4TextConfig)."""
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    layers = cfg.get("moe_layers")
    if layers is None:
        layers = range(step - 1, num_layers, step)
    return [i in set(layers) for i in range(num_layers)]

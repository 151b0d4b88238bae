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


@dataclass(frozen=True, slots=True)
class Gemma4Settings:
    """Gemma 4 text (Gemma4TextConfig): per layer, sliding or full attention (layer_types); the
    full layers' own head size and KV heads (per_layer_config: global_head_dim,
    num_global_key_value_heads), their values equal to their keys when attention_k_eq_v (no
    v_proj), and their proportional RoPE (the first partial_rotary_factor of each head's pairs
    rotate at frequencies over the whole head, the rest not at all). The E2B/E4B models add
    per-layer input embeddings (hidden_size_per_layer_input) and KV sharing
    (num_kv_shared_layers: the last layers attend over the cache an earlier layer of their kind
    wrote, with MLPs twice as wide under use_double_wide_mlp)."""
    full_layers: tuple[bool, ...]
    full_head_dim: int
    full_kv_heads: int
    k_eq_v: bool
    sliding_theta: float
    full_theta: float
    full_rotary_factor: float           # the proportional RoPE's partial_rotary_factor
    full_rope_factor: float             # its frequency divisor (rope_parameters factor)
    per_layer_input_size: int = 0       # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab_size: int = 0       # vocab_size_per_layer_input: embed_tokens_per_layer's rows
    # per layer, the layer whose K/V cache it reads: itself, or for a KV-shared layer the last
    # layer of its kind before the shared ones (Gemma4TextConfig.kv_sharing_modes' "store" layer)
    kv_sources: tuple[int, ...] = ()
    double_wide_mlp: bool = False       # the KV-shared layers' MLPs are 2 * intermediate_size

    @property
    def kv_shared(self) -> tuple[bool, ...]:
        """Per layer: it reads another layer's cache and has none of its own."""
        return tuple(src != i for i, src in enumerate(self.kv_sources))

    @property
    def num_cache_layers(self) -> int:
        """Layers that own a K/V cache in the pool."""
        return self.kv_shared.count(False)

    def cache_width(self, sliding_kv_size: int) -> int:
        """Values per token in one layer's K (or V) cache: the wider of the two layer kinds
        (every layer's cache is that wide, engine/models/gemma4.py)."""
        return max(sliding_kv_size, self.full_kv_heads * self.full_head_dim)


# Gemma4TextConfig features the Gemma 4 file does not implement: refused by name.
_GEMMA4_UNSUPPORTED = {
    "use_bidirectional_attention": "bidirectional attention",
    "attention_bias": "attention biases",
}


def parse_gemma4(cfg: dict, num_layers: int, head_dim: int, num_kv_heads: int) -> Gemma4Settings:
    """Gemma4TextConfig.__post_init__'s rules: absent layer_types make every 6th layer full and
    the last one full; the full layers' head size and KV heads from per_layer_config, else
    global_head_dim (512) and, with attention_k_eq_v, num_global_key_value_heads; the KV-shared
    layers and their sources as kv_sharing_modes has them."""
    for key, what in _GEMMA4_UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"Gemma4ForCausalLM: {what} ({key}) is not supported")
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else
                                            "full_attention" for i in range(num_layers)])
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types: unsupported layer type {unknown[0]!r}; supported: "
                         "sliding_attention, full_attention")
    types[-1] = "full_attention"          # as the config class forces it
    full = tuple(t == "full_attention" for t in types)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    first_full = per_layer.get(full.index(True)) if per_layer else None
    if first_full is not None:
        full_head_dim = int(first_full.get("head_dim", head_dim))
        full_kv_heads = int(first_full.get("num_key_value_heads", num_kv_heads))
    else:
        full_head_dim = int(cfg.get("global_head_dim", 512))
        full_kv_heads = int((cfg.get("num_global_key_value_heads") if k_eq_v else None)
                            or num_kv_heads)
    for i, overrides in per_layer.items():
        if not full[i] or (int(overrides.get("head_dim", head_dim)), int(overrides.get(
                "num_key_value_heads", num_kv_heads))) != (full_head_dim, full_kv_heads):
            raise ValueError(f"per_layer_config: layer {i} differs from the full-attention "
                             f"layers' shape; only those may have their own")
    params = cfg.get("rope_parameters") or {}
    sliding = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
    full_rope = params.get("full_attention") or {"rope_type": "proportional",
                                                 "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1_000_000.0}
    for name, p in (("sliding_attention", sliding), ("full_attention", full_rope)):
        if p.get("rope_type", "default") not in ("default", "proportional"):
            raise ValueError(f"rope_parameters[{name!r}]: rope type {p.get('rope_type')!r} is not "
                             "supported; supported: default, proportional")
    if sliding.get("rope_type", "default") != "default" or sliding.get("factor", 1.0) != 1.0:
        raise ValueError("rope_parameters['sliding_attention']: only the default RoPE is "
                         "supported")
    proportional = full_rope.get("rope_type") == "proportional"
    # hidden_size_per_layer_input defaults to 256 in the config class (None or 0: none)
    per_layer = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    per_layer_vocab = int(cfg.get("vocab_size_per_layer_input", 262_144))
    if per_layer:
        vocab = cfg.get("vocab_size", 262_144)
        if per_layer_vocab < vocab:
            raise ValueError(f"Gemma4ForCausalLM: vocab_size_per_layer_input {per_layer_vocab} "
                             f"is smaller than vocab_size {vocab}: the ids past it have no "
                             "per-layer input embedding")
    return Gemma4Settings(
        full, full_head_dim, full_kv_heads, k_eq_v, float(sliding.get("rope_theta", 10_000.0)),
        float(full_rope.get("rope_theta", 1_000_000.0)),
        float(full_rope.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
        float(full_rope.get("factor", 1.0)) if proportional else 1.0, per_layer, per_layer_vocab,
        _gemma4_kv_sources(full, int(cfg.get("num_kv_shared_layers") or 0)),
        bool(cfg.get("use_double_wide_mlp", False)))


def _gemma4_kv_sources(full: tuple[bool, ...], num_shared: int) -> tuple[int, ...]:
    """Gemma4TextConfig.kv_sharing_modes: the last num_shared layers reuse the cache of the last
    layer of their kind (sliding or full) before them."""
    n = len(full)
    first_shared = n - num_shared
    if num_shared < 0 or first_shared < 1:
        raise ValueError(f"num_kv_shared_layers {num_shared}: between 0 and num_hidden_layers - 1 "
                         f"({n - 1}) layers may share another layer's KV cache")
    last_of_kind = {full[i]: i for i in range(first_shared)}
    missing = {full[i] for i in range(first_shared, n)} - set(last_of_kind)
    if missing:
        kind = "full" if missing.pop() else "sliding"
        raise ValueError(f"num_kv_shared_layers {num_shared}: a shared {kind}-attention layer "
                         f"has no {kind}-attention layer before the shared ones to read from")
    return tuple(i if i < first_shared else last_of_kind[full[i]] for i in range(n))

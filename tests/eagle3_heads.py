"""EAGLE-3 heads with random (or constructed) weights, written in the formats vLLM loads: EAGLE's
(SafeAILab: `LlamaForCausalLMEagle3`, `midlayer.*`, d2t as offsets and t2d as a mask) and
vllm-project/speculators' (`Eagle3Speculator`, `transformer_layer_config`, `layers.0.*`)."""
from __future__ import annotations

import json
import os

import numpy as np

# A head for the tiny target family (tests/checkpoints.py: hidden 96, vocab 512).
HEAD = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=10000.0)


def draft_vocab(target_vocab: int, size: int, seed: int = 0, must=()) -> np.ndarray:
    """`size` sorted target ids: those in `must`, then random others."""
    rng = np.random.default_rng(seed)
    ids = set(int(i) for i in must)
    rest = rng.permutation(np.setdiff1d(np.arange(target_vocab), sorted(ids)))
    ids |= set(int(i) for i in rest[:max(0, size - len(ids))])
    return np.array(sorted(ids), np.int64)


def random_weights(cfg: dict, num_aux: int = 3, target_hidden: int | None = None,
                   draft_size: int = 384, seed: int = 0, layers: int = 1) -> dict[str, np.ndarray]:
    """Random head tensors under EAGLE's names (no d2t/t2d, no embed_tokens); `layers` > 1 adds
    ordinary Llama layers `layers.1.*` ... after the first (vLLM's multi-layer heads)."""
    rng = np.random.default_rng(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    Ht = target_hidden or H

    def lin(n, k, gain=1.0):
        return (rng.standard_normal((n, k)) * gain / np.sqrt(k)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    extra = {}
    for i in range(1, layers):
        p = f"layers.{i}."
        extra.update({p + "input_layernorm.weight": norm(H),
                      p + "post_attention_layernorm.weight": norm(H),
                      p + "self_attn.q_proj.weight": lin(q, H, 2.0),
                      p + "self_attn.k_proj.weight": lin(kv, H, 2.0),
                      p + "self_attn.v_proj.weight": lin(kv, H),
                      p + "self_attn.o_proj.weight": lin(H, q),
                      p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
                      p + "mlp.down_proj.weight": lin(H, I)})
    return extra | {"fc.weight": lin(H, num_aux * Ht),
            "midlayer.hidden_norm.weight": norm(H), "midlayer.input_layernorm.weight": norm(H),
            "midlayer.post_attention_layernorm.weight": norm(H),
            "midlayer.self_attn.q_proj.weight": lin(q, 2 * H, 2.0),
            "midlayer.self_attn.k_proj.weight": lin(kv, 2 * H, 2.0),
            "midlayer.self_attn.v_proj.weight": lin(kv, 2 * H),
            "midlayer.self_attn.o_proj.weight": lin(H, q),
            "midlayer.mlp.gate_proj.weight": lin(I, H), "midlayer.mlp.up_proj.weight": lin(I, H),
            "midlayer.mlp.down_proj.weight": lin(H, I),
            "norm.weight": norm(H), "lm_head.weight": lin(draft_size, H, 4.0)}


def write_head(directory, weights: dict, ids: np.ndarray | None, layout: str = "eagle",
               target_vocab: int = 512, embed: np.ndarray | None = None, **config) -> str:
    """Write a head: `weights` under EAGLE's names, the draft vocabulary `ids` (target ids, sorted;
    None: no d2t/t2d), `embed` its own embedding (None: the target's), config keys over HEAD.
    layout "eagle" (EAGLE's config and names) or "speculators" (vLLM speculators')."""
    from safetensors.numpy import save_file
    os.makedirs(directory, exist_ok=True)
    cfg = {**HEAD, **config}
    tensors = dict(weights)
    if ids is not None:
        tensors["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        t2d = np.zeros(target_vocab, bool)
        t2d[ids[ids < target_vocab]] = True
        tensors["t2d"] = t2d
    if embed is not None:
        tensors["embed_tokens.weight"] = embed.astype(np.float32)
    draft_size = len(tensors["lm_head.weight"] if "lm_head.weight" in tensors else ids)
    aux = cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    extra = {k: cfg.pop(k) for k in ("target_hidden_size", "norm_before_residual") if k in cfg}
    if layout == "eagle":
        config_json = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                       "hidden_act": "silu", "num_hidden_layers": 1, "tie_word_embeddings": False,
                       "torch_dtype": "float32", "draft_vocab_size": draft_size, **cfg, **extra}
        if aux is not None:
            config_json["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux,
                                           "use_aux_hidden_state": True}
    elif layout == "speculators":
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        config_json = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                       "draft_vocab_size": draft_size,
                       "norm_before_residual": extra.pop("norm_before_residual", False), **extra,
                       "transformer_layer_config": {"model_type": "llama", "hidden_act": "silu",
                                                    "num_hidden_layers": 1, **cfg},
                       "speculators_config": {"algorithm": "eagle3"}}
        if aux is not None:
            config_json["eagle_aux_hidden_state_layer_ids"] = aux
    else:
        raise ValueError(layout)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return str(directory)

"""DeepSeek-V3 checkpoints with a multi-token-prediction layer, for tests/test_spec_decode_mtp.py
and the server's: transformers writes the decoder (tests/checkpoints.py) and drops MTP layers on
load and save, so the MTP tensors are written into the safetensors here, under DeepSeek-V3's
names (model.layers.{N}.enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, and a decoder
layer's own)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from checkpoints import tiny_checkpoint

MTP_ONLY = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


def mtp_checkpoint(directory, seed: int = 0, **overrides) -> str:
    """A tiny DeepSeek-V3 checkpoint (tests/checkpoints.py's, 2 layers, hidden 96, vocabulary 512
    unless overridden) with a random MTP layer: an MoE decoder layer drawn like the target's last
    one (each tensor's mean and spread), norms near 1, eh_proj of spread 1 / sqrt(2H), its own
    shared_head.head, the target's embedding (no embed_tokens of its own)."""
    d = tiny_checkpoint(directory, "deepseek_v3", seed=seed, **overrides)
    w = load(d)
    N, H, V = config(d)["num_hidden_layers"], *w["model.embed_tokens.weight"].shape[::-1]
    rng = np.random.default_rng(100 + seed)
    extra = {}
    for name, t in w.items():
        if name.startswith(f"model.layers.{N - 1}."):
            extra[name.replace(f"model.layers.{N - 1}.", f"model.layers.{N}.")] = (
                t.mean() + t.std() * rng.standard_normal(t.shape)).astype(np.float32)
    p = f"model.layers.{N}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{p}{norm}.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    extra[p + "eh_proj.weight"] = (rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)).astype(
        np.float32)
    extra[p + "shared_head.head.weight"] = (rng.standard_normal((V, H))
                                            * w["lm_head.weight"].std()).astype(np.float32)
    save(d, {**w, **extra})
    return d


def load(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(Path(directory) / "model.safetensors"))


def save(directory, weights: dict) -> None:
    from safetensors.numpy import save_file
    save_file(weights, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})


def config(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def bigram_mtp_checkpoint(directory, seed: int = 4, r: float = 0.15, **overrides) -> str:
    """A DeepSeek-V3 target whose next token depends on the last token only, with an MTP layer
    that computes that bigram for the token it reads, so every draft is the target's next token.

    The target: embedding rows of one RMS r; every attention's o_proj zeroed, and the MoE
    layers' experts (routed and shared) given zero down_proj: the residual stream is
    e + MLP0(post_norm0(e)) for the last token's embedding e. The MTP layer (a dense one):
    enorm's weight sqrt(r^2 + eps) gives back e exactly, hnorm's zero drops the hidden state,
    eh_proj = [I, 0] passes e on, its attention's o_proj is zero, its MLP and post-attention
    norm are the target's layer 0's, shared_head.norm the target's final norm; no
    shared_head.head and no embed_tokens (the target's lm_head and embedding stand in)."""
    d = tiny_checkpoint(directory, "deepseek_v3", seed=seed, **overrides)
    w = load(d)
    cfg = config(d)
    N, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    e = w["model.embed_tokens.weight"].astype(np.float64)
    e *= r / np.sqrt((e * e).mean(1, keepdims=True))
    w["model.embed_tokens.weight"] = e.astype(np.float32)
    for name in w:
        expert = ".mlp.experts." in name or ".mlp.shared_experts." in name
        if name.endswith("self_attn.o_proj.weight") or (expert
                                                        and name.endswith("down_proj.weight")):
            w[name] = np.zeros_like(w[name])
    H = e.shape[1]
    p, q = f"model.layers.{N}.", "model.layers.0."
    extra = {n.replace(q, p): t.copy() for n, t in w.items()
             if n.startswith(q + "self_attn.") or n.startswith(q + "mlp.")
             or n == q + "post_attention_layernorm.weight"}
    extra[p + "self_attn.o_proj.weight"] = np.zeros_like(w[q + "self_attn.o_proj.weight"])
    extra.update({
        p + "input_layernorm.weight": np.ones(H, np.float32),
        p + "enorm.weight": np.full(H, np.sqrt(r * r + eps), np.float32),
        p + "hnorm.weight": np.zeros(H, np.float32),
        p + "eh_proj.weight": np.concatenate([np.eye(H), np.zeros((H, H))], 1).astype(np.float32),
        p + "shared_head.norm.weight": w["model.norm.weight"].copy()})
    save(d, {**w, **extra})
    return d

"""Qwen3-Next and Qwen3.5 checkpoints with a multi-token-prediction head, for
tests/test_spec_decode_hybrid.py: transformers writes the hybrid model (tests/checkpoints.py) and
skips the mtp.* tensors on load and save, so they are written into the safetensors here under the
names real checkpoints use (mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm,
mtp.layers.0.* a full-attention decoder layer's own)."""
from __future__ import annotations

import numpy as np

from checkpoints import edit_config, tiny_checkpoint
from mtp_heads import config, load, save

HEAD_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def full_attention_layer(cfg: dict) -> int:
    types = cfg.get("layer_types") or []
    return types.index("full_attention") if types else cfg["full_attention_interval"] - 1


def mtp_checkpoint(directory, arch: str = "qwen3_next", seed: int = 0,
                   checkpoint=tiny_checkpoint, **overrides) -> str:
    """A tiny `arch` checkpoint (4 layers, hidden 96, vocabulary 512) with a random MTP head: its
    decoder layer's attention drawn like the target's full-attention layer's and its MLP like
    layer 0's (MoE for Qwen3-Next, as vLLM builds mtp.layers.0; dense for Qwen3.5), each tensor
    with that tensor's mean and spread; norms like the target's final norm; fc of spread
    1 / sqrt(2H). checkpoint: what writes the target (tests/checkpoints.py, in float32)."""
    d = checkpoint(directory, arch, seed=seed, **overrides)
    w = load(d)
    cfg = config(d)
    H = cfg["hidden_size"]
    rng = np.random.default_rng(200 + seed)

    def like(t):
        return (t.mean() + t.std() * rng.standard_normal(t.shape)).astype(np.float32)

    full = f"model.layers.{full_attention_layer(cfg)}."
    extra = {}
    for name, t in w.items():
        if name.startswith(full + "self_attn.") or name.startswith(full + "input_layernorm"):
            extra[name.replace(full, "mtp.layers.0.")] = like(t)
        elif (name.startswith("model.layers.0.mlp.")
              or name.startswith("model.layers.0.post_attention_layernorm")):
            extra[name.replace("model.layers.0.", "mtp.layers.0.")] = like(t)
    for norm in HEAD_NORMS:
        extra[f"mtp.{norm}.weight"] = like(w["model.norm.weight"])
    extra["mtp.fc.weight"] = (rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)).astype(
        np.float32)
    save(d, {**w, **extra})
    return d


def bigram_mtp_checkpoint(directory, arch: str = "qwen3_next", seed: int = 4,
                          r: float = 0.15, checkpoint=tiny_checkpoint, **overrides) -> str:
    """A target whose next token depends on the last token only, with an MTP head that computes
    that bigram for the token it reads, so every draft is the target's next token.

    The target: embedding rows of one RMS r; every mixer's output projection zeroed (o_proj,
    linear_attn.out_proj), and every layer's MLP but layer 0's given zero down_proj (experts,
    shared expert): the residual stream is e + MLP0(post_norm0(e)) for the last token's
    embedding e. The head: pre_fc_norm_embedding's weight sqrt(r^2 + eps) - 1 (the norms
    multiply by 1 + w) gives back e exactly, pre_fc_norm_hidden's -1 drops the hidden state, fc
    = [I, 0] passes e on, its attention's o_proj is zero, its MLP and post-attention norm are
    layer 0's, its final norm the target's."""
    if arch == "qwen3_next":
        overrides = {"mlp_only_layers": [], **overrides}
    d = checkpoint(directory, arch, seed=seed, **overrides)
    w = load(d)
    cfg = config(d)
    eps = cfg["rms_norm_eps"]
    e = w["model.embed_tokens.weight"].astype(np.float64)
    e *= r / np.sqrt((e * e).mean(1, keepdims=True))
    w["model.embed_tokens.weight"] = e.astype(np.float32)
    for name in w:
        later_mlp = ".mlp." in name and not name.startswith("model.layers.0.")
        if (name.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight"))
                or (later_mlp and name.endswith(("down_proj.weight", "down_proj")))):
            w[name] = np.zeros_like(w[name])
    H = e.shape[1]
    full, q, p = f"model.layers.{full_attention_layer(cfg)}.", "model.layers.0.", "mtp.layers.0."
    extra = {n.replace(full, p): t.copy() for n, t in w.items()
             if n.startswith(full + "self_attn.")}
    extra.update({n.replace(q, p): t.copy() for n, t in w.items()
                  if n.startswith(q + "mlp.") or n == q + "post_attention_layernorm.weight"})
    extra.update({
        p + "input_layernorm.weight": np.zeros(H, np.float32),
        "mtp.pre_fc_norm_embedding.weight": np.full(H, np.sqrt(r * r + eps) - 1, np.float32),
        "mtp.pre_fc_norm_hidden.weight": np.full(H, -1.0, np.float32),
        "mtp.fc.weight": np.concatenate([np.eye(H), np.zeros((H, H))], 1).astype(np.float32),
        "mtp.norm.weight": w["model.norm.weight"].copy()})
    save(d, {**w, **extra})
    return d


__all__ = ["mtp_checkpoint", "bigram_mtp_checkpoint", "edit_config", "load", "save", "config"]

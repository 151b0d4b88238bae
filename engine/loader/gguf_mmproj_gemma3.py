"""Gemma 3's projector file (clip.projector_type gemma3), as convert_hf_to_gguf.py --mmproj writes
it and llama.cpp's clip.cpp reads it back, beside a gemma3 text GGUF (engine/loader/gguf_mmproj.py
dispatches here):
- the SigLIP tower's tensors keep their shapes (the Conv2d patch embedding, its bias, the learned
  position embedding; q, k, v, out with biases; fc1 as ffn_up, fc2 as ffn_down);
- mm.soft_emb_norm.weight is stored with Gemma's 1 added (the converter's correction): 1 is
  subtracted again, so the encoder's 1 + w gives back the file's float32 value exactly;
- mm.input_projection.weight (vision hidden x text hidden, as Hugging Face's) is F16 whatever the
  --outtype (the converter forces it);
- the pooled grid is not stored as mm_tokens_per_image but as clip.vision.projector.scale_factor
  (the pooling kernel, written only when it is not clip.cpp's 4): tokens = (image_size /
  patch_size / scale)^2;
- the tower's activation is GELU with the tanh approximation (clip.use_gelu), its norms
  LayerNorms with clip.vision.attention.layer_norm_epsilon.
The image tokens' ids are the text file's vocabulary's <image_soft_token>, <start_of_image>,
<end_of_image>. The text file holds no layer pattern: engine/loader/gguf_dense.py applies
llama.cpp's (every 6th layer global).
"""
from __future__ import annotations

import numpy as np

from engine.loader.gguf import vocab_ids

ARCHITECTURE = "Gemma3ForConditionalGeneration"
DEFAULT_SCALE = 4          # clip.cpp's proj_scale_factor for gemma3 when the file has none
_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GLOBAL_NAMES = {"v.patch_embd": "vision_tower.embeddings.patch_embedding",
                 "v.position_embd": "vision_tower.embeddings.position_embedding",
                 "v.post_ln": "vision_tower.post_layernorm",
                 "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"}
_TOKENS = {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
           "eoi_token_index": "<end_of_image>"}


def vision_config(path: str, meta: dict, need) -> dict:
    """config.json's vision_config (SigLIP's keys) and mm_tokens_per_image, from the metadata."""
    if not meta.get("clip.use_gelu"):
        raise ValueError(f"{path}: a gemma3 projector without clip.use_gelu; Gemma 3's SigLIP "
                         "tower uses GELU (tanh)")
    image_size, patch_size = int(need("image_size")), int(need("patch_size"))
    scale = int(meta.get("clip.vision.projector.scale_factor") or DEFAULT_SCALE)
    side = image_size // patch_size // scale
    return {
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": int(need("attention.head_count")),
        "image_size": image_size, "patch_size": patch_size,
        "layer_norm_eps": float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False,
        "mm_tokens_per_image": side * side, "out_hidden_size": int(need("projection_dim")),
    }


def hf_weights(path: str, arrays: dict) -> dict:
    """The projector's arrays (GGUF names) under the names engine/vision/gemma3_encoder.py reads."""
    weights = {}
    for name, w in arrays.items():
        stem, _, kind = name.rpartition(".")
        if name == "mm.input_projection.weight":
            weights["multi_modal_projector.mm_input_projection_weight"] = w
            continue
        if stem == "mm.soft_emb_norm":
            w = (np.asarray(w, np.float32) - np.float32(1.0)).astype(w.dtype)
        if stem in _GLOBAL_NAMES:
            weights[f"{_GLOBAL_NAMES[stem]}.{kind}"] = w
            continue
        parts = stem.split(".")
        if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in _LAYER_NAMES:
            weights[f"vision_tower.encoder.layers.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{kind}"] = w
            continue
        raise ValueError(f"{path}: tensor {name} is not one Taper knows in a Gemma 3 projector")
    return weights


def join(config: dict, text_meta: dict, vision: dict, path: str) -> dict:
    """The text GGUF's config (a gemma3 file) as Gemma3ForConditionalGeneration's."""
    if text_meta.get("general.architecture") != "gemma3":
        raise ValueError(f"{path}: --mmproj with a Gemma 3 projector needs a gemma3 text GGUF "
                         f"(this one is {text_meta.get('general.architecture')!r})")
    ids = vocab_ids(text_meta, _TOKENS, path)
    vision = dict(vision)
    out, tokens_per_image = vision.pop("out_hidden_size"), vision.pop("mm_tokens_per_image")
    if out != config["hidden_size"]:
        raise ValueError(f"the projector's output ({out}) differs from {path}'s hidden size "
                         f"({config['hidden_size']})")
    # the language model under text_config, as Hugging Face's Gemma3Config holds it (a flat
    # config would leave the projector's text hidden size to Gemma3TextConfig's default)
    return {"architectures": [ARCHITECTURE], "text_config": config, "vision_config": vision,
            "mm_tokens_per_image": tokens_per_image, **ids,
            **{k: config[k] for k in ("tie_word_embeddings",) if k in config}}

"""Mistral 3's projector file (clip.projector_type pixtral), as convert_hf_to_gguf.py --mmproj
writes it for Mistral3ForConditionalGeneration, beside a mistral3 text GGUF
(engine/loader/gguf_mmproj.py dispatches here):
- the Pixtral tower: the bias-free Conv2d patch embedding, ln_pre as v.pre_ln, RMSNorms ln1/ln2,
  q/k/v/out and a gated MLP (ffn_gate/up/down), no biases; q and k rows permuted as the text
  model's (LlamaModel.permute, per head of the tower): un-permuted again;
- the projector: mm.input_norm (RMSNorm, the language model's rms_norm_eps), the patch merger
  mm.patch_merger, then mm.1 / mm.2 (linear_1 / linear_2, with biases where the source had
  them: multimodal_projector_bias);
- v.token_embd.img_break, when a converter wrote it, is the text model's [IMG_BREAK] embedding
  row again: dropped (the language model embeds that token itself);
- the tower's activation is clip.use_silu or clip.use_gelu; the projector's is GELU; the
  rotary base is not stored: clip.cpp's (and Pixtral's) 10000.
The image tokens' ids are the text file's vocabulary's [IMG], [IMG_BREAK], [IMG_END]. The image
processor beside a GGUF is PixtralImageProcessor's defaults (longest edge 1024, CLIP's mean and
std) unless a processor_config.json / preprocessor_config.json sits beside it.
"""
from __future__ import annotations

from engine.loader.gguf import unpermute_rows, vocab_ids

ARCHITECTURE = "Mistral3ForConditionalGeneration"
ROPE_THETA = 10000.0
_LAYER_NAMES = {"ln1": "attention_norm", "ln2": "ffn_norm", "attn_q": "attention.q_proj",
                "attn_k": "attention.k_proj", "attn_v": "attention.v_proj",
                "attn_out": "attention.o_proj", "ffn_gate": "feed_forward.gate_proj",
                "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj"}
_GLOBAL_NAMES = {"v.patch_embd": "vision_tower.patch_conv", "v.pre_ln": "vision_tower.ln_pre",
                 "mm.input_norm": "multi_modal_projector.norm",
                 "mm.patch_merger": "multi_modal_projector.patch_merger.merging_layer",
                 "mm.1": "multi_modal_projector.linear_1",
                 "mm.2": "multi_modal_projector.linear_2"}
_TOKENS = {"image_token_index": "[IMG]", "image_break_token_id": "[IMG_BREAK]",
           "image_end_token_id": "[IMG_END]"}


def vision_config(path: str, meta: dict, need) -> dict:
    """config.json's vision_config (PixtralVisionConfig's keys), from the metadata."""
    if meta.get("clip.use_silu"):
        act = "silu"
    elif meta.get("clip.use_gelu"):
        act = "gelu"
    else:
        raise ValueError(f"{path}: a pixtral projector with neither clip.use_silu nor "
                         "clip.use_gelu")
    return {
        "num_hidden_layers": int(need("block_count")), "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": int(need("attention.head_count")),
        "patch_size": int(need("patch_size")), "hidden_act": act,
        "rope_parameters": {"rope_type": "axial", "rope_theta": ROPE_THETA},
        "spatial_merge_size": int(meta.get("clip.vision.spatial_merge_size") or 1),
        "out_hidden_size": int(need("projection_dim")),
    }


def hf_weights(path: str, arrays: dict, num_heads: int) -> dict:
    """The projector's arrays (GGUF names) under the names engine/vision/pixtral_encoder.py
    reads."""
    weights = {}
    for name, w in arrays.items():
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if name == "v.token_embd.img_break":
            continue
        if stem in _GLOBAL_NAMES:
            weights[f"{_GLOBAL_NAMES[stem]}.{kind}"] = w
        elif len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in _LAYER_NAMES:
            if parts[3] in ("attn_q", "attn_k"):
                w = unpermute_rows(w, num_heads)
            layer = f"vision_tower.transformer.layers.{parts[2]}"
            weights[f"{layer}.{_LAYER_NAMES[parts[3]]}.{kind}"] = w
        else:
            raise ValueError(f"{path}: tensor {name} is not one Taper knows in a Pixtral "
                             "projector")
    return weights


def join(config: dict, text_meta: dict, vision: dict, path: str, projector_bias: bool) -> dict:
    """The text GGUF's config (a mistral3 file) as Mistral3ForConditionalGeneration's."""
    if text_meta.get("general.architecture") != "mistral3":
        raise ValueError(f"{path}: --mmproj with a Pixtral projector needs a mistral3 text GGUF "
                         f"(this one is {text_meta.get('general.architecture')!r})")
    ids = vocab_ids(text_meta, _TOKENS, path)
    vision = dict(vision)
    out, merge = vision.pop("out_hidden_size"), vision.pop("spatial_merge_size")
    if out != config["hidden_size"]:
        raise ValueError(f"the projector's output ({out}) differs from {path}'s hidden size "
                         f"({config['hidden_size']})")
    return {"architectures": [ARCHITECTURE], "text_config": config, "vision_config": vision,
            "spatial_merge_size": merge, "multimodal_projector_bias": projector_bias,
            "projector_hidden_act": "gelu", "vision_feature_layer": -1, **ids,
            **{k: config[k] for k in ("tie_word_embeddings",) if k in config}}

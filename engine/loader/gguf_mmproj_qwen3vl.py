"""Qwen3-VL's projector file (clip.projector_type qwen3vl_merger), as convert_hf_to_gguf.py
--mmproj writes it, beside a qwen3vl text GGUF (engine/loader/gguf_mmproj.py dispatches here):
- the Conv3d patch embedding split per temporal patch (v.patch_embd.weight and .weight.1) with
  its bias: stacked again on the temporal axis;
- the learned position grid v.position_embd (num_position_embeddings rows);
- q, k, v stay fused (attn_qkv); the MLP is linear_fc1/fc2 as ffn_up/ffn_down;
- the DeepStack mergers are v.deepstack.{block}.* under the index of the block they read
  (clip.vision.is_deepstack_layers flags those blocks): renumbered 0, 1, ... as
  deepstack_merger_list, in block order; the main merger is v.post_ln, mm.0, mm.2;
- clip.vision.attention.layer_norm_epsilon is the language model's rms_norm_eps (the converter's
  rule), not the tower's: Qwen3-VL's LayerNorms use 1e-6 whatever it says (as transformers);
- the activation is GELU with the tanh approximation (clip.use_gelu; Qwen3-VL's default
  gelu_pytorch_tanh).
The image processor: the file's mean and std, Qwen2-VL's default pixel limits (the file holds
none; a preprocessor_config.json beside the text GGUF overrides both).
The text file is a qwen3vl model (qwen3vlmoe: Qwen3-VL-MoE's, Qwen3-MoE's graph likewise):
Qwen3's graph with `qwen3vl.rope.dimension_sections` (the interleaved M-RoPE sections, a fourth
0 padding them) and `n_deepstack_layers` (checked against the projector's). The image tokens'
ids are the vocabulary's <|image_pad|>, <|vision_start|>, <|vision_end|>.
"""
from __future__ import annotations

import numpy as np

from engine.loader.gguf import vocab_ids

# text GGUF architecture -> the vision-language architecture it joins
ARCHITECTURES = {"qwen3vl": "Qwen3VLForConditionalGeneration",
                 "qwen3vlmoe": "Qwen3VLMoeForConditionalGeneration"}
_LAYER_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
                "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_MERGER_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_GLOBAL_NAMES = {"v.post_ln": "visual.merger.norm", "mm.0": "visual.merger.linear_fc1",
                 "mm.2": "visual.merger.linear_fc2", "v.patch_embd": "visual.patch_embed.proj",
                 "v.position_embd": "visual.pos_embed"}
_TOKENS = {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
           "vision_end_token_id": "<|vision_end|>"}


def vision_config(path: str, meta: dict, need, num_positions: int) -> dict:
    """config.json's vision_config (Qwen3VLVisionConfig's keys), from the metadata."""
    if not meta.get("clip.use_gelu"):
        raise ValueError(f"{path}: a qwen3vl_merger projector without clip.use_gelu; Qwen3-VL's "
                         "tower uses GELU (tanh)")
    depth = int(need("block_count"))
    flags = meta.get("clip.vision.is_deepstack_layers") or []
    if len(flags) != depth:
        raise ValueError(f"{path}: clip.vision.is_deepstack_layers has {len(flags)} flags for "
                         f"{depth} blocks")
    return {
        "depth": depth, "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_heads": int(need("attention.head_count")), "patch_size": int(need("patch_size")),
        "spatial_merge_size": int(meta.get("clip.vision.spatial_merge_size") or 2),
        "temporal_patch_size": 2, "out_hidden_size": int(need("projection_dim")),
        "num_position_embeddings": num_positions, "hidden_act": "gelu_pytorch_tanh",
        "deepstack_visual_indexes": [i for i, f in enumerate(flags) if f],
    }


def hf_weights(path: str, arrays: dict, deepstack: list[int]) -> dict:
    """The projector's arrays (GGUF names) under the names engine/vision/qwen3_vl_encoder.py
    reads."""
    weights = {}
    for name, w in arrays.items():
        if name.startswith("v.patch_embd.weight"):
            continue
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if stem in _GLOBAL_NAMES:
            weights[f"{_GLOBAL_NAMES[stem]}.{kind}"] = w
        elif len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in _LAYER_NAMES:
            weights[f"visual.blocks.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{kind}"] = w
        elif (len(parts) == 4 and parts[:2] == ["v", "deepstack"] and parts[3] in _MERGER_NAMES
              and int(parts[2]) in deepstack):
            k = deepstack.index(int(parts[2]))
            weights[f"visual.deepstack_merger_list.{k}.{_MERGER_NAMES[parts[3]]}.{kind}"] = w
        else:
            raise ValueError(f"{path}: tensor {name} is not one Taper knows in a Qwen3-VL "
                             "projector")
    halves = [arrays.get("v.patch_embd.weight"), arrays.get("v.patch_embd.weight.1")]
    if any(h is None for h in halves):
        raise ValueError(f"{path}: v.patch_embd.weight and v.patch_embd.weight.1 (the two "
                         "temporal halves of the patch embedding) are needed")
    weights["visual.patch_embed.proj.weight"] = np.stack(halves, axis=2)
    return weights


def join(config: dict, text_meta: dict, vision: dict, path: str) -> dict:
    """The text GGUF's config (a qwen3vl or qwen3vlmoe file) as Qwen3-VL's (-MoE's), with the
    projector's tower."""
    arch = text_meta.get("general.architecture")
    sections = text_meta.get(f"{arch}.rope.dimension_sections")
    if arch not in ARCHITECTURES or sections is None:
        raise ValueError(f"{path}: --mmproj with a Qwen3-VL projector needs a qwen3vl text GGUF "
                         f"(or qwen3vlmoe) with rope.dimension_sections (this one is {arch!r})")
    layers = text_meta.get(f"{arch}.n_deepstack_layers")
    if layers is not None and int(layers) != len(vision["deepstack_visual_indexes"]):
        raise ValueError(f"{path}: n_deepstack_layers {layers}, the projector has "
                         f"{len(vision['deepstack_visual_indexes'])} DeepStack mergers")
    ids = vocab_ids(text_meta, _TOKENS, path)
    if vision["out_hidden_size"] != config["hidden_size"]:
        raise ValueError(f"the projector's output ({vision['out_hidden_size']}) differs from "
                         f"{path}'s hidden size ({config['hidden_size']})")
    rope = {"rope_type": "mrope", "mrope_section": [int(s) for s in sections][:3],
            "mrope_interleaved": True}
    return {**config, "architectures": [ARCHITECTURES[arch]], "rope_scaling": rope,
            "vision_config": vision, **ids}

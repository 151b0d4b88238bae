"""llama.cpp's multimodal projector files (`--mmproj FILE`, general.architecture "clip") beside a
text GGUF: the vision tower's config and tensors under Hugging Face's names, joined to the text
model's (engine/loader/model_loader.py load_gguf_model). The projector type picks the family:
Qwen2.5-VL's here, Gemma 3's in engine/loader/gguf_mmproj_gemma3.py, Qwen3-VL's in
engine/loader/gguf_mmproj_qwen3vl.py, Mistral 3's (Pixtral) in engine/loader/gguf_mmproj_pixtral.py.

Qwen2.5-VL (clip.projector_type qwen2.5vl_merger), as convert_hf_to_gguf.py --mmproj writes it
and llama.cpp's clip.cpp reads it back:
- the text file is a qwen2vl model: Qwen2's graph with `qwen2vl.rope.dimension_sections` (the
  M-RoPE sections, a fourth 0 padding them);
- the Conv3d patch embedding is split per temporal patch (v.patch_embd.weight and .weight.1,
  each out x channels x patch x patch): stacked again on the temporal axis;
- q, k, v are separate (attn_q/k/v): fused again as the tower's qkv;
- the file holds no window size and no merge size: clip.cpp's 112 pixels and 2 (or
  clip.vision.spatial_merge_size); the full-attention blocks are every n_wa_pattern-th
  (clip.vision.n_wa_pattern: blocks n-1, 2n-1, ...);
- of the image processor only the mean and std (clip.vision.image_mean/std, which serve): the
  pixel limits are Qwen2-VL's defaults (a preprocessor_config.json beside the text GGUF
  overrides all of them, engine/vision/config.py).
The image tokens' ids are the text file's vocabulary's <|image_pad|>, <|vision_start|>,
<|vision_end|>.
"""
from __future__ import annotations

import numpy as np

from engine.loader import gguf_mmproj_gemma3 as gemma3
from engine.loader import gguf_mmproj_pixtral as pixtral
from engine.loader import gguf_mmproj_qwen3vl as qwen3vl
from engine.loader.gguf import _FLOAT_TYPES, _tensor, open_reader, read_metadata, vocab_ids
from engine.loader.safetensors import resolve_dtype

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
WINDOW_SIZE = 112        # clip.cpp's attn_window_size default (not in the file)
# clip.projector_type -> the family it serves (the text GGUF it goes with)
_PROJECTORS = {"qwen2.5vl_merger": "Qwen2.5-VL (qwen2vl)", "gemma3": "Gemma 3 (gemma3)",
               "qwen3vl_merger": "Qwen3-VL (qwen3vl)", "pixtral": "Mistral 3 (mistral3)"}
_LAYER_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_out": "attn.proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL_NAMES = {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}
_TOKENS = {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
           "vision_end_token_id": "<|vision_end|>"}


def read_mmproj(path: str, dtype: str = "auto") -> tuple[dict, dict]:
    """(vision_config as config.json holds it plus its "projector_type", tensors under the Hugging
    Face names) of an mmproj file; ValueError naming what it cannot serve."""
    reader = open_reader(path)
    meta = read_metadata(reader)
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
        raise ValueError(f"{path}: not a llama.cpp vision projector (general.architecture "
                         f"{meta.get('general.architecture')!r}, want 'clip' with a vision "
                         "encoder)")
    projector = meta.get("clip.projector_type")
    if projector not in _PROJECTORS:
        raise ValueError(f"{path}: projector type {projector!r} is not supported (supported: "
                         + ", ".join(f"{k}: {v}" for k, v in _PROJECTORS.items()) + ")")

    def need(key):
        if meta.get(f"clip.vision.{key}") is None:
            raise ValueError(f"{path}: metadata key clip.vision.{key} is missing")
        return meta[f"clip.vision.{key}"]

    want = resolve_dtype(dtype)
    if projector == "gemma3":
        vision = gemma3.vision_config(path, meta, need)
        weights = gemma3.hf_weights(path, {t.name: _float_tensor(path, t, want)
                                           for t in reader.tensors})
        return {**vision, "projector_type": projector}, weights
    if projector == "pixtral":
        vision = pixtral.vision_config(path, meta, need)
        arrays = {t.name: _float_tensor(path, t, want) for t in reader.tensors}
        weights = pixtral.hf_weights(path, arrays, vision["num_attention_heads"])
        return {**vision, "projector_type": projector,
                "projector_bias": "mm.1.bias" in arrays}, weights
    # the normalisation the converter read from the source's image processor (Qwen2-VL's
    # defaults hold the rest: engine/vision/config.py ImageProcessorConfig)
    stats = {k: [float(x) for x in meta[f"clip.vision.{k}"]] for k in ("image_mean", "image_std")
             if meta.get(f"clip.vision.{k}") is not None}
    if projector == "qwen3vl_merger":
        arrays = {t.name: _float_tensor(path, t, want) for t in reader.tensors}
        positions = arrays.get("v.position_embd.weight")
        if positions is None:
            raise ValueError(f"{path}: v.position_embd.weight (Qwen3-VL's learned position grid) "
                             "is missing")
        vision = qwen3vl.vision_config(path, meta, need, positions.shape[0])
        weights = qwen3vl.hf_weights(path, arrays, vision["deepstack_visual_indexes"])
        return {**vision, **stats, "projector_type": projector}, weights
    depth = int(need("block_count"))
    pattern = int(meta.get("clip.vision.n_wa_pattern") or 0)
    vision = {
        "depth": depth, "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_heads": int(need("attention.head_count")), "patch_size": int(need("patch_size")),
        "spatial_merge_size": int(meta.get("clip.vision.spatial_merge_size") or 2),
        "temporal_patch_size": 2, "window_size": WINDOW_SIZE,
        "out_hidden_size": int(need("projection_dim")),
        "fullatt_block_indexes": [i for i in range(depth) if pattern and (i + 1) % pattern == 0],
        "hidden_act": "silu" if meta.get("clip.use_silu") else "gelu",
        "projector_type": projector, **stats,
    }
    eps = meta.get("clip.vision.attention.layer_norm_epsilon")
    if eps is not None and not np.isclose(float(eps), 1e-6):
        raise ValueError(f"{path}: vision layer_norm_epsilon {eps}; Qwen2.5-VL's tower uses 1e-6")
    tensors = {t.name: t for t in reader.tensors}
    weights = {}
    for name, t in tensors.items():
        if name.startswith("v.patch_embd.weight"):
            continue
        weights[_hf_name(path, name)] = _float_tensor(path, t, want)
    halves = [tensors.get("v.patch_embd.weight"), tensors.get("v.patch_embd.weight.1")]
    if any(h is None for h in halves):
        raise ValueError(f"{path}: v.patch_embd.weight and v.patch_embd.weight.1 (the two "
                         "temporal halves of the patch embedding) are needed")
    weights["visual.patch_embed.proj.weight"] = np.stack(
        [np.asarray(_tensor(path, h, want)) for h in halves], axis=2)
    for i in range(depth):
        p = f"visual.blocks.{i}.attn."
        for kind in ("weight", "bias"):
            parts = [weights.pop(f"{p}{n}.{kind}", None) for n in "qkv"]
            if any(x is None for x in parts):
                raise ValueError(f"{path}: block {i} lacks attn_q/k/v.{kind}")
            weights[f"{p}qkv.{kind}"] = np.concatenate(parts)
    return vision, weights


def _float_tensor(path: str, t, want) -> np.ndarray:
    if t.tensor_type not in _FLOAT_TYPES:
        raise ValueError(f"{path}: tensor {t.name} is {t.tensor_type.name}; Taper reads "
                         "F32, F16 and BF16 projector files")
    return np.asarray(_tensor(path, t, want))


def _hf_name(path: str, name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"visual.{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"]:
        block, tensor = parts[2], parts[3]
        if tensor in ("attn_q", "attn_k", "attn_v"):
            return f"visual.blocks.{block}.attn.{tensor[-1]}.{kind}"
        if tensor in _LAYER_NAMES:
            return f"visual.blocks.{block}.{_LAYER_NAMES[tensor]}.{kind}"
    raise ValueError(f"{path}: tensor {name} is not one Taper knows in a Qwen2.5-VL projector")


def join_vision(config: dict, text_meta: dict, vision: dict, path: str) -> dict:
    """The text GGUF's config as its vision-language family's, with the projector's tower;
    ValueError when the text file is not the projector's family."""
    vision = dict(vision)
    projector = vision.pop("projector_type")
    if projector == "gemma3":
        return gemma3.join(config, text_meta, vision, path)
    if projector == "pixtral":
        bias = vision.pop("projector_bias")
        return pixtral.join(config, text_meta, vision, path, bias)
    if projector == "qwen3vl_merger":
        return qwen3vl.join(config, text_meta, vision, path)
    sections = text_meta.get("qwen2vl.rope.dimension_sections")
    if text_meta.get("general.architecture") != "qwen2vl" or sections is None:
        raise ValueError(f"{path}: --mmproj with a Qwen2.5-VL projector needs a qwen2vl text "
                         f"GGUF with rope.dimension_sections (this one is "
                         f"{text_meta.get('general.architecture')!r})")
    ids = vocab_ids(text_meta, _TOKENS, path)
    if vision["out_hidden_size"] != config["hidden_size"]:
        raise ValueError(f"the projector's output ({vision['out_hidden_size']}) differs from "
                         f"{path}'s hidden size ({config['hidden_size']})")
    rope = {"rope_type": "mrope", "mrope_section": [int(s) for s in sections][:3]}
    return {**config, "architectures": [ARCHITECTURE], "rope_scaling": rope,
            "vision_config": vision, **ids}

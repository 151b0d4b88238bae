"""A vision-language checkpoint's settings: the vision tower's (config.json `vision_config`), the
image tokens and M-RoPE sections, and the image processor's (preprocessor_config.json).

config.json holds the language model either flat (the hub's Qwen2.5-VL checkpoints) or under
`text_config` (transformers 5 saves); `text_config_of` returns it as a plain causal LM's config
so that ModelConfig reads it by the same rules as Qwen2's.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# Vision-language architecture -> the causal LM whose config rules its language model follows.
VISION_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                        "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
                        "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
                        "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                        "Mistral3ForConditionalGeneration": "MistralForCausalLM"}
# Qwen3-VL: a ViT with learned position embeddings and DeepStack features, interleaved M-RoPE
QWEN3_VL = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
# Language-model settings fixed by a family's modeling code rather than read from its config.
_TEXT_OVERRIDES = {
    # Qwen3VLMoeTextTopKRouter always renormalises the top-k probabilities
    "Qwen3VLMoeForConditionalGeneration": {"norm_topk_prob": True},
}

# OpenAI CLIP's mean and std: the Qwen2-VL image processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(slots=True)
class VisionConfig:
    architecture: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    mrope_section: tuple[int, ...] = (16, 24, 24)   # rotary frequencies per t, h, w position
    # Qwen3-VL: frequencies t, h, w in turn (the first 3 x section[1] and 3 x section[2] of
    # them), not in three runs
    mrope_interleaved: bool = False
    num_position_embeddings: int = 0     # Qwen3-VL: the learned position grid (side^2 rows)
    deepstack_visual_indexes: tuple[int, ...] = ()   # Qwen3-VL: blocks feeding the first layers
    # the image processor's mean and std where the model's files name them outside a
    # preprocessor_config.json (a llama.cpp projector file: engine/loader/gguf_mmproj.py)
    image_mean: tuple[float, ...] | None = None
    image_std: tuple[float, ...] | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def text_config_of(arch: str, cfg: dict) -> dict:
    """The language model's config.json keys, as its causal LM's checkpoint would hold them."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    if arch == "Gemma3ForConditionalGeneration":     # the hub's files rely on these defaults
        from engine.vision.gemma3_config import TEXT_DEFAULTS
        text = {**TEXT_DEFAULTS, **text}
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):   # kept at the top level
        if key in cfg and key != "text_config":
            text.setdefault(key, cfg[key])
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    # M-RoPE's frequencies are the default RoPE's, split into sections (vision/mrope.py)
    for name in ("rope_scaling", "rope_parameters"):
        params = text.get(name)
        if isinstance(params, dict) and params.get("type", params.get("rope_type")) == "mrope":
            text[name] = {**params, "rope_type": "default", "type": "default"}
    text.update(_TEXT_OVERRIDES.get(arch, {}))
    text["architectures"] = [VISION_ARCHITECTURES[arch]]
    text.pop("model_type", None)
    return text


def parse_vision_config(arch: str, cfg: dict, head_dim: int) -> VisionConfig:
    if arch == "Gemma3ForConditionalGeneration":     # a SigLIP tower: settings of its own
        from engine.vision.gemma3_config import parse_gemma3_vision_config
        return parse_gemma3_vision_config(arch, cfg)
    if arch == "Mistral3ForConditionalGeneration":     # Pixtral's tower, plain RoPE
        from engine.vision.pixtral_config import parse_pixtral_config
        return parse_pixtral_config(arch, cfg)
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError(f"{arch}: config.json has no vision_config")
    text = cfg.get("text_config") or cfg
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    default_section = (24, 20, 20) if arch in QWEN3_VL else (16, 24, 24)
    section = tuple(int(s) for s in rope.get("mrope_section") or default_section)
    if 2 * sum(section) != head_dim:
        raise ValueError(f"{arch}: mrope_section {list(section)} covers {2 * sum(section)} "
                         f"rotary dims, the heads have {head_dim}")
    vision_rope = v.get("rope_parameters") or {}
    config = VisionConfig(
        architecture=arch, depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_heads"]),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=int(v.get("window_size", 112)),
        out_hidden_size=int(v.get("out_hidden_size") or text["hidden_size"]),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh" if arch in QWEN3_VL else "silu"),
        rope_theta=float(vision_rope.get("rope_theta") or 10000.0),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(cfg.get("vision_end_token_id", 151653)),
        mrope_section=section)
    for name in ("image_mean", "image_std"):
        if v.get(name) is not None:
            setattr(config, name, tuple(float(x) for x in v[name]))
    if arch in QWEN3_VL:
        _qwen3_vl_settings(config, v)
    elif config.hidden_act != "silu":
        raise ValueError(f"{arch}: vision hidden_act {config.hidden_act!r} is not supported "
                         "(silu only)")
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise ValueError(f"{arch}: vision head size {config.hidden_size}/{config.num_heads} "
                         "must be a multiple of 4 (2D rotary)")
    return config


def _qwen3_vl_settings(config: VisionConfig, v: dict) -> None:
    """Qwen3VLVisionConfig's keys (and its defaults) beyond Qwen2.5-VL's."""
    config.patch_size = int(v.get("patch_size", 16))
    config.mrope_interleaved = True          # Qwen3VLTextRotaryEmbedding, whatever the config
    config.num_position_embeddings = int(v.get("num_position_embeddings", 2304))
    config.deepstack_visual_indexes = tuple(
        int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24)))
    side = int(config.num_position_embeddings ** 0.5)
    if side * side != config.num_position_embeddings:
        raise ValueError(f"{config.architecture}: num_position_embeddings "
                         f"{config.num_position_embeddings} is not a square grid")
    bad = [i for i in config.deepstack_visual_indexes if not 0 <= i < config.depth]
    if bad:
        raise ValueError(f"{config.architecture}: deepstack_visual_indexes {bad} are not blocks "
                         f"of the {config.depth}-block vision tower")
    if config.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"{config.architecture}: vision hidden_act {config.hidden_act!r} is not "
                         "supported (gelu_pytorch_tanh or gelu)")


@dataclass(slots=True)
class ImageProcessorConfig:
    """preprocessor_config.json as transformers' Qwen2VLImageProcessor reads it."""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3             # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessorConfig":
        size = d.get("size") or {}
        c = cls()
        # transformers 5 writes size = {shortest_edge: min pixels, longest_edge: max pixels};
        # older files min_pixels / max_pixels (which win, as the processor's __init__ says)
        c.min_pixels = int(d.get("min_pixels") or size.get("shortest_edge") or size.get(
            "min_pixels") or c.min_pixels)
        c.max_pixels = int(d.get("max_pixels") or size.get("longest_edge") or size.get(
            "max_pixels") or c.max_pixels)
        for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if d.get(name) is not None:
                setattr(c, name, int(d[name]))
        for name in ("image_mean", "image_std"):
            if d.get(name) is not None:
                value = d[name]
                setattr(c, name, tuple(float(x) for x in (value if isinstance(value, list)
                                                          else [value] * 3)))
        if d.get("rescale_factor") is not None:
            c.rescale_factor = float(d["rescale_factor"])
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(name) is not None:
                setattr(c, name, bool(d[name]))
        return c

    @classmethod
    def from_pretrained(cls, model_dir: str, vision: VisionConfig) -> "ImageProcessorConfig":
        """The checkpoint's preprocessor_config.json; without one, the defaults with the vision
        tower's patch and merge sizes (and its config's mean and std, where it names them)."""
        path = os.path.join(model_dir, "preprocessor_config.json")
        if not os.path.isfile(path):
            c = cls()
            c.patch_size, c.merge_size = vision.patch_size, vision.spatial_merge_size
            c.temporal_patch_size = vision.temporal_patch_size
            c.image_mean = vision.image_mean or c.image_mean
            c.image_std = vision.image_std or c.image_std
            return c
        with open(path) as f:
            c = cls.from_dict(json.load(f))
        if (c.patch_size, c.merge_size, c.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ValueError(f"{path}: patch {c.patch_size} / merge {c.merge_size} / temporal "
                             f"{c.temporal_patch_size} differ from config.json's vision tower "
                             f"({vision.patch_size} / {vision.spatial_merge_size} / "
                             f"{vision.temporal_patch_size})")
        return c

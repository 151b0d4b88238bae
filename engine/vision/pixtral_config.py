"""Mistral 3's vision settings: the Pixtral tower and projector (config.json `vision_config` and
the top-level keys of Mistral3Config), and Pixtral's processor (processor_config.json: patch
size, spatial merge, the image token strings; preprocessor_config.json: the image processor's
longest edge, mean, std, resampling), with the image tokens' ids from the tokenizer's files.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# PixtralImageProcessor's defaults (OpenAI CLIP's mean and std).
PIXTRAL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXTRAL_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(slots=True)
class PixtralVisionConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    text_hidden_size: int
    projector_bias: bool
    projector_eps: float          # the projector's RMSNorm: the language model's rms_norm_eps
    in_channels: int = 3
    hidden_act: str = "gelu"
    projector_act: str = "gelu"
    rope_theta: float = 10000.0
    image_token_id: int = 10
    # [IMG_BREAK] and [IMG_END]'s ids where the config names them (a GGUF's vocabulary, beside
    # which no tokenizer files sit: engine/loader/gguf_mmproj_pixtral.py); else the tokenizer's
    image_break_token_id: int | None = None
    image_end_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size ** 2


def parse_pixtral_config(arch: str, cfg: dict) -> PixtralVisionConfig:
    v, text = cfg.get("vision_config"), cfg.get("text_config")
    if not isinstance(v, dict) or not isinstance(text, dict):
        raise ValueError(f"{arch}: config.json needs vision_config and text_config")
    rope = v.get("rope_parameters") or {}
    config = PixtralVisionConfig(
        architecture=arch, num_layers=int(v.get("num_hidden_layers", 24)),
        hidden_size=int(v.get("hidden_size", 1024)),
        intermediate_size=int(v.get("intermediate_size", 4096)),
        num_heads=int(v.get("num_attention_heads", 16)),
        patch_size=int(v.get("patch_size", 16)),
        spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
        text_hidden_size=int(text["hidden_size"]),
        projector_bias=bool(cfg.get("multimodal_projector_bias", False)),
        projector_eps=float(text.get("rms_norm_eps", 1e-5)),
        in_channels=int(v.get("num_channels", 3)),
        hidden_act=v.get("hidden_act", "gelu"),
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        rope_theta=float(rope.get("rope_theta") or v.get("rope_theta") or 10000.0),
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 10))),
        image_break_token_id=cfg.get("image_break_token_id"),
        image_end_token_id=cfg.get("image_end_token_id"))
    layer = cfg.get("vision_feature_layer", -1)
    if layer not in (-1, config.num_layers):
        raise ValueError(f"{arch}: vision_feature_layer {layer!r} is not supported (the last "
                         "layer's output only, -1)")
    if config.hidden_act not in ("gelu", "silu") or config.projector_act != "gelu":
        raise ValueError(f"{arch}: vision hidden_act {config.hidden_act!r} / projector "
                         f"{config.projector_act!r}: gelu or silu in the tower, gelu in the "
                         "projector only")
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{arch}: vision rope_type {rope.get('rope_type')!r}: axial only")
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise ValueError(f"{arch}: vision head size {config.hidden_size}/{config.num_heads} "
                         "must be a multiple of 4 (2D rotary)")
    return config


@dataclass(slots=True)
class PixtralProcessorConfig:
    """What PixtralProcessor and PixtralImageProcessorPil read from a checkpoint."""
    patch_size: int = 16            # the tower's patch
    merge_size: int = 1             # PixtralProcessor's spatial_merge_size
    longest_edge: int = 1024        # images are scaled down to fit a square of this side
    image_mean: tuple[float, ...] = PIXTRAL_MEAN
    image_std: tuple[float, ...] = PIXTRAL_STD
    rescale_factor: float = 1 / 255
    resample: int = 3               # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    image_token_id: int = 10
    image_break_token_id: int = 12
    image_end_token_id: int = 13

    @property
    def resize_unit(self) -> int:
        """Image sides are multiples of this (PixtralProcessor passes patch x merge as the image
        processor's patch size)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained(cls, model_dir: str, vision: PixtralVisionConfig
                        ) -> "PixtralProcessorConfig":
        """processor_config.json (its `image_processor` entry, or preprocessor_config.json,
        for the image processor's keys); without one, the tower's patch and merge sizes."""
        c = cls(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size)
        proc = _read_json(os.path.join(model_dir, "processor_config.json"))
        image = proc.get("image_processor") or _read_json(
            os.path.join(model_dir, "preprocessor_config.json"))
        if proc:
            c.patch_size = int(proc.get("patch_size", 16))
            c.merge_size = int(proc.get("spatial_merge_size", 1))
        size = image.get("size") or {}
        if size:
            if "longest_edge" not in size:
                raise ValueError(f"{model_dir}: the image processor's size {size} has no "
                                 "longest_edge")
            c.longest_edge = int(size["longest_edge"])
        for name in ("image_mean", "image_std"):
            if image.get(name) is not None:
                value = image[name]
                setattr(c, name, tuple(float(x) for x in (value if isinstance(value, list)
                                                          else [value] * 3)))
        if image.get("rescale_factor") is not None:
            c.rescale_factor = float(image["rescale_factor"])
        if image.get("resample") is not None:
            c.resample = int(image["resample"])
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if image.get(name) is not None:
                setattr(c, name, bool(image[name]))
        if (c.patch_size, c.merge_size) != (vision.patch_size, vision.spatial_merge_size):
            raise ValueError(f"{model_dir}: processor_config.json's patch {c.patch_size} / "
                             f"merge {c.merge_size} differ from config.json's "
                             f"({vision.patch_size} / {vision.spatial_merge_size})")
        names = [proc.get("image_token", "[IMG]"), proc.get("image_break_token", "[IMG_BREAK]"),
                 proc.get("image_end_token", "[IMG_END]")]
        if vision.image_break_token_id is not None and vision.image_end_token_id is not None:
            ids = [vision.image_token_id, vision.image_break_token_id, vision.image_end_token_id]
        else:
            ids = _special_token_ids(model_dir, names)
        c.image_token_id, c.image_break_token_id, c.image_end_token_id = ids
        if c.image_token_id != vision.image_token_id:
            raise ValueError(f"{model_dir}: the tokenizer's {names[0]} is {c.image_token_id}, "
                             f"config.json's image_token_index {vision.image_token_id}")
        return c


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _special_token_ids(model_dir: str, names: list[str]) -> list[int]:
    """The ids of the tokenizer's added tokens `names` (tokenizer.json, else
    tokenizer_config.json's added_tokens_decoder); ValueError naming a missing one."""
    found = {t["content"]: int(t["id"]) for t in
             _read_json(os.path.join(model_dir, "tokenizer.json")).get("added_tokens") or ()}
    decoder = _read_json(os.path.join(model_dir, "tokenizer_config.json")).get(
        "added_tokens_decoder") or {}
    for i, t in decoder.items():
        found.setdefault(t.get("content"), int(i))
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{model_dir}: the tokenizer has no {', '.join(missing)} token (the "
                         "image tokens processor_config.json names)")
    return [found[n] for n in names]

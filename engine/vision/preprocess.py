"""An image as a vision tower reads it: Qwen2-VL's image processor (transformers'
Qwen2VLImageProcessorPil, which Qwen2.5-VL uses), step for step so that the pixels are the same
bits: RGB (transparency composited on white), a resize with Pillow to sides that are multiples
of patch x merge with the pixel count within [min_pixels, max_pixels] ("smart resize"), values
x rescale_factor in float64 then float32, (x - mean) / std in float32, then patches of
channels x temporal_patch_size x patch x patch values (a still image's frame repeated over the
temporal patch), ordered so that each merge x merge group of patches is contiguous.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from engine.vision.config import ImageProcessorConfig


@dataclass(slots=True, eq=False)
class ProcessedImage:
    pixel_values: np.ndarray      # (t * h * w, patch_dim) float32: the vision tower's input
    grid_thw: tuple[int, int, int]  # patches along time, height and width
    num_tokens: int               # language-model tokens: t * h * w / merge^2
    content_hash: int             # 64 bits of BLAKE2b over the RGB pixels and their size
    size: tuple[int, int]         # (width, height) as decoded

    def prompt_tokens(self, image_token_id: int) -> list[int]:
        """Its run in the prompt, which replaces the chat template's one image token."""
        return [image_token_id] * self.num_tokens


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of factor, the pixel count within [min_pixels, max_pixels],
    the aspect ratio kept as closely as possible (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio must be under 200, got "
                         f"{max(height, width) / min(height, width):.1f} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image):
    """A PIL image as RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def content_hash(rgb: np.ndarray) -> int:
    shape = np.array(rgb.shape, np.int64).tobytes()[:16]
    digest = hashlib.blake2b(rgb.tobytes(), digest_size=8, person=b"taper-image", salt=shape)
    return int.from_bytes(digest.digest(), "little")


def preprocess_image(image, cfg: ImageProcessorConfig) -> ProcessedImage:
    """A decoded PIL image -> the vision tower's patches (module docstring)."""
    if not cfg.do_convert_rgb and image.mode != "RGB":
        raise ValueError(f"image mode {image.mode}: this model's processor takes RGB only")
    rgb = to_rgb(image) if cfg.do_convert_rgb else image
    width, height = rgb.size
    h_hash = content_hash(np.asarray(rgb))
    factor = cfg.patch_size * cfg.merge_size
    if cfg.do_resize:
        new_h, new_w = smart_resize(height, width, factor, cfg.min_pixels, cfg.max_pixels)
        rgb = rgb.resize((new_w, new_h), resample=cfg.resample)
    pixels = np.asarray(rgb).transpose(2, 0, 1)              # (C, H, W) uint8
    if cfg.do_rescale:
        pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, np.float32)[:, None, None]
        std = np.array(cfg.image_std, np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    C, H, W = pixels.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if H % factor or W % factor:
        raise ValueError(f"image of {W}x{H} pixels: sides must be multiples of {factor} "
                         "(resizing is off in preprocessor_config.json)")
    gh, gw = H // p, W // p
    patches = pixels.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    pixel_values = np.ascontiguousarray(patches.reshape(gh * gw, C * t * p * p))
    return ProcessedImage(pixel_values, (1, gh, gw), gh * gw // (m * m), h_hash, (width, height))

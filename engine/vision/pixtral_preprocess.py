"""An image as Mistral 3's Pixtral tower reads it: PixtralProcessor over PixtralImageProcessorPil,
step for step so that the pixels are the same bits: RGB (transparency composited on white),
scaled down (never up) to fit a square of longest_edge pixels, the sides (floored) then rounded
up to multiples of patch x merge, resized with Pillow; values x rescale_factor in float64 then
float32, (x - mean) / std in float32; then patches of channels x patch x patch values, row by
row over the patch grid (the tower's convolution takes them so).

The prompt holds an image as its rows of merged patches: each row `columns` [IMG] tokens and an
[IMG_BREAK], the last row's break an [IMG_END] instead (PixtralProcessor.replace_image_token);
only the [IMG] tokens take the tower's outputs, the breaks keep their token embeddings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.vision.pixtral_config import PixtralProcessorConfig
from engine.vision.preprocess import ProcessedImage, content_hash, to_rgb


@dataclass(slots=True, eq=False)
class PixtralImage(ProcessedImage):
    tokens: tuple[int, ...]       # its run in the prompt: rows of [IMG]s ended by breaks

    def prompt_tokens(self, image_token_id: int) -> list[int]:
        return list(self.tokens)


def resized_size(height: int, width: int, cfg: PixtralProcessorConfig) -> tuple[int, int]:
    """(height, width) as transformers' pixtral get_resize_output_image_size."""
    ratio = max(height / cfg.longest_edge, width / cfg.longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    unit = cfg.resize_unit
    return ((height - 1) // unit + 1) * unit, ((width - 1) // unit + 1) * unit


def image_tokens(rows: int, columns: int, cfg: PixtralProcessorConfig) -> tuple[int, ...]:
    row = [cfg.image_token_id] * columns + [cfg.image_break_token_id]
    tokens = row * rows
    tokens[-1] = cfg.image_end_token_id
    return tuple(tokens)


def preprocess_pixtral(image, cfg: PixtralProcessorConfig) -> PixtralImage:
    """A decoded PIL image -> the tower's patches and its prompt tokens (module docstring)."""
    if not cfg.do_convert_rgb and image.mode != "RGB":
        raise ValueError(f"image mode {image.mode}: this model's processor takes RGB only")
    rgb = to_rgb(image) if cfg.do_convert_rgb else image
    width, height = rgb.size
    h_hash = content_hash(np.asarray(rgb))
    if cfg.do_resize:
        new_h, new_w = resized_size(height, width, cfg)
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
    p, unit = cfg.patch_size, cfg.resize_unit
    if H % unit or W % unit:
        raise ValueError(f"image of {W}x{H} pixels: sides must be multiples of {unit} "
                         "(resizing is off in the image processor's config)")
    gh, gw = H // p, W // p
    patches = pixels.reshape(C, gh, p, gw, p).transpose(1, 3, 0, 2, 4)
    pixel_values = np.ascontiguousarray(patches.reshape(gh * gw, C * p * p))
    tokens = image_tokens(H // unit, W // unit, cfg)
    return PixtralImage(pixel_values, (1, gh, gw), len(tokens), h_hash, (width, height), tokens)

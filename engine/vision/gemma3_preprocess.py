"""Gemma 3's image processor (transformers' Gemma3ImageProcessorPil), step for step so that the
pixels are the same bits: RGB (transparency composited on white), a resize with Pillow to the
fixed size (no aspect kept, BILINEAR by default), values x rescale_factor in float64 then
float32, (x - mean) / std in float32, then the SigLIP patches (row-major, each patch's channels
x patch x patch values, the patch embedding Conv2d's kernel order).

Pan-and-scan (off by default, as in transformers; on where the processor config sets
do_pan_and_scan): an image whose aspect ratio reaches pan_and_scan_min_ratio_to_activate is also
cut into 2 to pan_and_scan_max_num_crops equal crops along its long side (none under
pan_and_scan_min_crop_size pixels a side), each resized and encoded as an image of its own after
the original (PanAndScanImage); the prompt text then holds the original's and each crop's
tokens (Gemma3VisionConfig.image_text).
"""
from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass

import numpy as np

from engine.vision.gemma3_config import Gemma3VisionConfig
from engine.vision.preprocess import ProcessedImage, content_hash, to_rgb

IMAGENET_STANDARD = (0.5, 0.5, 0.5)       # Gemma3ImageProcessor's mean and std


@dataclass(slots=True)
class PanAndScanImage:
    """One image of the request with pan-and-scan on: its views, the original first, then its
    crops (none where the image is not wide or tall enough), each a ProcessedImage."""
    views: list[ProcessedImage]

    @property
    def num_crops(self) -> int:
        return len(self.views) - 1


@dataclass(slots=True)
class Gemma3ImageProcessor:
    """preprocessor_config.json as transformers' Gemma3ImageProcessorPil reads it."""
    height: int
    width: int
    patch_size: int
    tokens_per_side: int          # the projector's pooled grid: the image's tokens
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    rescale_factor: float = 1 / 255
    resample: int = 2             # PIL's BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    # Gemma3Processor's defaults (preprocessor_config.json leaves them null)
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2

    @classmethod
    def from_dict(cls, d: dict, vision: Gemma3VisionConfig, where: str) -> "Gemma3ImageProcessor":
        size = d.get("size") or {}
        c = cls(int(size.get("height", vision.image_size)),
                int(size.get("width", vision.image_size)), vision.patch_size,
                vision.tokens_per_side)
        for name in ("image_mean", "image_std"):
            if d.get(name) is not None:
                value = d[name]
                setattr(c, name, tuple(float(x) for x in (value if isinstance(value, list)
                                                          else [value] * 3)))
        if d.get("rescale_factor") is not None:
            c.rescale_factor = float(d["rescale_factor"])
        if d.get("resample") is not None:
            c.resample = int(d["resample"])
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb",
                     "do_pan_and_scan"):
            if d.get(name) is not None:
                setattr(c, name, bool(d[name]))
        for name, kind in (("pan_and_scan_min_crop_size", int),
                           ("pan_and_scan_max_num_crops", int),
                           ("pan_and_scan_min_ratio_to_activate", float)):
            if d.get(name) is not None:
                setattr(c, name, kind(d[name]))
        if c.do_pan_and_scan and (c.pan_and_scan_min_crop_size < 1
                                  or c.pan_and_scan_max_num_crops < 2):
            raise ValueError(f"{where}: pan-and-scan needs pan_and_scan_min_crop_size >= 1 and "
                             f"pan_and_scan_max_num_crops >= 2, got "
                             f"{c.pan_and_scan_min_crop_size} and "
                             f"{c.pan_and_scan_max_num_crops}")
        if (c.height, c.width) != (vision.image_size, vision.image_size):
            raise ValueError(f"{where}: images resized to {c.width}x{c.height}, the vision "
                             f"tower takes {vision.image_size}x{vision.image_size}")
        return c

    @classmethod
    def from_pretrained(cls, model_dir: str, vision: Gemma3VisionConfig
                        ) -> "Gemma3ImageProcessor":
        """preprocessor_config.json, else processor_config.json's image_processor (transformers
        5 saves), else the defaults for the tower's image size."""
        for name, key in (("preprocessor_config.json", None),
                          ("processor_config.json", "image_processor")):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path) as f:
                    d = json.load(f)
                if key is not None:
                    d = d.get(key)
                if isinstance(d, dict):
                    return cls.from_dict(d, vision, path)
        return cls.from_dict({}, vision, model_dir)

    def preprocess(self, image) -> ProcessedImage | PanAndScanImage:
        """A decoded PIL image -> the tower's patches (module docstring); with pan-and-scan on,
        those of the image and of each of its crops."""
        if not self.do_convert_rgb and image.mode != "RGB":
            raise ValueError(f"image mode {image.mode}: this model's processor takes RGB only")
        rgb = to_rgb(image) if self.do_convert_rgb else image
        if not self.do_pan_and_scan:
            return self._view(rgb)
        return PanAndScanImage([self._view(rgb)]
                               + [self._view(rgb.crop(box)) for box in self.crop_boxes(*rgb.size)])

    def crop_boxes(self, width: int, height: int) -> list[tuple[int, int, int, int]]:
        """Pan-and-scan's crops of a width x height image as PIL boxes (left, top, right,
        bottom), in transformers' order (row by row); the last one along the long side stops at
        the image's edge, as a numpy slice does."""
        long, short = max(width, height), min(width, height)
        if long / short < self.pan_and_scan_min_ratio_to_activate:
            return []
        n = int(math.floor(long / short + 0.5))          # half rounds up
        n = min(int(math.floor(long / self.pan_and_scan_min_crop_size)), n)
        n = min(self.pan_and_scan_max_num_crops, max(2, n))
        nw, nh = (n, 1) if width >= height else (1, n)
        cw, ch = int(math.ceil(width / nw)), int(math.ceil(height / nh))
        if min(cw, ch) < self.pan_and_scan_min_crop_size:
            return []
        return [(x, y, min(x + cw, width), min(y + ch, height))
                for y, x in itertools.product(range(0, ch * nh, ch), range(0, cw * nw, cw))]

    def _view(self, rgb) -> ProcessedImage:
        size = rgb.size
        digest = content_hash(np.asarray(rgb))
        if self.do_resize:
            rgb = rgb.resize((self.width, self.height), resample=self.resample)
        elif rgb.size != (self.width, self.height):
            raise ValueError(f"image of {rgb.size[0]}x{rgb.size[1]} pixels: resizing is off in "
                             f"the preprocessor config, the model takes {self.width}x"
                             f"{self.height}")
        pixels = np.asarray(rgb).transpose(2, 0, 1)              # (C, H, W) uint8
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            pixels = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, np.float32)[:, None, None]
            std = np.array(self.image_std, np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        C, H, W = pixels.shape
        p = self.patch_size
        gh, gw = H // p, W // p
        patches = pixels.reshape(C, gh, p, gw, p).transpose(1, 3, 0, 2, 4)
        pixel_values = np.ascontiguousarray(patches.reshape(gh * gw, C * p * p))
        side = self.tokens_per_side
        return ProcessedImage(pixel_values, (1, side, side), side * side, digest, size)

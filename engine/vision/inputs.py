"""A prompt's images: where their tokens sit, their M-RoPE positions, their prefix-cache keys.

The prompt holds each image as a run of `num_tokens` image tokens (<|image_pad|> expanded by the
server when it renders the chat template). M-RoPE (Qwen2-VL's multimodal rotary) gives every
token three positions, temporal, height and width, as transformers' get_rope_index does: a text
token's three are equal and count on from the previous token; an image's tokens take
(start + t, start + row, start + column) over its merged grid, with `start` the position after
the text before it; the text after an image goes on from start + max(rows, columns). So a token
at index p past the images sits at position p + delta, delta the sum over earlier images of
max(rows, columns) - num_tokens (negative: an image's rows and columns share positions).
Generated tokens go on in the same way, from the prompt's last position + 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.vision.config import VisionConfig
from engine.vision.preprocess import ProcessedImage


@dataclass(slots=True, eq=False)
class PlacedImage:
    image: ProcessedImage
    offset: int                 # index of its first token in the prompt
    grid: tuple[int, int, int]  # merged grid: (t, rows, columns); t * rows * columns tokens
    rope_start: int             # its positions start here
    delta_after: int            # delta of the tokens after it

    @property
    def num_tokens(self) -> int:
        return self.image.num_tokens

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens


@dataclass(slots=True, eq=False)
class MultimodalPrompt:
    images: list[PlacedImage]
    # images whose encoder work the scheduler has counted (engine/vision/budget.py)
    budgeted: set[int] = field(default_factory=set)

    @classmethod
    def place(cls, prompt_ids: list[int], images: list[ProcessedImage],
              vision: VisionConfig) -> "MultimodalPrompt":
        """The images at the prompt's runs of image tokens, in order; ValueError when the runs
        and the images do not match one to one."""
        ids = np.asarray(prompt_ids)
        at = np.flatnonzero(ids == vision.image_token_id)
        runs = np.split(at, np.flatnonzero(np.diff(at) != 1) + 1) if len(at) else []
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} runs of image tokens for "
                             f"{len(images)} images")
        merge = vision.spatial_merge_size
        placed, delta = [], 0
        for i, (run, image) in enumerate(zip(runs, images)):
            t, h, w = image.grid_thw
            grid = (t, h // merge, w // merge)
            if len(run) != image.num_tokens or t * grid[1] * grid[2] != image.num_tokens:
                raise ValueError(f"image {i} needs {image.num_tokens} image tokens, the prompt "
                                 f"has a run of {len(run)}")
            start = int(run[0]) + delta
            delta += max(grid[1], grid[2]) - image.num_tokens
            placed.append(PlacedImage(image, int(run[0]), grid, start, delta))
        return cls(placed)

    @property
    def rope_delta(self) -> int:
        return self.images[-1].delta_after if self.images else 0

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indexes of the images with tokens in [start, end)."""
        return [i for i, im in enumerate(self.images) if im.offset < end and im.end > start]

    def rope_positions(self, start: int, n: int):
        """Tokens [start, start + n): (positions (n,) int64 of the text tokens, with the image
        tokens' rows at -1; the image rows (K,) within the n; their (t, h, w) positions (K, 3);
        (image index, first token, end token) of each image run among them)."""
        p = np.arange(start, start + n, dtype=np.int64)
        pos = p.copy()
        rows, triples, runs = [], [], []
        for i, im in enumerate(self.images):
            pos += (p >= im.end) * (im.delta_after - (self.images[i - 1].delta_after
                                                        if i else 0))
            a, b = max(start, im.offset), min(start + n, im.end)
            if a >= b:
                continue
            k = np.arange(a - im.offset, b - im.offset)
            _, gh, gw = im.grid
            triples.append(np.stack([k // (gh * gw), (k // gw) % gh, k % gw], 1) + im.rope_start)
            rows.append(np.arange(a - start, b - start))
            runs.append((i, a - im.offset, b - im.offset))
            pos[a - start:b - start] = -1
        if not rows:
            return pos, np.zeros(0, np.int64), np.zeros((0, 3), np.int64), runs
        return pos, np.concatenate(rows), np.concatenate(triples), runs

    def block_key(self, tokens, start: int, end: int) -> tuple:
        """A prefix-cache block's key: its tokens and, for each image with tokens in it, the
        image's content hash and first token (the image tokens' ids are all alike)."""
        key = tuple(tokens)
        for i in self.overlapping(start, end):
            im = self.images[i]
            key += (("image", im.image.content_hash, im.offset),)
        return key

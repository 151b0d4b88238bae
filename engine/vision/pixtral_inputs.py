"""A Mistral 3 prompt's images: where their runs sit. Plain RoPE: every token, an image's
included, keeps its index as its position, so beside MultimodalPrompt's prefix-cache keys and
budget bookkeeping (engine/vision/inputs.py) only the placement differs: an image's run is its
rows of [IMG] tokens with their [IMG_BREAK]s and final [IMG_END] (engine/vision/
pixtral_preprocess.py), found where the prompt holds exactly that run."""
from __future__ import annotations

import numpy as np

from engine.vision.inputs import MultimodalPrompt, PlacedImage


class PixtralPrompt(MultimodalPrompt):
    @classmethod
    def place(cls, prompt_ids: list[int], images: list, vision) -> "PixtralPrompt":
        """Each image at the next [IMG] token, the prompt holding its run there; ValueError
        when a run is not there or image tokens are left over."""
        ids = np.asarray(prompt_ids)
        placed, cursor = [], 0
        for i, image in enumerate(images):
            starts = np.flatnonzero(ids[cursor:] == vision.image_token_id)
            if not len(starts):
                raise ValueError(f"the prompt has image tokens for {i} of its {len(images)} "
                                 "images")
            start = cursor + int(starts[0])
            run = np.asarray(image.tokens)
            if not np.array_equal(ids[start:start + len(run)], run):
                raise ValueError(f"image {i} needs a run of {len(run)} tokens ({image.grid_thw[1]}"
                                 f"x{image.grid_thw[2]} patches in rows ended by breaks); the "
                                 f"prompt's differs at token {start}")
            rows = int(np.count_nonzero(run != vision.image_token_id))
            placed.append(PlacedImage(image, start, (1, rows, len(run) // rows - 1), start, 0))
            cursor = start + len(run)
        if np.any(ids[cursor:] == vision.image_token_id):
            raise ValueError(f"the prompt has more image tokens than its {len(images)} images' "
                             "runs")
        return cls(placed)

    def rope_positions(self, start: int, n: int):
        """Tokens [start, start + n): (their positions (n,), their rows within the n that are
        image runs', None: no per-row positions of their own, (image index, first token, end
        token) of each image run among them)."""
        rows, runs = [], []
        for i, im in enumerate(self.images):
            a, b = max(start, im.offset), min(start + n, im.end)
            if a < b:
                rows.append(np.arange(a - start, b - start))
                runs.append((i, a - im.offset, b - im.offset))
        rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return np.arange(start, start + n, dtype=np.int64), rows, None, runs

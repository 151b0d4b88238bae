"""A vision-language model's part of a step, beside engine/runner/model_runner.py.

prepare (with the batch arrays, on the engine thread): the rows' positions become M-RoPE
positions (engine/vision/inputs.py): a text row's one position, which the model's RoPE cache
holds; an image row gets a row past that cache's positions, which the model fills for this
step with the cos/sin of its (t, h, w) positions (engine/models/qwen2_5_vl.py). A plain-RoPE
family's prompt (engine/vision/pixtral_inputs.py) gives no (t, h, w) positions: its image rows
keep their own. The image rows
and the image runs whose embeddings they take go with the batch (VisionBatch).
encode (on the forward thread, before the forward): each image run's encoder output, from the
encoder cache or computed there once per image, gathered into the rows' embeddings.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from engine.vision.encoder_cache import EncoderCache

DEFAULT_CACHE_BYTES = 512 * 2**20


@dataclass(slots=True)
class VisionBatch:
    rows: np.ndarray              # (K,) int32: the batch rows of image tokens
    triples: np.ndarray | None    # (K, 3) int32: their temporal/height/width positions (M-RoPE)
    runs: list = field(default_factory=list)   # (PlacedImage, first, end) per run, row order
    embeds: object = None         # (K, hidden) f32 on the backend, set by encode()


class VisionRunner:
    def __init__(self, model, backend, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.model = model
        self.backend = backend
        self.cache = EncoderCache(cache_bytes)
        self.num_encoded = 0          # images run through the encoder (tests, metrics)

    def prepare(self, sched, batch) -> None:
        """In place: batch.positions as M-RoPE rows, batch.vision when the step has image rows
        (and the model's extra RoPE rows numbered from model.rope_rows)."""
        positions = batch.positions.copy()
        qsl = batch.query_start_loc
        rows, triples, runs = [], [], []
        for b, (seq, a, n) in enumerate(zip(sched.seqs, sched.num_computed,
                                            sched.num_new_tokens)):
            mm = getattr(seq, "mm", None)
            if mm is None:
                continue
            q0 = int(qsl[b])
            pos, img_rows, img_triples, img_runs = mm.rope_positions(a, n)
            positions[q0:q0 + n] = pos
            if len(img_rows):
                rows.append(img_rows + q0)
                triples.append(img_triples)
                runs += [(mm.images[i], s, e) for i, s, e in img_runs]
        if rows:
            rows = np.concatenate(rows).astype(np.int32)
            if triples[0] is None:      # plain RoPE (Mistral 3): image rows keep their positions
                triples = None
            else:
                positions[rows] = self.model.rope_rows + np.arange(len(rows), dtype=np.int32)
                triples = np.concatenate(triples).astype(np.int32)
            batch.vision = VisionBatch(rows, triples, runs)
        batch.positions = positions

    def for_peers(self, inputs):
        """Rank 0 of a tensor-parallel group: the step's inputs as the other ranks get them
        (engine/parallel/sharding_vision.py: they hold no tower). The images encoded here, once,
        and their embeddings sent on the host in place of the images' pixels; the other fields
        are the batch's own."""
        vb = inputs.batch.vision
        if vb is None:
            return inputs
        self.encode(inputs.batch)
        embeds = np.asarray(self.backend.to_host(vb.embeds))
        # (a family's own batch kind keeps its fields: Gemma 3's image spans)
        batch = dataclasses.replace(inputs.batch,
                                    vision=dataclasses.replace(vb, runs=[], embeds=embeds))
        return dataclasses.replace(inputs, batch=batch)

    def encode(self, batch) -> None:
        """batch.vision.embeds from the encoder cache, encoding each missing image once."""
        vb = batch.vision
        if vb is None or vb.embeds is not None:     # (rank 0 encoded them before sending)
            return
        needed = {im.image.content_hash for im, _, _ in vb.runs}
        parts = []
        for im, first, end in vb.runs:
            key = im.image.content_hash
            out = self.cache.get(key)
            if out is None:
                out = self.model.vision_encoder.encode(im.image.pixel_values, im.image.grid_thw)
                self.num_encoded += 1
                self.cache.put(key, out, needed)
            parts.append(out[first:end])
        xp = self.backend.xp
        vb.embeds = parts[0] if len(parts) == 1 else xp.concatenate(parts)

"""Qwen2.5-VL: Qwen2's language model with M-RoPE, and its vision tower
(engine/vision/qwen2_5_vl_encoder.py) whose outputs replace the image tokens' embeddings.

M-RoPE without a kernel of its own: a text token's three positions are equal, so the usual RoPE
cache row of that position is its rotation; an image token's row is gathered from three rows,
each rotary frequency taking the row of its section's position (t, h or w: mrope_section). The
cache has room past its positions for those gathered rows, one per image token of a step
(engine/vision/runner.py numbers them; engine/vision/budget.py holds a step's image tokens under
that room)."""
from __future__ import annotations

import numpy as np

from engine.models.llama import LlamaForCausalLM
from engine.parallel.stages_vision import holds_tower
from engine.vision import act_arrays
from engine.vision.qwen2_5_vl_encoder import Qwen25VisionEncoder
from pyx.backend import Backend

# The backend ops the vision tower needs beyond the language model's.
VISION_OPS = ("gelu", "encoder_attention")


def missing_ops(backend_class, ops=VISION_OPS) -> list[str]:
    """The ops of `ops` that a backend class leaves to the op table's base class (which raises
    NotImplementedError) or lacks."""
    return [op for op in ops if getattr(backend_class, op, None) in (None, getattr(Backend, op))]


def _checkpoint_names(weights: dict) -> None:
    """transformers 5's in-memory names (model.language_model.*, model.visual.*) as the files
    name them (model.*, visual.*)."""
    for name in list(weights):
        if name.startswith("model.language_model."):
            weights["model." + name[len("model.language_model."):]] = weights.pop(name)
        elif name.startswith("model.visual."):
            weights[name[len("model."):]] = weights.pop(name)


def mrope_sections(vision) -> np.ndarray:
    """(rot_dim / 2,) int: which position (0 t, 1 h, 2 w) each rotary frequency rotates by.
    Qwen2.5-VL: three runs of mrope_section's lengths; Qwen3-VL (interleaved): t, h, w in turn
    over the first 3 x section[1] and 3 x section[2] frequencies, t for the rest (transformers'
    Qwen3VLTextRotaryEmbedding.recomposition_frequencies)."""
    section = vision.mrope_section
    if not vision.mrope_interleaved:
        return np.repeat(np.arange(3), section)
    j = np.arange(sum(section))
    out = np.zeros(len(j), np.int64)
    out[(j % 3 == 1) & (j < 3 * section[1])] = 1
    out[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return out


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    vision_tower_class = Qwen25VisionEncoder
    _checkpoint_names = staticmethod(_checkpoint_names)

    def __init__(self, config, weights: dict, backend):
        missing = missing_ops(type(backend))
        if missing:
            raise ValueError(f"{config.architecture}: the {backend.name} backend has no "
                             f"{' and '.join(missing)} op{'s' if len(missing) > 1 else ''}, "
                             "which the vision tower needs; serve this model with --backend cpu")
        self._checkpoint_names(weights)
        # the tower is rank 0's alone (under tensor parallel, and the first stage's under
        # pipeline parallel): the others read its embeddings from each step's inputs
        # (engine/parallel/sharding_vision.py, stages_vision.py)
        self.vision_encoder = (self.vision_tower_class(config.vision, weights, backend)
                               if holds_tower(config) else None)
        self._mrope_cache = None
        super().__init__(config, weights, backend)
        section = mrope_sections(config.vision)                          # (rot_dim / 2,)
        self._section = backend.asarray(np.concatenate([section, section]).astype(np.int64))
        self._cols = backend.asarray(np.arange(2 * len(section), dtype=np.int64))

    def _rope_cache(self, i: int):
        """The cos/sin cache with as many rows again past its positions, shared by all layers."""
        if self._mrope_cache is None:
            base = self.cos_sin_cache
            self.rope_rows = base.shape[0]
            cache = self.xp.zeros((2 * base.shape[0], base.shape[1]), np.float32)
            cache[:base.shape[0]] = base
            self._mrope_cache = cache
        return self._mrope_cache

    @property
    def max_image_rows(self) -> int:
        """Image tokens one step can hold (their gathered RoPE rows)."""
        return self.rope_rows

    def forward(self, batch, kv_caches: list, *args, **kwargs):
        stage = self.config.pipeline
        if stage is not None and not stage.first and batch.vision is not None:
            # a later pipeline stage: the step's image rows rotate by the M-RoPE cache rows
            # the first stage's merge fills on its rank (engine/parallel/stages_vision.py)
            self._fill_mrope_rows(batch.vision)
        return super().forward(batch, kv_caches, *args, **kwargs)

    def _merge_inputs(self, batch, residual):
        vb = batch.vision
        rows = self.backend.asarray(vb.rows)
        # (columns past the hidden size are a family's extras: Qwen3-VL's DeepStack features)
        act_arrays.set_rows(self.xp, residual, rows, vb.embeds[:, :self.config.hidden_size])
        self._fill_mrope_rows(vb)

    def _fill_mrope_rows(self, vb) -> None:
        """The step's image rows' cos/sin, each gathered from its (t, h, w) positions' rows."""
        K = len(vb.rows)
        if K > self.rope_rows:
            raise ValueError(f"{K} image tokens in one step; the RoPE cache has room for "
                             f"{self.rope_rows}")
        triples = self.backend.asarray(vb.triples.astype(np.int64))      # (K, 3)
        cache = self._mrope_cache
        cache[self.rope_rows:self.rope_rows + K] = cache[triples[:, self._section],
                                                         self._cols[None, :]]

"""Gemma 3 with vision (transformers' Gemma3ForConditionalGeneration): Gemma 3's language model
(engine/models/gemma.py) whose image tokens take the SigLIP tower's projected outputs
(engine/vision/gemma3_encoder.py) in place of their (scaled) embeddings, and attend to the other
tokens of their image both ways during prefill (engine/vision/gemma3_attention.py). Positions are
plain 1D RoPE positions, image tokens counted like text."""
from __future__ import annotations

import numpy as np

from engine.models.gemma import Gemma3ForCausalLM
from engine.models.qwen2_5_vl import missing_ops
from engine.parallel.stages_vision import holds_tower
from engine.vision import act_arrays
from engine.vision.gemma3_attention import Gemma3VisionRunner, ImageBlockAttention
from engine.vision.gemma3_encoder import Gemma3VisionEncoder

# The backend ops the SigLIP tower needs beyond the language model's.
TOWER_OPS = ("encoder_attention", "layer_norm", "fused_add_layer_norm")

# Checkpoint prefixes -> the names this code reads: the hub's files (language_model.model.*,
# vision_tower.vision_model.*), transformers 5's in-memory names (model.language_model.*, ...)
# and its saves (vision_tower.encoder.*, without vision_model).
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("vision_tower.vision_model.", "vision_tower."))


def _checkpoint_names(weights: dict) -> None:
    for name in list(weights):
        new = name
        for old, to in _RENAMES:
            if new.startswith(old):
                new = to + new[len(old):]
        if new != name:
            weights[new] = weights.pop(name)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    vision_runner = Gemma3VisionRunner

    def __init__(self, config, weights: dict, backend):
        missing = missing_ops(type(backend), TOWER_OPS)
        if missing:
            raise ValueError(f"{config.architecture}: the {backend.name} backend has no "
                             f"{' and '.join(missing)} op{'s' if len(missing) > 1 else ''}, "
                             "which the SigLIP tower needs; serve this model with --backend cpu")
        _checkpoint_names(weights)
        # the tower is rank 0's alone (under tensor parallel, and the first stage's under
        # pipeline parallel): the others read its embeddings from each step's inputs
        # (engine/parallel/sharding_vision.py, stages_vision.py)
        self.vision_encoder = (Gemma3VisionEncoder(config.vision, weights, backend)
                               if holds_tower(config) else None)
        # the CPU keeps its float32 overlay on every layer (engine/vision/gemma3_attention.py)
        self._image_blocks = ImageBlockAttention(
            backend.xp, paged_backend=None if backend.name == "cpu" else backend)
        super().__init__(config, weights, backend)

    def _attention(self, weights: dict, p: str, i: int):
        attn = super()._attention(weights, p, i)
        attn.mask_overlay = self._image_blocks
        return attn

    def new_kv_caches(self, num_blocks: int, block_size: int, dtype) -> list:
        if np.dtype(dtype).itemsize == 1:
            raise ValueError(f"{self.config.architecture}: an FP8 KV cache is not supported: the "
                             "image tokens' bidirectional attention reads the float cache back "
                             "(engine/vision/gemma3_attention.py); use --kv-cache-dtype auto")
        return super().new_kv_caches(num_blocks, block_size, dtype)

    @property
    def max_image_rows(self) -> int:
        """Image tokens one step can hold: no limit of the model's own (no M-RoPE rows)."""
        return 1 << 30

    @property
    def whole_image_tokens(self) -> int:
        """An image's tokens, computed in one step (engine/vision/budget.py)."""
        return self.config.vision.mm_tokens_per_image

    def _merge_inputs(self, batch, residual):
        act_arrays.set_rows(self.xp, residual, self.backend.asarray(batch.vision.rows),
                            batch.vision.embeds)

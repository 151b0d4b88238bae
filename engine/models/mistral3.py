"""Mistral 3 (Mistral3ForConditionalGeneration): Mistral's language model, plain RoPE, with
Pixtral's vision tower and Mistral 3's projector (engine/vision/pixtral_encoder.py), whose outputs
replace the [IMG] tokens' embeddings; an image's [IMG_BREAK]s and [IMG_END] keep their own
(transformers' masked_scatter over the image token)."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2_5_vl import missing_ops
from engine.parallel.stages_vision import holds_tower
from engine.vision import act_arrays
from engine.vision.pixtral_encoder import PixtralVisionEncoder


def _checkpoint_names(weights: dict) -> None:
    """The hub's names (language_model.model.*, language_model.lm_head.*) and transformers 5's
    in-memory ones (model.language_model.*, model.vision_tower.*, ...) as a causal LM's
    (model.*, lm_head.*) beside vision_tower.* and multi_modal_projector.*."""
    renames = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
               ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."))
    for name in list(weights):
        for old, new in renames:
            if name.startswith(old):
                weights[new + name[len(old):]] = weights.pop(name)
                break


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    # plain RoPE: an image's rows need no RoPE rows of their own, so no per-step limit
    max_image_rows = 2 ** 62

    def __init__(self, config, weights: dict, backend):
        missing = missing_ops(type(backend))
        if missing:
            raise ValueError(f"{config.architecture}: the {backend.name} backend has no "
                             f"{' and '.join(missing)} op{'s' if len(missing) > 1 else ''}, "
                             "which the Pixtral tower needs; serve this model with --backend cpu")
        _checkpoint_names(weights)
        # the tower is rank 0's alone (under tensor parallel, and the first stage's under
        # pipeline parallel): the others read its embeddings from each step's inputs
        # (engine/parallel/sharding_vision.py, stages_vision.py)
        self.vision_encoder = (PixtralVisionEncoder(config.vision, weights, backend)
                               if holds_tower(config) else None)
        super().__init__(config, weights, backend)

    def _merge_inputs(self, batch, residual):
        vb = batch.vision
        rows = self.backend.asarray(vb.rows)
        keep = batch.token_ids[rows] == self.config.vision.image_token_id
        act_arrays.set_rows(self.xp, residual, rows[keep], vb.embeds[keep])

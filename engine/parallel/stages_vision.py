"""A vision-language model split into pipeline stages (engine/parallel/pipeline.py).

- The tower is the first stage's, built and run on its tensor-parallel rank 0 (rank 0), as under
  tensor parallel (engine/parallel/sharding_vision.py); the image embeddings replace the image
  tokens' at the first stage's embedding. The later stages build no tower and read none of its
  tensors (PipelineStage.tensor_name).
- Every rank gets each step's inputs from rank 0 with the image rows, their embeddings (with
  Qwen3-VL's DeepStack features as extra columns) and M-RoPE's (t, h, w) positions
  (VisionRunner.for_peers). So a later stage fills its M-RoPE cache rows for the step itself
  (engine/models/qwen2_5_vl.py), Gemma 3's image spans reach every stage's attention, and a
  DeepStack layer on a later stage adds its columns, numbered by the layer's place in the whole
  model (engine/models/qwen3_vl.py), not in its stage.
- A step with image rows is not cut into micro-batches: its image rows' M-RoPE cache rows and
  Gemma 3's spans are numbered over the whole batch. Such steps are prefills of images; decode
  steps (no image rows) are cut as any model's.
- The checkpoints name the language model's tensors model.language_model.* (transformers 5) or
  language_model.model.* (the hub's Gemma 3 and Mistral 3 files): the stage's layers are
  renumbered under either prefix, and its ends (embedding, final norm, LM head) told by the
  name without it.
"""
from __future__ import annotations

# a vision-language checkpoint's language-model prefixes -> a causal LM's
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_model_name(name: str) -> str:
    """A checkpoint tensor's name as a causal LM names it (model.*, lm_head.*)."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def holds_tower(config) -> bool:
    """Whether this rank's model builds the vision tower: only rank 0 (the first stage's
    tensor-parallel rank 0) does."""
    tp, stage = config.tensor_parallel, config.pipeline
    return (tp is None or not tp.rank) and (stage is None or stage.first)

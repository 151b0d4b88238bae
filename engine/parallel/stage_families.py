"""A family's own per-layer settings (ModelConfig.family, engine/models/family_config.py) cut to a
pipeline stage's layers [first, end), which its model numbers from 0 (engine/parallel/pipeline.py):
layer i of the stage reads entry first + i, its own layer's in the whole model. A rule computed
from the stage's own numbering would be wrong: Llama 4's NoPE layers are every 4th of the whole
model's, and a stage starting at layer 3 has its NoPE layer first, not fourth. Gemma 4's (full or
sliding, each KV-shared layer's source) are engine/parallel/stages_gemma4.py's to cut."""
from __future__ import annotations

import dataclasses

from engine.models.family_config import Gemma4Settings, Llama4Settings
from engine.parallel import stages_gemma4


def stage_family(family, first: int, end: int):
    """The family settings of a stage holding layers [first, end); settings with nothing per
    layer (or none) as they are."""
    if isinstance(family, Llama4Settings):
        return dataclasses.replace(family, rope_layers=family.rope_layers[first:end],
                                   chunked_layers=family.chunked_layers[first:end])
    if isinstance(family, Gemma4Settings):
        return stages_gemma4.local_family(family, first, end)
    return family

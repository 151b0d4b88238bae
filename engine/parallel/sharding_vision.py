"""A vision-language model under tensor parallel: the language model splits as its text family
does; the vision tower does not split (it is small beside the language model). Rank 0 holds the
tower whole and runs it, and the image embeddings it makes (with any extra columns a family
carries in them: Qwen3-VL's DeepStack features) reach the other ranks with each step's inputs
(engine/vision/runner.py, VisionRunner.for_peers), together with the image rows and their M-RoPE
positions. So the other ranks read none of the tower's tensors."""
from __future__ import annotations

import re

# The families whose steps carry everything their language model reads of an image (the rows,
# the embeddings, M-RoPE's (t, h, w) positions); the others stop the load, named.
SPLIT_VISION = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                "Qwen3VLMoeForConditionalGeneration", "Gemma3ForConditionalGeneration",
                "Mistral3ForConditionalGeneration")

# The tower's and its projector's tensors, as the checkpoints name them.
_TOWER = re.compile(r"^(model\.)?(visual|vision_tower|multi_modal_projector)\.")


def check_vision_split(arch: str) -> None:
    if arch not in SPLIT_VISION:
        raise ValueError(f"tensor parallel: {arch} (a vision tower) is not yet split across ranks "
                         f"(split: {', '.join(SPLIT_VISION)})")


def is_tower_tensor(name: str) -> bool:
    """A vision tower's or its projector's tensor: rank 0's whole, absent from the others."""
    return _TOWER.match(name) is not None


# Qwen3-VL-MoE's experts stacked in one tensor per layer (engine/models/qwen3_vl.py splits them
# after the cut): gate_up (E, 2I, H) as transformers 5 saves it or (E, H, 2I) as the hub's files
# hold it, gate then up along 2I; down (E, H, I) or (E, I, H).
_STACKED_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")
_STACKED_DOWN = re.compile(r"\.mlp\.experts\.down_proj$")


def stacked_expert_cut(name: str, shape: tuple, config, rank: int, size: int):
    """(axis, ranges) of a rank's slice of every stacked expert's intermediate size, or None for
    other tensors (experts split within the ranks; under expert parallel the plan cuts whole
    experts first)."""
    gate_up = _STACKED_GATE_UP.search(name)
    if not gate_up and not _STACKED_DOWN.search(name):
        return None
    H, I = config.hidden_size, config.moe.intermediate_size
    a, b = rank * I // size, (rank + 1) * I // size
    if H == 2 * I or H == I:
        raise ValueError(f"tensor parallel: {name} {list(shape)}: its layout cannot be told "
                         f"from its shape (hidden size {H}, expert intermediate size {I})")
    if gate_up:
        axis = 1 if tuple(shape[1:]) == (2 * I, H) else 2 if tuple(shape[1:]) == (H, 2 * I) else 0
        ranges = ((a, b), (I + a, I + b))
    else:
        axis = 2 if tuple(shape[1:]) == (H, I) else 1 if tuple(shape[1:]) == (I, H) else 0
        ranges = ((a, b),)
    if not axis:
        raise ValueError(f"tensor parallel: {name} has shape {list(shape)}, not a stack of "
                         f"experts of hidden size {H} and intermediate size {I}")
    return axis, ranges

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
SPLIT_VISION = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")

# The tower's and its projector's tensors, as the checkpoints name them.
_TOWER = re.compile(r"^(model\.)?(visual|vision_tower|multi_modal_projector)\.")


def check_vision_split(arch: str) -> None:
    if arch not in SPLIT_VISION:
        raise ValueError(f"tensor parallel: {arch} (a vision tower) is not yet split across ranks "
                         f"(split: {', '.join(SPLIT_VISION)})")


def tower_share(name: str, tensor, rank: int):
    """A tower tensor whole on rank 0 and absent (None) elsewhere; `False` for other tensors."""
    if not _TOWER.match(name):
        return False
    return tensor if rank == 0 else None

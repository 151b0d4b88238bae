"""Pipeline parallel for vision-language models on CUDA (issue 28): the tower on rank 0's device
(the first stage's), the image embeddings (with Qwen3-VL's DeepStack features) going to the
later stage on the host with the step's inputs and onto its device there, the later stage
filling its own M-RoPE rows (engine/parallel/stages_vision.py). The tiny Qwen3-VL of
tests/test_pipeline_parallel_vision.py (4 layers, DeepStack into layer 2, the later stage's) at
pipeline_parallel_size 2 on two devices gives the CPU engine's greedy tokens (f32 activations;
the CPU engine equals transformers there). Skipped with fewer than 2 GPUs: pending a machine
with several."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_two_stages_on_two_devices_match_the_cpu(tmp_path, family):
    from test_cuda_tensor_parallel_vision import assert_two_devices_match_the_cpu
    from test_pipeline_parallel_vision import FAMILIES
    assert_two_devices_match_the_cpu(FAMILIES, family, tmp_path, "pp2",
                                     pipeline_parallel_size=2)

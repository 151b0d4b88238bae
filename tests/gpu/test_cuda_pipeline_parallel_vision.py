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
    from pyx.cuda_backend import device_count
    if device_count() < 2:
        pytest.skip("pending a machine with 2+ GPUs: pipeline_parallel_size 2 on two devices")
    from test_pipeline_parallel_vision import FAMILIES
    from test_tensor_parallel_vision import greedy, load_qwen, qwen_case
    loaded = load_qwen(*FAMILIES[family](tmp_path))
    ckpt = loaded[0]
    ids, processed, _, _ = qwen_case(loaded)
    cpu = greedy(ckpt, ids, processed, 1, backend="cpu")
    cuda = greedy(ckpt, ids, processed, 1, backend="cuda", dtype="f32",
                  pipeline_parallel_size=2)
    assert cuda[1] == 1                     # encoded once, on rank 0
    assert cuda[0][:6] == cpu[0][:6], f"{family}: cuda pp2 {cuda[0]}, cpu {cpu[0]}"

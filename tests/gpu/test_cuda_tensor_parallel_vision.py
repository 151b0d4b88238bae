"""Tensor parallel for vision-language models on CUDA (issue 28 item 1): the vision tower runs on
rank 0's device alone, its float32 embeddings travel to rank 1 on the host with the step's inputs
(engine/vision/runner.py, VisionRunner.for_peers) and go onto rank 1's device there
(ModelRunner.run). Tiny Qwen2.5-VL and Qwen3-VL checkpoints with 4 query and 2 KV heads
(tests/test_tensor_parallel_vision.py) at tensor_parallel_size 2 on two devices give the CPU
engine's greedy tokens (f32 activations; the CPU engine equals transformers there). Skipped with
fewer than 2 GPUs: pending a machine with several."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_two_devices_match_the_cpu(tmp_path, family):
    from test_tensor_parallel_vision import FAMILIES
    assert_two_devices_match_the_cpu(FAMILIES, family, tmp_path, "tp2", tp=2)


def assert_two_devices_match_the_cpu(families, family, tmp_path, what: str, tp: int = 1,
                                     **split):
    """The one-image case of the Qwen-VL checkpoint families[family] writes: greedy tokens at
    tensor parallel `tp` (and split: EngineConfig's) on two devices, f32 activations, start as
    the CPU engine's (one process), the image encoded once, on rank 0. what: the split, named."""
    from test_cuda_tensor_parallel import need_two_devices
    need_two_devices(f"{family} {what} on two devices")
    from test_tensor_parallel_vision import greedy, load_qwen, qwen_case
    loaded = load_qwen(*families[family](tmp_path))
    ckpt = loaded[0]
    ids, processed, _, _ = qwen_case(loaded)
    cpu = greedy(ckpt, ids, processed, 1, backend="cpu")
    cuda = greedy(ckpt, ids, processed, tp, backend="cuda", dtype="f32", **split)
    assert cuda[1] == 1                     # encoded once, on rank 0
    assert cuda[0][:6] == cpu[0][:6], f"{family}: cuda {what} {cuda[0]}, cpu {cpu[0]}"

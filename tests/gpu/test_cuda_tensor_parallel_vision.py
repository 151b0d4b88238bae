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
    from pyx.cuda_backend import device_count
    if device_count() < 2:
        pytest.skip("pending a machine with 2+ GPUs: tensor_parallel_size 2 on two devices")
    from test_tensor_parallel_vision import FAMILIES, greedy
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    from vision_oracle import CASES, case_images, prompt_ids

    from engine.models.model_config import ModelConfig
    from engine.vision.config import ImageProcessorConfig
    from engine.vision.preprocess import preprocess_image
    ckpt, _ = FAMILIES[family](tmp_path)
    processor = ImageProcessorConfig.from_pretrained(ckpt, ModelConfig.from_pretrained(ckpt).vision)
    parts, sizes = CASES["one image"]
    processed = [preprocess_image(im, processor) for im in case_images(sizes)]
    hf = None, Qwen2VLImageProcessorPil.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    ids = prompt_ids(hf, parts, processed)
    cpu = greedy(ckpt, ids, processed, 1, backend="cpu")
    cuda = greedy(ckpt, ids, processed, 2, backend="cuda", dtype="f32")
    assert cuda[1] == 1                     # encoded once, on rank 0
    assert cuda[0][:6] == cpu[0][:6], f"{family}: cuda tp2 {cuda[0]}, cpu {cpu[0]}"

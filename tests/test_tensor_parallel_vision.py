"""Tensor parallel for a vision-language model on the CPU (issue 28 item 1): a tiny Qwen2.5-VL
(tests/vision_checkpoint.py, with 4 query and 2 KV heads so that 2 ranks split them) on 2 MPI
ranks. The language model splits as Qwen2's does; the vision tower runs on rank 0 alone, and its
image embeddings and the image rows' M-RoPE positions reach rank 1 with each step
(engine/parallel/sharding_vision.py).

- Greedy tokens for a prompt with one image, through chunked prefill (chunks of 32 tokens cut the
  image's run) and decodes, equal the single process's and transformers' (up to its first
  near-tie); the image is encoded once, on rank 0.
- Rank 1 reads none of the tower's tensors; families whose steps do not carry what their
  language model reads of an image yet stop the load, named."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("mpi4py")

from vision_checkpoint import tiny_vl_checkpoint  # noqa: E402
from vision_oracle import CASES, GEN, case_images, hf_generate, make_engine, prompt_ids, run  # noqa: E402,E501

pytestmark = pytest.mark.timeout(300)

# M-RoPE over 24-wide heads: 12 frequencies in sections of 4 (t, h, w)
TEXT = dict(num_attention_heads=4, num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [4, 4, 4]})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_vl_checkpoint(tmp_path_factory.mktemp("qwen25vl_tp"), text=TEXT)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return (model, Qwen2VLImageProcessorPil.from_pretrained(ckpt),
            AutoTokenizer.from_pretrained(ckpt))


def greedy(ckpt, ids, processed, tp: int):
    """(token ids, images encoded on rank 0), the engine shut down after."""
    engine = make_engine(ckpt, max_num_batched_tokens=32, tensor_parallel_size=tp)
    try:
        seq = run(engine, ids, processed)
        return list(seq.output_token_ids), engine.runner.vision.num_encoded
    finally:
        engine.shutdown()


def test_greedy_tokens_equal_one_process_and_hf(ckpt, hf):
    from engine.models.model_config import ModelConfig
    from engine.vision.config import ImageProcessorConfig
    from engine.vision.preprocess import preprocess_image
    processor = ImageProcessorConfig.from_pretrained(ckpt, ModelConfig.from_pretrained(ckpt).vision)
    parts, sizes = CASES["one image"]
    images = case_images(sizes)
    processed = [preprocess_image(im, processor) for im in images]
    ids = prompt_ids(hf, parts, processed)
    tokens, trusted = hf_generate(hf, ids, images)
    assert trusted >= 6, f"reference near-tie at token {trusted}"
    split = greedy(ckpt, ids, processed, 2)
    one = greedy(ckpt, ids, processed, 1)
    assert split[0][:trusted] == tokens[:trusted]
    assert split[0] == one[0], f"one process {one[0]}, tensor parallel {split[0]}"
    assert split[1] == 1 and len(split[0]) == GEN


def test_rank_1_holds_no_tower_tensor(ckpt):
    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    config = ModelConfig.from_pretrained(ckpt)
    weights = load_safetensors(ckpt, progress=False)
    tower = [n for n in weights if n.startswith("visual.")]
    assert "visual.blocks.0.mlp.gate_proj.weight" in tower     # a name the LM's split would cut
    rank0, rank1 = ShardPlan(config, 0, 2), ShardPlan(config, 1, 2)
    for name in tower:
        assert rank1.shard(name, weights[name]) is None
        assert rank0.shard(name, weights[name]) is weights[name]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert rank1.shard(q, weights[q]).shape[0] == weights[q].shape[0] // 2


def test_families_not_yet_split_are_named(ckpt):
    import dataclasses
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    config = dataclasses.replace(ModelConfig.from_pretrained(ckpt),
                                 architecture="Gemma3ForConditionalGeneration")
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration .a vision tower. is "
                                         "not yet split"):
        ShardPlan(config, 0, 2)

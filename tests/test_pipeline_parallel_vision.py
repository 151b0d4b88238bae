"""Pipeline parallel for vision-language models on the CPU (issue 28): the language model's layers
in 2 stages on MPI ranks, the vision tower whole on rank 0, the first stage's, whose image
embeddings (with Qwen3-VL's DeepStack features in extra columns) and M-RoPE positions reach the
later stage with each step (engine/parallel/stages_vision.py).

- Greedy tokens for a prompt with one image, through chunked prefill and decodes, equal
  transformers' (up to its first near-tie) and the single process's at PP 2: Qwen2.5-VL (M-RoPE
  rows on the later stage), Qwen3-VL and Qwen3-VL-MoE with 4 layers and 3 DeepStack features, the
  third into layer 2, the later stage's; Gemma 3 (its image spans reach the later stage's
  attention); Mistral 3 (its [IMG_BREAK]/[IMG_END] rows, merged on the first stage). Qwen3-VL
  once at PP 2 x TP 2 (4 processes).
- Gemma 3's GGUF with its projector file at PP 2 gives transformers' recorded tokens.
- The later stage builds no tower and reads none of its tensors; the language model's layers are
  renumbered under the checkpoints' model.language_model. / language_model.model. prefixes.
- A step with image rows runs as one micro-batch; a vision family not known to be staged is
  refused by name.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("mpi4py")

from test_tensor_parallel_vision import (  # noqa: E402
    _qwen2_5_vl, check_gguf_with_its_projector_file, gemma3_case, greedy, load_qwen, mistral3_case,
    qwen_case)
from test_tensor_parallel_vision import _qwen3_vl as tensor_parallel_qwen3_vl  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _qwen3_vl(directory, moe: bool = False):
    """The tiny Qwen3-VL in 4 layers (4 query, 2 KV heads, for PP 2 x TP 2) with 3 DeepStack
    features, into layers 0, 1 and 2: the third on the later stage, before its last layer
    (a feature added after the last layer changes no logits)."""
    return tensor_parallel_qwen3_vl(directory, moe, text=dict(num_hidden_layers=4),
                                    vision=dict(deepstack_visual_indexes=[0, 1, 2]))


FAMILIES = {"qwen2.5-vl": _qwen2_5_vl, "qwen3-vl": _qwen3_vl,
            "qwen3-vl-moe": lambda directory: _qwen3_vl(directory, moe=True)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(request, tmp_path_factory):
    return load_qwen(*FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def assert_same(tokens, trusted, split, one, n, what):
    assert split[0][:trusted] == tokens[:trusted], f"{what}: transformers {tokens}, {split[0]}"
    assert split[0] == one[0], f"one process {one[0]}, {what} {split[0]}"
    assert split[1] == 1 and len(split[0]) == n      # the image encoded once, on rank 0
    np.testing.assert_allclose(split[2], one[2], rtol=0, atol=2e-4, err_msg=what)


def test_greedy_tokens_equal_one_process_and_hf(loaded):
    from vision_oracle import GEN
    ckpt, hf, _ = loaded
    ids, processed, tokens, trusted = qwen_case(loaded)
    one = greedy(ckpt, ids, processed, 1)
    split = greedy(ckpt, ids, processed, 1, pipeline_parallel_size=2)
    assert_same(tokens, trusted, split, one, GEN, "pipeline parallel 2")
    if hf[0].config.architectures[0] == "Qwen3VLForConditionalGeneration":
        both = greedy(ckpt, ids, processed, 2, pipeline_parallel_size=2)
        assert_same(tokens, trusted, both, one, GEN, "pipeline 2 x tensor parallel 2")


def test_gemma3_image_spans_reach_the_later_stage(tmp_path):
    """4 layers, so that the later stage's first one (a sliding layer) computes the image rows'
    keys and values with their bidirectional attention: an overlay on the last layer alone
    changes no logits."""
    ckpt, ids, processed, tokens, trusted, n = gemma3_case(tmp_path, text=dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2))
    one = greedy(ckpt, ids, processed, 1, n)
    split = greedy(ckpt, ids, processed, 1, n, pipeline_parallel_size=2)
    assert_same(tokens, trusted, split, one, n, "pipeline parallel 2")


def test_mistral3_image_breaks_keep_their_embeddings(tmp_path):
    ckpt, ids, processed, tokens, trusted = mistral3_case(tmp_path)
    one = greedy(ckpt, ids, processed, 1, max_num_batched_tokens=16)
    split = greedy(ckpt, ids, processed, 1, max_num_batched_tokens=16, pipeline_parallel_size=2)
    assert_same(tokens, trusted, split, one, len(one[0]), "pipeline parallel 2")


def test_gguf_with_its_projector_file():
    """Gemma 3's GGUF text file with llama.cpp's projector file (--mmproj): transformers'
    recorded tokens of each fixture case at PP 2."""
    check_gguf_with_its_projector_file("gemma3", pipeline_parallel_size=2)


def test_later_stage_builds_no_tower_and_renumbers_its_layers(tmp_path):
    """Stage 1 of 2, loaded alone: no tower, no tower tensor read, its layers (the model's
    layers 2 and 3) built from model.language_model.layers.2 and 3 as its 0 and 1, the first
    with DeepStack's third feature (columns 3H..4H of the step's embeddings)."""
    from engine.loader.model_loader import load_model
    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    from engine.models.qwen3_vl import DeepstackDecoderLayer
    from engine.parallel.pipeline import PipelineStage
    from pyx.cpu_backend import CpuBackend
    ckpt, _ = _qwen3_vl(tmp_path)
    config = ModelConfig.from_pretrained(ckpt)
    H = config.hidden_size
    names = list(load_safetensors(ckpt, progress=False))
    first, later = (PipelineStage.of(config, s, 2, 0, None) for s in (0, 1))
    tower = [n for n in names if n.startswith("model.visual.")]
    assert tower and all(first.tensor_name(n) == n for n in tower)
    assert all(later.tensor_name(n) is None for n in tower)
    assert later.tensor_name("model.language_model.layers.3.mlp.up_proj.weight") == \
        "model.language_model.layers.1.mlp.up_proj.weight"
    assert later.tensor_name("model.language_model.layers.1.mlp.up_proj.weight") is None
    assert later.tensor_name("language_model.model.layers.2.mlp.up_proj.weight") == \
        "language_model.model.layers.0.mlp.up_proj.weight"
    assert later.tensor_name("model.language_model.embed_tokens.weight") is None
    assert first.tensor_name("language_model.lm_head.weight") is None
    assert later.tensor_name("language_model.lm_head.weight") == "language_model.lm_head.weight"

    model, _ = load_model(ckpt, CpuBackend(), progress=False, pipeline=(1, 2, 0, None))
    assert model.vision_encoder is None and model.embed_tokens is None
    deepstack, plain = model.layers
    assert isinstance(deepstack, DeepstackDecoderLayer) and deepstack.first_column == 3 * H
    assert not isinstance(plain, DeepstackDecoderLayer)
    model, _ = load_model(ckpt, CpuBackend(), progress=False, pipeline=(0, 2, 0, None))
    assert model.vision_encoder is not None and model.lm_head is None
    assert [layer.first_column for layer in model.layers] == [H, 2 * H]


def test_vision_families_not_yet_staged_are_named(loaded):
    import dataclasses

    from engine.models.model_config import ModelConfig
    from engine.parallel import pipeline
    config = dataclasses.replace(ModelConfig.from_pretrained(loaded[0]),
                                 architecture="Gemma3ForCausalLM")   # staged, with a tower
    with pytest.raises(ValueError, match="Gemma3ForCausalLM's vision tower is not yet split "
                                         "into stages"):
        pipeline.check_model(config)


def test_a_step_with_image_rows_is_not_cut():
    """Its image rows' M-RoPE cache rows and Gemma 3's spans are numbered over the whole step:
    it runs as one micro-batch (the batch itself, its image rows with it)."""
    from engine.parallel.pipeline import micro_batches
    from engine.runner.forward_batch import ForwardBatch
    from engine.vision.runner import VisionBatch
    qsl = np.array([0, 80, 160], np.int32)
    batch = ForwardBatch(np.zeros(160, np.int32), np.arange(160, dtype=np.int32),
                         np.arange(160, dtype=np.int32), qsl, np.array([80, 80], np.int32),
                         None, qsl[1:] - 1, np.arange(2, dtype=np.int32), 4)
    assert len(micro_batches(batch, None, 2)) == 2
    batch.vision = VisionBatch(np.arange(90, 100, dtype=np.int32), np.zeros((10, 3), np.int32))
    ((piece, _, _, _),) = micro_batches(batch, None, 2)
    assert piece is batch

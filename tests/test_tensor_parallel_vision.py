"""Tensor parallel for vision-language models on the CPU (issue 28 item 1): tiny Qwen2.5-VL and
Qwen3-VL checkpoints (tests/vision_checkpoint.py, qwen3_vl_checkpoint.py, with 4 query and 2 KV
heads so that 2 ranks split them) on 2 MPI ranks. The language model splits as its text family
does; the vision tower runs on rank 0 alone, and its image embeddings and the image rows' M-RoPE
positions reach rank 1 with each step (engine/parallel/sharding_vision.py).

- Greedy tokens for a prompt with one image, through chunked prefill (chunks of 32 tokens cut the
  image's run) and decodes, equal the single process's and transformers' (up to its first
  near-tie); the image is encoded once, on rank 0. Qwen2.5-VL, Qwen3-VL (its DeepStack features
  travel as extra columns of the embeddings) and Qwen3-VL-MoE (stacked experts split within the
  ranks, and whole under expert parallel).
- Gemma 3: the image spans of its bidirectional overlay reach rank 1; Mistral 3: its image runs'
  [IMG_BREAK]/[IMG_END] rows keep their own embeddings.
- GGUF text files with their projector files (Gemma 3, Mistral 3) at TP 2 give transformers'
  recorded tokens.
- The live server at --tensor-parallel-size 2 answers a chat with an image with transformers'
  text.
- Rank 1 reads none of the tower's tensors; a vision family not known to carry what its
  language model reads of an image stops the load, named."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("mpi4py")

from qwen3_vl_checkpoint import tiny_qwen3_vl_checkpoint  # noqa: E402
from vision_checkpoint import tiny_vl_checkpoint  # noqa: E402
from vision_oracle import CASES, GEN, case_images, hf_generate, prompt_ids, run  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# Each family's tiny checkpoint with 4 query and 2 KV heads, and transformers' class.
def _qwen2_5_vl(directory):
    from transformers import Qwen2_5_VLForConditionalGeneration
    # M-RoPE over 24-wide heads: 12 frequencies in sections of 4 (t, h, w)
    text = dict(num_attention_heads=4, num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 4, 4]})
    return tiny_vl_checkpoint(directory, text=text), Qwen2_5_VLForConditionalGeneration


def _qwen3_vl(directory, moe: bool = False, text: dict | None = None,
              vision: dict | None = None):
    """text, vision: more text_config and vision_config entries."""
    import transformers
    ckpt = tiny_qwen3_vl_checkpoint(directory, moe=moe, text_overrides=dict(
        num_attention_heads=4, num_key_value_heads=2, **(text or {})), vision_overrides=vision)
    return ckpt, (transformers.Qwen3VLMoeForConditionalGeneration if moe
                  else transformers.Qwen3VLForConditionalGeneration)


FAMILIES = {"qwen2.5-vl": _qwen2_5_vl, "qwen3-vl": _qwen3_vl,
            "qwen3-vl-moe": lambda directory: _qwen3_vl(directory, moe=True)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(request, tmp_path_factory):
    """(checkpoint, (transformers model, image processor, tokenizer), our processor)."""
    return load_qwen(*FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def load_qwen(ckpt, hf_class):
    """A Qwen-VL checkpoint as `loaded` gives it."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    from engine.models.model_config import ModelConfig
    from engine.vision.config import ImageProcessorConfig
    model = hf_class.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf = model, Qwen2VLImageProcessorPil.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    return ckpt, hf, ImageProcessorConfig.from_pretrained(
        ckpt, ModelConfig.from_pretrained(ckpt).vision)


def greedy(ckpt, ids, processed, tp: int, n: int = GEN, **kw):
    """(n token ids, images encoded on rank 0, the tokens' logprobs), the engine shut down
    after; kw: EngineConfig's (the CPU backend and chunks of 32 tokens unless given)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(**{**dict(model=ckpt, backend="cpu", kv_cache_memory_mb=16,
                                              async_scheduling=False, max_num_batched_tokens=32,
                                              tensor_parallel_size=tp), **kw}))
    try:
        logprobs = []
        seq = run(engine, ids, processed, n, logprobs=logprobs)
        return list(seq.output_token_ids), engine.runner.vision.num_encoded, np.array(logprobs)
    finally:
        engine.shutdown()


def qwen_case(loaded):
    """(prompt ids, processed images, transformers' tokens, how many of them are trusted) of
    the one-image case."""
    from engine.vision.preprocess import preprocess_image
    _, hf, processor = loaded
    parts, sizes = CASES["one image"]
    images = case_images(sizes)
    processed = [preprocess_image(im, processor) for im in images]
    ids = prompt_ids(hf, parts, processed)
    tokens, trusted = hf_generate(hf, ids, images)
    assert trusted >= 6, f"reference near-tie at token {trusted}"
    return ids, processed, tokens, trusted


def test_greedy_tokens_equal_one_process_and_hf(loaded):
    ckpt, hf, _ = loaded
    ids, processed, tokens, trusted = qwen_case(loaded)
    split = greedy(ckpt, ids, processed, 2)
    one = greedy(ckpt, ids, processed, 1)
    assert split[0][:trusted] == tokens[:trusted]
    assert split[0] == one[0], f"one process {one[0]}, tensor parallel {split[0]}"
    assert split[1] == 1 and len(split[0]) == GEN
    if "Moe" in hf[0].config.architectures[0]:      # each rank its own whole experts
        experts = greedy(ckpt, ids, processed, 2, enable_expert_parallel=True)
        assert experts[0] == one[0], f"one process {one[0]}, expert parallel {experts[0]}"


def test_gemma3_image_spans_reach_rank_1(tmp_path):
    """Gemma 3 (4 query, 2 KV heads): its image tokens attend to each other both ways, over the
    image spans the step carries; tokens at TP 2 equal one process's and transformers'
    (whose tokens differ without that mask: tests/test_gemma3_vision.py)."""
    ckpt, ids, processed, tokens, trusted, n = gemma3_case(tmp_path)
    split, one = (greedy(ckpt, ids, processed, tp, n) for tp in (2, 1))
    assert split[0][:trusted] == tokens[:trusted]
    assert split[0] == one[0], f"one process {one[0]}, tensor parallel {split[0]}"
    assert split[1] == 1 and len(split[0]) == n


def gemma3_case(tmp_path, text: dict | None = None):
    """(checkpoint, prompt ids, processed images, transformers' tokens, how many are trusted,
    how many to generate) of Gemma 3's one-image case; text: the checkpoint's text_config
    entries in place of its defaults."""
    from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint
    from test_gemma3_vision import GEN as GEMMA_GEN, case, engine_prompt, hf_generate, hf_inputs
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from engine.models.model_config import ModelConfig
    from engine.vision.families import image_processor
    ckpt = tiny_gemma3_vision_checkpoint(tmp_path, text=text)
    hf = (Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval(),
          AutoProcessor.from_pretrained(ckpt))
    processor = image_processor(ckpt, ModelConfig.from_pretrained(ckpt).vision)
    parts, images = case("one image")
    tokens, trusted = hf_generate(hf, hf_inputs(hf, parts, images))
    assert trusted >= 8, f"reference near-tie at token {trusted}"
    ids, processed = engine_prompt(hf, processor, parts, images)
    return ckpt, ids, processed, tokens, trusted, GEMMA_GEN


def test_mistral3_image_breaks_keep_their_embeddings(tmp_path):
    """Mistral 3 (Pixtral's tower, 6 query and 2 KV heads): an image's rows include its
    [IMG_BREAK]s and [IMG_END], which keep their own embeddings (the token ids the step
    carries); tokens at TP 2, in chunks of 16 that cut the image, equal one process's and
    transformers'."""
    ckpt, ids, processed, tokens, trusted = mistral3_case(tmp_path)
    split, one = (greedy(ckpt, ids, processed, tp, max_num_batched_tokens=16) for tp in (2, 1))
    assert split[0][:trusted] == tokens[:trusted]
    assert split[0] == one[0], f"one process {one[0]}, tensor parallel {split[0]}"
    assert split[1] == 1


def mistral3_case(tmp_path):
    """(checkpoint, prompt ids, processed images, transformers' tokens, how many are trusted)
    of Mistral 3's one-image case."""
    from mistral3_checkpoint import tiny_mistral3_checkpoint
    from test_vision_mistral3 import CASES as MISTRAL_CASES, hf_generate as mistral_generate
    from test_vision_mistral3 import prompt_ids as mistral_prompt
    from transformers import (AutoTokenizer, Mistral3ForConditionalGeneration,
                              PixtralImageProcessorPil)

    from engine.models.model_config import ModelConfig
    from engine.vision.families import image_processor, preprocess
    ckpt = tiny_mistral3_checkpoint(tmp_path)
    hf = (Mistral3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval(),
          PixtralImageProcessorPil.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt))
    processor = image_processor(ckpt, ModelConfig.from_pretrained(ckpt).vision)
    parts, sizes = MISTRAL_CASES["one image"]
    images = case_images(sizes)
    processed = [preprocess(im, processor) for im in images]
    ids = mistral_prompt(hf, parts, processed)
    tokens, trusted = mistral_generate(hf, ids, images)
    assert trusted >= 6, f"reference near-tie at token {trusted}"
    return ckpt, ids, processed, tokens, trusted


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_gguf_with_its_projector_file(family):
    """A GGUF text file with llama.cpp's projector file (--mmproj; its tower tensors named as the
    checkpoints' are, engine/loader/gguf_mmproj*.py): the recorded transformers tokens of each
    fixture case at TP 2 (the Qwen fixtures have 3 heads, which 2 ranks cannot split)."""
    check_gguf_with_its_projector_file(family, tensor_parallel_size=2)


def check_gguf_with_its_projector_file(family: str, **split):
    """Each fixture case of tests/test_gguf_mmproj_{family}.py gives transformers' recorded
    tokens through an engine split as `split` (EngineConfig's) says."""
    import importlib

    from gguf_mmproj_cases import check_engine_case, make_engine
    files = importlib.import_module(f"test_gguf_mmproj_{family}")
    for case in files.FIXTURES.values():      # (an engine each: it counts the images encoded)
        engine = make_engine(files.TEXT, files.MMPROJ, max_num_batched_tokens=20, **split)
        try:
            check_engine_case(engine, case)
        finally:
            engine.shutdown()


def test_rank_1_holds_no_tower_tensor(loaded):
    ckpt = loaded[0]
    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    config = ModelConfig.from_pretrained(ckpt)
    weights = load_safetensors(ckpt, progress=False)
    tower = [n for n in weights if n.startswith(("visual.", "model.visual."))]
    # a name the LM's split would cut
    assert {"visual.blocks.0.mlp.gate_proj.weight", "model.visual.blocks.0.mlp.linear_fc1.weight",
            "visual.blocks.0.mlp.linear_fc1.weight"} & set(tower)
    rank0, rank1 = ShardPlan(config, 0, 2), ShardPlan(config, 1, 2)
    for name in tower:
        assert rank1.shard(name, weights[name]) is None
        assert rank0.shard(name, weights[name]) is weights[name]
    q = next(n for n in weights if n.endswith("layers.0.self_attn.q_proj.weight"))
    assert rank1.shard(q, weights[q]).shape[0] == weights[q].shape[0] // 2
    # --isq's check of row-parallel shares passes over the tower (rank 0 quantizes it whole)
    from engine.parallel.sharding import check_isq_split
    odd = np.zeros((32, 48), np.float32)      # 48 columns: not whole q8_0 blocks as a share
    check_isq_split(rank0, {"visual.blocks.0.mlp.down_proj.weight": odd}, "q8_0")
    with pytest.raises(ValueError, match="not whole quantization blocks"):
        check_isq_split(rank0, {"model.layers.0.mlp.down_proj.weight": odd}, "q8_0")


def test_families_not_yet_split_are_named(loaded):
    ckpt = loaded[0]
    import dataclasses
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    config = dataclasses.replace(ModelConfig.from_pretrained(ckpt),
                                 architecture="NewVLForConditionalGeneration")
    with pytest.raises(ValueError, match="NewVLForConditionalGeneration .a vision tower. is "
                                         "not yet split"):
        ShardPlan(config, 0, 2)


def test_stacked_experts_cut_in_both_layouts(tmp_path):
    """Qwen3-VL-MoE's stacked experts: a rank's slice of every expert's gate, up and down, the
    same whether the file holds transformers 5's layout or the hub's (transposed); under expert
    parallel, whole experts."""
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    ckpt, _ = _qwen3_vl(tmp_path, moe=True)
    config = ModelConfig.from_pretrained(ckpt)
    E, H, I = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((E, 2 * I, H)).astype(np.float32)     # transformers 5's
    down = rng.standard_normal((E, H, I)).astype(np.float32)
    p = "model.language_model.layers.0.mlp.experts."
    for rank in range(2):
        plan = ShardPlan(config, rank, 2)
        a, b = rank * I // 2, (rank + 1) * I // 2
        want_gate_up = np.concatenate([gate_up[:, a:b], gate_up[:, I + a:I + b]], 1)
        np.testing.assert_array_equal(plan.shard(p + "gate_up_proj", gate_up), want_gate_up)
        np.testing.assert_array_equal(plan.shard(p + "down_proj", down), down[:, :, a:b])
        hub = plan.shard(p + "gate_up_proj", np.ascontiguousarray(gate_up.transpose(0, 2, 1)))
        np.testing.assert_array_equal(hub, want_gate_up.transpose(0, 2, 1))
        hub = plan.shard(p + "down_proj", np.ascontiguousarray(down.transpose(0, 2, 1)))
        np.testing.assert_array_equal(hub, down[:, :, a:b].transpose(0, 2, 1))
        ep = ShardPlan(config, rank, 2, expert_parallel=True)
        held = slice(rank * E // 2, (rank + 1) * E // 2)
        np.testing.assert_array_equal(ep.shard(p + "gate_up_proj", gate_up), gate_up[held])
    with pytest.raises(ValueError, match="not a stack of experts"):
        ShardPlan(config, 0, 2).shard(p + "down_proj", down[:, :, :I - 1])


def test_live_server_answers_an_image_at_tp2(tmp_path):
    """`python -m server --tensor-parallel-size 2` on the Qwen2.5-VL checkpoint: a chat with an
    image (a data URL) through the official openai client gives transformers' text."""
    from server_fakes import LiveServer, client_for
    from test_vision_server import chat, data_url, hf_tokens, user
    from vision_checkpoint import sample_image
    ckpt, _ = _qwen2_5_vl(tmp_path / "ckpt")
    image = sample_image(40, 56, seed=5)
    text, prompt_len = hf_tokens(ckpt, image, "What is this?", " Describe it.")
    server = LiveServer(tmp_path, ckpt, "--mem", "16", "--served-model-name", "vl",
                        "--tensor-parallel-size", "2")
    try:
        out = chat(client_for(server.port), user("What is this?", (data_url(image),),
                                                 " Describe it."))
    finally:
        server.close()
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == prompt_len

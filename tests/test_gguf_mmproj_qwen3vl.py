"""Qwen3-VL from GGUF (issue 33): a qwen3vl text file (and a qwen3vlmoe one, Qwen3-VL-MoE) with
llama.cpp's Qwen3-VL projector file (`--mmproj`, DeepStack mergers included), both written by
llama.cpp's own converter from a tiny random checkpoint
(tests/data/make_gguf_qwen3vl_fixtures.py), give transformers' greedy tokens on
that checkpoint for prompts with one, two and a larger image, through the engine and through a
live server; a projector beside a text file of another family is refused by name."""
from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

pytest.importorskip("PIL")

from server_fakes import LiveServer, client_for  # noqa: E402
from vision_checkpoint import png_bytes, sample_image  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")
TEXT = os.path.join(DATA, "qwen3vl-f32.gguf")
MMPROJ = os.path.join(DATA, "qwen3vl-mmproj-f32.gguf")
# file stem -> the vision-language architecture it loads as
STEMS = {"qwen3vl": "Qwen3VLForConditionalGeneration",
         "qwen3vlmoe": "Qwen3VLMoeForConditionalGeneration"}
FIXTURES = {}
for _stem in STEMS:
    with open(os.path.join(DATA, f"{_stem}_fixtures.json")) as f:
        FIXTURES[_stem] = json.load(f)


def make_engine(stem: str, **kw):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(
        model=DATA, weight_file=os.path.join(DATA, f"{stem}-f32.gguf"),
        mmproj=os.path.join(DATA, f"{stem}-mmproj-f32.gguf"), backend="cpu",
        kv_cache_memory_mb=16, async_scheduling=False, **kw))


def images_of(case: dict) -> list:
    return [sample_image(w, h, seed=s) for w, h, s in case["images"]]


@pytest.mark.parametrize("stem, name", [(s, n) for s in STEMS for n in FIXTURES[s]])
def test_engine_matches_transformers(stem, name):
    """The projector's tower (learned positions interpolated, DeepStack features into the first
    layers) and the text file's interleaved M-RoPE language model: transformers' tokens, with
    chunked prefill cutting the images' runs."""
    from engine.sampling.sampling_params import SamplingParams
    from engine.vision.families import image_processor, preprocess
    case = FIXTURES[stem][name]
    engine = make_engine(stem, max_num_batched_tokens=32)
    vision = engine.model_config.vision
    assert engine.model_config.architecture == STEMS[stem]
    assert vision.deepstack_visual_indexes == (0, 2) and vision.mrope_interleaved
    processor = image_processor(DATA, vision)
    processed = [preprocess(im, processor) for im in images_of(case)]
    seq = engine.add_request("r", case["prompt_ids"], SamplingParams(
        max_tokens=len(case["tokens"]), temperature=0, ignore_eos=True), images=processed)
    while engine.has_unfinished():
        engine.step()
    assert case["trusted"] >= 6
    assert seq.output_token_ids[:case["trusted"]] == case["tokens"][:case["trusted"]]
    assert engine.runner.vision.num_encoded == len(processed)


@pytest.mark.parametrize("stem", list(STEMS))
def test_server_with_mmproj_matches_transformers(tmp_path, stem):
    """`--f` and `--mmproj`: the GGUF's own tokenizer and chat template build the prompt
    transformers' processor built, and each token's logprob is transformers' (1e-3: these move
    with every weight of the tower)."""
    server = LiveServer(tmp_path, DATA, "--f", f"{stem}-f32.gguf", "--mmproj",
                        os.path.join(DATA, f"{stem}-mmproj-f32.gguf"), "--mem", "16",
                        "--served-model-name", "q3")
    try:
        client = client_for(server.port)
        for name, case in FIXTURES[stem].items():
            it = iter(images_of(case))
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                        + base64.b64encode(png_bytes(next(it))).decode()}}
                       if p is None else {"type": "text", "text": p} for p in case["parts"]]
            out = client.chat.completions.create(
                model="q3", messages=[{"role": "user", "content": content}],
                max_tokens=len(case["tokens"]), temperature=0, logprobs=True,
                extra_body={"ignore_eos": True})
            assert out.usage.prompt_tokens == len(case["prompt_ids"]), name
            assert case["trusted"] == len(case["tokens"])
            got = [e.logprob for e in out.choices[0].logprobs.content]
            assert np.allclose(got, case["logprobs"], atol=1e-3), (name, got, case["logprobs"])
    finally:
        server.close()


def test_projector_of_another_family_is_refused():
    from engine.loader.model_loader import load_gguf_model
    from pyx.cpu_backend import CpuBackend
    with pytest.raises(ValueError, match="Qwen3-VL projector needs a qwen3vl text GGUF"):
        load_gguf_model(os.path.join(DATA, "qwen25vl-f32.gguf"), CpuBackend(), mmproj=MMPROJ,
                        progress=False)
    with pytest.raises(ValueError, match="Qwen2.5-VL projector needs a qwen2vl text GGUF"):
        load_gguf_model(TEXT, CpuBackend(), mmproj=os.path.join(DATA, "qwen25vl-mmproj-f32.gguf"),
                        progress=False)

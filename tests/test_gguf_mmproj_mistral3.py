"""Mistral 3 from GGUF (issue 33): a mistral3 text file with llama.cpp's Pixtral projector file
(`--mmproj`), both written by llama.cpp's own converter from a tiny random checkpoint
(tests/data/make_gguf_mistral3_vl_fixtures.py), give transformers' greedy tokens on that
checkpoint for prompts with one and two images, through the engine and through a live server; a
projector beside a text file of another family is refused by name."""
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
TEXT = os.path.join(DATA, "mistral3vl-f32.gguf")
MMPROJ = os.path.join(DATA, "mistral3vl-mmproj-f32.gguf")
with open(os.path.join(DATA, "mistral3vl_fixtures.json")) as f:
    _DATA = json.load(f)
FIXTURES, TOWER_SHA256 = _DATA["cases"], _DATA["tower_sha256"]


def make_engine(**kw):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=DATA, weight_file=TEXT, mmproj=MMPROJ, backend="cpu",
                                  kv_cache_memory_mb=16, async_scheduling=False, **kw))


def images_of(case: dict) -> list:
    return [sample_image(w, h, seed=s) for w, h, s in case["images"]]


@pytest.mark.parametrize("name", list(FIXTURES))
def test_engine_matches_transformers(name):
    """The projector's Pixtral tower (q/k un-permuted, 2D rotary, patch merger) and the text
    file's Mistral: transformers' tokens, with chunked prefill cutting the images' runs."""
    from engine.sampling.sampling_params import SamplingParams
    from engine.vision.families import image_processor, preprocess
    case = FIXTURES[name]
    engine = make_engine(max_num_batched_tokens=32)
    assert engine.model_config.architecture == "Mistral3ForConditionalGeneration"
    processor = image_processor(DATA, engine.model_config.vision)
    processed = [preprocess(im, processor) for im in images_of(case)]
    seq = engine.add_request("r", case["prompt_ids"], SamplingParams(
        max_tokens=len(case["tokens"]), temperature=0, ignore_eos=True), images=processed)
    while engine.has_unfinished():
        engine.step()
    assert case["trusted"] >= 6
    assert seq.output_token_ids[:case["trusted"]] == case["tokens"][:case["trusted"]]
    assert engine.runner.vision.num_encoded == len(processed)


def test_server_with_mmproj_matches_transformers(tmp_path):
    """`--f` and `--mmproj`: the GGUF's own tokenizer and chat template build the prompt
    PixtralProcessor built (the image tokens' ids from the GGUF's vocabulary), and each token's
    logprob is transformers' (1e-3: these move with every weight of the tower)."""
    server = LiveServer(tmp_path, DATA, "--f", os.path.basename(TEXT), "--mmproj", MMPROJ,
                        "--mem", "16", "--served-model-name", "m3")
    try:
        client = client_for(server.port)
        for name, case in FIXTURES.items():
            it = iter(images_of(case))
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                        + base64.b64encode(png_bytes(next(it))).decode()}}
                       if p is None else {"type": "text", "text": p} for p in case["parts"]]
            out = client.chat.completions.create(
                model="m3", messages=[{"role": "user", "content": content}],
                max_tokens=len(case["tokens"]), temperature=0, logprobs=True,
                extra_body={"ignore_eos": True})
            assert out.usage.prompt_tokens == len(case["prompt_ids"]), name
            assert case["trusted"] == len(case["tokens"])
            got = [e.logprob for e in out.choices[0].logprobs.content]
            assert np.allclose(got, case["logprobs"], atol=1e-3), (name, got, case["logprobs"])
    finally:
        server.close()


def test_tower_tensors_equal_the_source():
    """Each tensor read from the projector file (q and k rows un-permuted, the names mapped)
    is the source checkpoint's, bit for bit (sha256 recorded by the fixture maker): the tiny
    tower's greedy tokens would not notice a wrong rotary pairing."""
    import hashlib

    from engine.loader.gguf_mmproj import read_mmproj
    _, weights = read_mmproj(MMPROJ)
    got = {name: hashlib.sha256(np.ascontiguousarray(w, np.float32).tobytes()).hexdigest()
           for name, w in sorted(weights.items())}
    assert got == TOWER_SHA256


def test_projector_of_another_family_is_refused():
    from engine.loader.model_loader import load_gguf_model
    from pyx.cpu_backend import CpuBackend
    with pytest.raises(ValueError, match="Pixtral projector needs a mistral3 text GGUF"):
        load_gguf_model(os.path.join(DATA, "qwen25vl-f32.gguf"), CpuBackend(), mmproj=MMPROJ,
                        progress=False)
    with pytest.raises(ValueError, match="Gemma 3 projector needs a gemma3 text GGUF"):
        load_gguf_model(TEXT, CpuBackend(), mmproj=os.path.join(DATA, "gemma3vl-mmproj-f32.gguf"),
                        progress=False)

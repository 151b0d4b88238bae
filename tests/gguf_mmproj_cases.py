"""What the GGUF vision-family tests (tests/test_gguf_mmproj*.py) share: a text GGUF plus
llama.cpp's projector file (`--mmproj`), both from tests/data/gguf, checked against the
transformers tokens and logprobs the fixture makers recorded, through the engine and through a
live server. Each test file keeps only what is specific to its family."""
from __future__ import annotations

import base64
import json
import os

import numpy as np

from server_fakes import LiveServer, client_for
from vision_checkpoint import png_bytes, sample_image

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")


def load_fixtures(stem: str):
    with open(os.path.join(DATA, f"{stem}_fixtures.json")) as f:
        return json.load(f)


def make_engine(text: str, mmproj: str, **kw):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=DATA, weight_file=text, mmproj=mmproj, backend="cpu",
                                  kv_cache_memory_mb=16, async_scheduling=False, **kw))


def images_of(case: dict) -> list:
    return [sample_image(w, h, seed=s) for w, h, s in case["images"]]


def check_engine_case(engine, case: dict) -> None:
    """The case's images through the engine's own preprocessing, then greedy decoding: the
    recorded transformers tokens up to its first near-tie, each image encoded once."""
    from engine.sampling.sampling_params import SamplingParams
    from engine.vision.families import image_processor, preprocess
    processor = image_processor(DATA, engine.model_config.vision)
    processed = [preprocess(im, processor) for im in images_of(case)]
    seq = engine.add_request("r", case["prompt_ids"], SamplingParams(
        max_tokens=len(case["tokens"]), temperature=0, ignore_eos=True), images=processed)
    while engine.has_unfinished():
        engine.step()
    assert case["trusted"] >= 6
    assert seq.output_token_ids[:case["trusted"]] == case["tokens"][:case["trusted"]]
    assert engine.runner.vision.num_encoded == len(processed)


def check_server_cases(tmp_path, text: str, mmproj: str, served: str, fixtures: dict,
                       check_text: bool = False) -> None:
    """A live server on `--f text --mmproj mmproj`: each case's chat request (images as PNG
    data URLs) gives the recorded prompt length and logprobs (1e-3: these move with every
    weight of the tower), and with `check_text` the recorded text too."""
    server = LiveServer(tmp_path, DATA, "--f", os.path.basename(text), "--mmproj", mmproj,
                        "--mem", "16", "--served-model-name", served)
    try:
        client = client_for(server.port)
        for name, case in fixtures.items():
            it = iter(images_of(case))
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                        + base64.b64encode(png_bytes(next(it))).decode()}}
                       if p is None else {"type": "text", "text": p} for p in case["parts"]]
            out = client.chat.completions.create(
                model=served, messages=[{"role": "user", "content": content}],
                max_tokens=len(case["tokens"]), temperature=0, logprobs=True,
                extra_body={"ignore_eos": True})
            assert out.usage.prompt_tokens == len(case["prompt_ids"]), name
            assert case["trusted"] == len(case["tokens"])
            if check_text:
                assert out.choices[0].message.content == case["text"], name
            got = [e.logprob for e in out.choices[0].logprobs.content]
            assert np.allclose(got, case["logprobs"], atol=1e-3), (name, got, case["logprobs"])
    finally:
        server.close()

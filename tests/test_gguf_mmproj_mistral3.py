"""Mistral 3 from GGUF (issue 33): a mistral3 text file with llama.cpp's Pixtral projector file
(`--mmproj`), both written by llama.cpp's own converter from a tiny random checkpoint
(tests/data/make_gguf_mistral3_vl_fixtures.py), give transformers' greedy tokens on that
checkpoint for prompts with one and two images, through the engine and through a live server; a
projector beside a text file of another family is refused by name."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("PIL")

from gguf_mmproj_cases import (  # noqa: E402
    DATA, check_engine_case, check_server_cases, load_fixtures, make_engine)

TEXT = os.path.join(DATA, "mistral3vl-f32.gguf")
MMPROJ = os.path.join(DATA, "mistral3vl-mmproj-f32.gguf")
_DATA = load_fixtures("mistral3vl")
FIXTURES, TOWER_SHA256 = _DATA["cases"], _DATA["tower_sha256"]


@pytest.mark.parametrize("name", list(FIXTURES))
def test_engine_matches_transformers(name):
    """The projector's Pixtral tower (q/k un-permuted, 2D rotary, patch merger) and the text
    file's Mistral: transformers' tokens, with chunked prefill cutting the images' runs."""
    engine = make_engine(TEXT, MMPROJ, max_num_batched_tokens=32)
    assert engine.model_config.architecture == "Mistral3ForConditionalGeneration"
    check_engine_case(engine, FIXTURES[name])


def test_server_with_mmproj_matches_transformers(tmp_path):
    """`--f` and `--mmproj`: the GGUF's own tokenizer and chat template build the prompt
    PixtralProcessor built (the image tokens' ids from the GGUF's vocabulary), and each token's
    logprob is transformers' (1e-3: these move with every weight of the tower)."""
    check_server_cases(tmp_path, TEXT, MMPROJ, "m3", FIXTURES)


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

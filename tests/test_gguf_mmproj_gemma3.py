"""Gemma 3 from GGUF (issue 33): a gemma3 text file with llama.cpp's Gemma 3 projector file
(`--mmproj`), both written by llama.cpp's own converter from a tiny random checkpoint
(tests/data/make_gguf_gemma3_vl_fixtures.py), give transformers' greedy tokens on that checkpoint
for prompts with one and two images, through the engine and through a live server; a projector
beside a text file of another family is refused by name."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("PIL")

from gguf_mmproj_cases import (  # noqa: E402
    DATA, check_engine_case, check_server_cases, load_fixtures, make_engine)

TEXT = os.path.join(DATA, "gemma3vl-f32.gguf")
MMPROJ = os.path.join(DATA, "gemma3vl-mmproj-f32.gguf")
FIXTURES = load_fixtures("gemma3vl")


@pytest.mark.parametrize("name", list(FIXTURES))
def test_engine_matches_transformers(name):
    """The projector's SigLIP tower and pooling, the text file's Gemma 3 (llama.cpp's layer
    pattern) with the image tokens attending both ways: transformers' tokens, with chunks that
    stop before an image they would cut."""
    engine = make_engine(TEXT, MMPROJ, max_num_batched_tokens=20)
    assert engine.model_config.architecture == "Gemma3ForConditionalGeneration"
    check_engine_case(engine, FIXTURES[name])


def test_server_with_mmproj_matches_transformers(tmp_path):
    """`--f` and `--mmproj`: the GGUF's own tokenizer and chat template build the prompt
    transformers' processor built (the image expanded in the text), and each token's logprob is
    transformers' (1e-3: these move with every weight of the tower)."""
    check_server_cases(tmp_path, TEXT, MMPROJ, "g3", FIXTURES)


def test_projector_of_another_family_is_refused():
    from engine.loader.model_loader import load_gguf_model
    from pyx.cpu_backend import CpuBackend
    with pytest.raises(ValueError, match="Gemma 3 projector needs a gemma3 text GGUF"):
        load_gguf_model(os.path.join(DATA, "qwen25vl-f32.gguf"), CpuBackend(), mmproj=MMPROJ,
                        progress=False)
    with pytest.raises(ValueError, match="Qwen2.5-VL projector needs a qwen2vl text GGUF"):
        load_gguf_model(TEXT, CpuBackend(), mmproj=os.path.join(DATA, "qwen25vl-mmproj-f32.gguf"),
                        progress=False)

"""Qwen3-VL from GGUF (issue 33): a qwen3vl text file (and a qwen3vlmoe one, Qwen3-VL-MoE) with
llama.cpp's Qwen3-VL projector file (`--mmproj`, DeepStack mergers included), both written by
llama.cpp's own converter from a tiny random checkpoint
(tests/data/make_gguf_qwen3vl_fixtures.py), give transformers' greedy tokens on
that checkpoint for prompts with one, two and a larger image, through the engine and through a
live server; a projector beside a text file of another family is refused by name."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("PIL")

from gguf_mmproj_cases import (  # noqa: E402
    DATA, check_engine_case, check_server_cases, load_fixtures, make_engine)

TEXT = os.path.join(DATA, "qwen3vl-f32.gguf")
MMPROJ = os.path.join(DATA, "qwen3vl-mmproj-f32.gguf")
# file stem -> the vision-language architecture it loads as
STEMS = {"qwen3vl": "Qwen3VLForConditionalGeneration",
         "qwen3vlmoe": "Qwen3VLMoeForConditionalGeneration"}
FIXTURES = {stem: load_fixtures(stem) for stem in STEMS}


def files_of(stem: str) -> tuple[str, str]:
    """The stem's text GGUF and its projector file."""
    return os.path.join(DATA, f"{stem}-f32.gguf"), os.path.join(DATA, f"{stem}-mmproj-f32.gguf")


@pytest.mark.parametrize("stem, name", [(s, n) for s in STEMS for n in FIXTURES[s]])
def test_engine_matches_transformers(stem, name):
    """The projector's tower (learned positions interpolated, DeepStack features into the first
    layers) and the text file's interleaved M-RoPE language model: transformers' tokens, with
    chunked prefill cutting the images' runs."""
    engine = make_engine(*files_of(stem), max_num_batched_tokens=32)
    vision = engine.model_config.vision
    assert engine.model_config.architecture == STEMS[stem]
    assert vision.deepstack_visual_indexes == (0, 2) and vision.mrope_interleaved
    check_engine_case(engine, FIXTURES[stem][name])


@pytest.mark.parametrize("stem", list(STEMS))
def test_server_with_mmproj_matches_transformers(tmp_path, stem):
    """`--f` and `--mmproj`: the GGUF's own tokenizer and chat template build the prompt
    transformers' processor built, and each token's logprob is transformers' (1e-3: these move
    with every weight of the tower)."""
    check_server_cases(tmp_path, *files_of(stem), "q3", FIXTURES[stem])


def test_projector_of_another_family_is_refused():
    from engine.loader.model_loader import load_gguf_model
    from pyx.cpu_backend import CpuBackend
    with pytest.raises(ValueError, match="Qwen3-VL projector needs a qwen3vl text GGUF"):
        load_gguf_model(os.path.join(DATA, "qwen25vl-f32.gguf"), CpuBackend(), mmproj=MMPROJ,
                        progress=False)
    with pytest.raises(ValueError, match="Qwen2.5-VL projector needs a qwen2vl text GGUF"):
        load_gguf_model(TEXT, CpuBackend(), mmproj=os.path.join(DATA, "qwen25vl-mmproj-f32.gguf"),
                        progress=False)

"""Qwen2.5-VL from GGUF (issue 33): a qwen2vl text file with llama.cpp's projector file
(`--mmproj`), both written by llama.cpp's own converter from a tiny random checkpoint
(tests/data/make_gguf_vl_fixtures.py), give transformers' greedy tokens on that checkpoint for
prompts with one and two images, through the engine and through a live server; files that do not
go together are refused by name."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("PIL")

from gguf_mmproj_cases import (  # noqa: E402
    DATA, check_engine_case, check_server_cases, load_fixtures, make_engine)

TEXT = os.path.join(DATA, "qwen25vl-f32.gguf")
MMPROJ = os.path.join(DATA, "qwen25vl-mmproj-f32.gguf")
FIXTURES = load_fixtures("qwen25vl")


@pytest.mark.parametrize("name", list(FIXTURES))
def test_engine_matches_transformers(name):
    """The projector's tower and the text file's M-RoPE language model: transformers' tokens
    (up to its first near-tie), with chunked prefill cutting the images' runs."""
    check_engine_case(make_engine(TEXT, MMPROJ, max_num_batched_tokens=32), FIXTURES[name])


def test_server_with_mmproj_matches_transformers(tmp_path):
    """`--weight-file` and `--mmproj`: the GGUF's own tokenizer and chat template build the
    prompt transformers' processor built, and the answer is transformers' text, each token's
    logprob transformers' (1e-3: these move with every weight of the tower)."""
    check_server_cases(tmp_path, TEXT, MMPROJ, "vl", FIXTURES, check_text=True)


def test_mismatched_files_are_refused():
    from engine.loader.model_loader import load_gguf_model
    from pyx.cpu_backend import CpuBackend
    with pytest.raises(ValueError, match="not a llama.cpp vision projector"):
        load_gguf_model(TEXT, CpuBackend(), mmproj=TEXT, progress=False)
    with pytest.raises(ValueError, match="needs a qwen2vl text GGUF"):
        load_gguf_model(os.path.join(DATA, "qwen2-f32.gguf"), CpuBackend(), mmproj=MMPROJ,
                        progress=False)
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF --weight-file"):
        from engine.config import EngineConfig
        from engine.core.llm_engine import LLMEngine
        LLMEngine(EngineConfig(model=DATA, mmproj=MMPROJ, backend="cpu"))

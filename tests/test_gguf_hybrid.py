"""GGUF `qwen3next`, `qwen35` and `qwen35moe` (engine/loader/gguf_hybrid.py) on files llama.cpp's
own converter wrote (tests/data/make_gguf_hybrid_fixtures.py): a Qwen3-Next-shaped, a Qwen3.5 and
a Qwen3.5-MoE tiny model, float and Q8_0, each with 2 key heads serving 4 value heads.
in_proj_qkvz comes back from attn_qkv and attn_gate (Qwen3-Next), Qwen3.5's value heads from the
converter's tiled order, the norms without the converter's + 1, A_log from ssm_a = -exp(A_log).

The reference, recorded in tests/data/gguf/hybrid_fixtures.json, is transformers on the weights
each file holds (gguf-py's dequantization of every tensor, put back in the source model). Float
files: tokens and first-step logits as the other float GGUF tests; Q8_0 files: comparison stops
where the reference's top two are within 0.05 (QUANT_TIE in tests/gguf_fixtures.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.loader.gguf import read_gguf
from engine.models.model_config import ModelConfig
from gguf_fixtures import HERE, RecordedFixtures, load_script, path_of, source_config

RECORDED = RecordedFixtures("hybrid_fixtures.json", min_trusted_steps=6)
FILES = RECORDED.files


@pytest.mark.parametrize("stem", list(FILES))
def test_config_matches_the_source_config(stem):
    name, _ = FILES[stem]
    ours = ModelConfig.from_dict(read_gguf(path_of(stem), progress=False).config)
    src = source_config(name)
    for key in ("architecture", "linear_attention", "moe", "rope", "hidden_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(src, key), key


@pytest.mark.parametrize("stem", RECORDED.float_files + RECORDED.quant_files)
def test_gguf_greedy_matches_transformers_on_the_file_weights(stem):
    RECORDED.assert_greedy_matches_reference(stem)


@pytest.mark.parametrize("stem", ["qwen3_next-q8_0", "qwen3_5-f32"])
def test_llm_generates_from_a_hybrid_gguf_file(stem):
    RECORDED.assert_llm_generates(stem)


def test_delta_net_tensors_are_float_and_the_rest_stays_packed():
    """In a Q8_0 file the DeltaNet's tensors are dequantized (they are regrouped row by row and
    column by column); the attention and expert matrices keep the file's blocks."""
    from pyx.weights.ggml import QuantizedWeight
    w = read_gguf(path_of("qwen3_5_moe-q8_0"), progress=False).weights
    for name in ("in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight"):
        assert isinstance(w[f"model.layers.0.linear_attn.{name}"], np.ndarray), name
    assert isinstance(w["model.layers.3.self_attn.q_proj.weight"], QuantizedWeight)
    assert isinstance(w["model.layers.0.mlp.experts.0.down_proj.weight"], QuantizedWeight)


def test_unequal_delta_net_head_sizes_are_refused(tmp_path):
    """llama.cpp reads the DeltaNet's key and value head sizes as one (ssm.state_size); a file
    whose ssm.inner_size says otherwise is refused by name, not misread."""
    maker = load_script(f"{HERE}/data/make_gguf_fixtures.py")
    dst = str(tmp_path / "unequal.gguf")
    maker.copy_gguf(path_of("qwen3_5-f32"), dst, overrides={"qwen35.ssm.inner_size": 4 * 48})
    with pytest.raises(ValueError, match="value head size 48 .* differs from its key head size"):
        read_gguf(dst, progress=False)

"""GGUF `deepseek2` (engine/loader/gguf_deepseek.py) on files llama.cpp's own converter wrote
(tests/data/make_gguf_mla_fixtures.py): a DeepSeek-V2-Lite-shaped and a DeepSeek-V3-shaped tiny
model, float and Q8_0. kv_b_proj comes back from attn_k_b / attn_v_b, the router from
expert_gating_func and the expert_* keys, YaRN's mscale from yarn_log_multiplier.

The reference, recorded in tests/data/gguf/mla_fixtures.json, is transformers on the weights each
file holds (gguf-py's dequantization of every tensor, put back in the source model). Float files:
tokens and first-step logits as the other float GGUF tests; Q8_0 files: comparison stops where
the reference's top two are within 0.05 (QUANT_TIE in tests/gguf_fixtures.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, quants

from engine.loader.gguf import read_gguf
from engine.models.model_config import ModelConfig
from gguf_fixtures import HERE, RecordedFixtures, load_script, path_of, source_config

RECORDED = RecordedFixtures("mla_fixtures.json", min_trusted_steps=6)
maker = load_script(f"{HERE}/data/make_gguf_fixtures.py")
FILES = RECORDED.files


@pytest.mark.parametrize("stem", list(FILES))
def test_config_matches_the_source_config(stem):
    name, _ = FILES[stem]
    ours = ModelConfig.from_dict(read_gguf(path_of(stem), progress=False).config)
    src = source_config(name)
    for key in ("architecture", "mla", "moe", "rope", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "tie_word_embeddings", "max_model_len", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(src, key), key


@pytest.mark.parametrize("stem", list(FILES))
def test_kv_b_proj_is_joined_from_its_per_head_parts(stem):
    """attn_k_b (heads, kv_lora_rank, nope) and attn_v_b (heads, v, kv_lora_rank) become
    kv_b_proj (heads * (nope + v), kv_lora_rank) in float: head h's rows are its key part
    transposed, then its value part."""
    ck = read_gguf(path_of(stem), progress=False)
    tensors = {t.name: t for t in GGUFReader(path_of(stem)).tensors}

    def f32(name):
        t = tensors[name]
        return np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(
            [int(d) for d in reversed(t.shape.tolist())])
    k_b, v_b = f32("blk.1.attn_k_b.weight"), f32("blk.1.attn_v_b.weight")
    kv_b = ck.weights["model.layers.1.self_attn.kv_b_proj.weight"]
    H, L, N = k_b.shape
    per_head = np.asarray(kv_b).reshape(H, -1, L)
    np.testing.assert_array_equal(per_head[:, :N], k_b.transpose(0, 2, 1))
    np.testing.assert_array_equal(per_head[:, N:], v_b)
    assert not any(n.endswith(("attn_k_b", "attn_v_b")) for n in ck.weights)


@pytest.mark.parametrize("stem", RECORDED.float_files + RECORDED.quant_files)
def test_gguf_greedy_matches_transformers_on_the_file_weights(stem):
    RECORDED.assert_greedy_matches_reference(stem)


def test_llm_generates_from_an_mla_gguf_file():
    RECORDED.assert_llm_generates("deepseek_v3-q8_0")


def test_gating_function_decides_the_router(tmp_path):
    """The V3 file without expert_gating_func reads as llama.cpp reads such a file (softmax:
    DeepSeek-V2's router), and its greedy tokens then leave transformers' V3 reference."""
    from test_gguf import greedy
    dst = maker.copy_gguf(path_of("deepseek_v3-f32"), str(tmp_path / "no_gating.gguf"),
                          leave_out=("deepseek2.expert_gating_func",))[0]
    ck = read_gguf(dst, progress=False)
    assert ck.config["architectures"] == ["DeepseekV2ForCausalLM"]
    ref, n = RECORDED.reference("deepseek_v3-f32")
    prompt = RECORDED.fix["models"]["deepseek_v3"]["prompt_ids"]
    assert greedy(ck.config, ck.weights, prompt, n)[0] != ref["tokens"][:n]

"""GGUF for Mixtral, Qwen2-MoE and Qwen3-MoE (engine/loader/gguf.py) on files llama.cpp's own
converter wrote (tests/data/make_gguf_moe_fixtures.py): the merged expert tensors
(`blk.N.ffn_{gate,up,down}_exps`, E x rows x cols), the shared expert (`*_shexp`), the
`{arch}.expert_*` metadata, Mixtral's interleaved q/k rows, the file's tokenizer.

The reference, recorded in tests/data/gguf/moe_fixtures.json, is transformers on the weights
each file holds (gguf-py's dequantization of every tensor, put back in the source model).
Float files: tokens and first-step logits as the float GGUF tests. Q8_0 files: Taper quantizes
activations to 8 bits (as llama.cpp does), which moves logits by a few hundredths, so comparison
stops where the reference's top two are within 0.05 (QUANT_TIE in tests/gguf_fixtures.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from engine.loader.gguf import read_gguf
from engine.models.model_config import ModelConfig
from pyx.cpu_backend import dequantize_weight
from pyx.weights.ggml import QuantizedWeight
from server_fakes import LiveServer, client_for, post_json
from gguf_fixtures import DATA, RecordedFixtures, path_of, source_config
from test_gguf import greedy

RECORDED = RecordedFixtures("moe_fixtures.json", min_trusted_steps=4)
FIX, FILES = RECORDED.fix, RECORDED.files
FLOAT_FILES, QUANT_FILES = RECORDED.float_files, RECORDED.quant_files
reference = RECORDED.reference
EXPERT_BLOCK = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


@pytest.mark.parametrize("stem", list(FILES))
def test_config_matches_the_source_config(stem):
    name, _ = FILES[stem]
    ours = ModelConfig.from_dict(read_gguf(path_of(stem), progress=False).config)
    src = source_config(name)
    assert ours.architecture == src.architecture
    assert ours.moe == src.moe
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(src, key), key


@pytest.mark.parametrize("stem", list(FILES))
def test_each_expert_is_its_slice_of_the_merged_tensor(stem):
    """Expert e's matrices are rows [e] of the file's merged tensor, in the file's own type
    (Q8_0 blocks stay blocks), so `backend.linear` runs them as dense weights; gguf-py's
    dequantization of the slice is what they hold."""
    name, kind = FILES[stem]
    ck = read_gguf(path_of(stem), progress=False)
    block, (gate, up, down) = EXPERT_BLOCK[name]
    tensors = {t.name: t for t in GGUFReader(path_of(stem)).tensors}
    num_experts = ck.config.get("num_local_experts") or ck.config["num_experts"]
    for gguf_name, hf in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
        t = tensors[f"blk.1.{gguf_name}.weight"]
        merged = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        assert merged.shape[0] == num_experts
        for e in range(num_experts):
            w = ck.weights[f"model.layers.1.{block}.experts.{e}.{hf}.weight"]
            if kind == "q8_0":
                assert isinstance(w, QuantizedWeight) and w.quant_parts[0][0] == QT.Q8_0
                w = dequantize_weight(w)
            np.testing.assert_array_equal(np.asarray(w, np.float32), merged[e])
    assert not any("exps" in k for k in ck.weights)


@pytest.mark.parametrize("stem", FLOAT_FILES + QUANT_FILES)
def test_gguf_greedy_matches_transformers_on_the_file_weights(stem):
    RECORDED.assert_greedy_matches_reference(stem)


def test_the_q8_0_reference_sees_the_quantization():
    """The Q8_0 files' reference logits differ from the float files' by more than the float
    tolerance, so matching them says something about the quantized path."""
    for name, m in FIX["models"].items():
        floats = [k for k in m["files"] if k != "q8_0"]
        a = np.array(m["files"][floats[0]]["transformers"]["first_logits"])
        b = np.array(m["files"]["q8_0"]["transformers"]["first_logits"])
        assert np.abs(a - b).max() > 1e-3 * max(1.0, np.abs(a).max()), name


def test_mixtral_qk_rows_are_unpermuted():
    """The converter interleaves Mixtral's q/k rows ("llama" architecture): the file's raw rows
    give other tokens than the reference."""
    stem = "mixtral-f32"
    m = FIX["models"]["mixtral"]
    ref, n = reference(stem)
    ck = read_gguf(path_of(stem), progress=False)
    raw = {t.name: t.data for t in GGUFReader(path_of(stem)).tensors}
    for i in range(2):
        for p in "qk":
            ck.weights[f"model.layers.{i}.self_attn.{p}_proj.weight"] = raw[f"blk.{i}.attn_{p}.weight"]
    assert greedy(ck.config, ck.weights, m["prompt_ids"], n)[0] != ref["tokens"][:n]


def test_routing_normalisation_follows_llama_cpp():
    """Qwen2-MoE files route without renormalising the top-k weights, as llama.cpp's qwen2moe
    graph does and the source config says; renormalising moves the first-step logits a hundred
    times past the float files' tolerance (1e-4 of the largest logit)."""
    stem = "qwen2_moe-f16"
    m = FIX["models"]["qwen2_moe"]
    ref, n = reference(stem)
    ck = read_gguf(path_of(stem), progress=False)
    assert ck.config["norm_topk_prob"] is False
    assert read_gguf(path_of("qwen3_moe-f32"), progress=False).config["norm_topk_prob"] is True
    ck.config["norm_topk_prob"] = True
    first = greedy(ck.config, ck.weights, m["prompt_ids"], 1)[1]
    ref_first = np.array(ref["first_logits"])
    assert np.abs(first - ref_first).max() > 100 * 1e-4 * max(1.0, np.abs(ref_first).max())


@pytest.mark.parametrize("stem", ["mixtral-q8_0", "qwen2_moe-f16", "qwen3_moe-q8_0"])
def test_llm_generates_from_a_moe_gguf_file(stem):
    """The whole engine: the file's own tokenizer encodes the prompt text; greedy tokens as
    above."""
    RECORDED.assert_llm_generates(stem)


def test_server_serves_a_moe_gguf_file(tmp_path):
    """`python -m server --w DIR --f FILE.gguf` with the official openai client: the reference
    tokens, as text the server's own detokenizer writes."""
    stem = "qwen2_moe-q8_0"
    m = FIX["models"]["qwen2_moe"]
    ref, n = reference(stem)
    server = LiveServer(tmp_path, DATA, "--f", f"{stem}.gguf", "--mem", "32")
    try:
        client = client_for(server.port)
        assert [x.id for x in client.models.list()] == [stem]
        out = client.completions.create(model=stem, prompt=m["prompt_ids"], max_tokens=n,
                                        temperature=0,
                                        extra_body={"ignore_eos": True})
        status, text = post_json(server.port, "/detokenize", {"tokens": ref["tokens"][:n]})
        assert status == 200
        assert out.choices[0].text == text["prompt"]
        assert out.usage.completion_tokens == n
    finally:
        server.close()

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


def _with_mtp_layer(src: str, dst: str) -> str:
    """GGUF `src` rewritten as `dst` the way the converter writes a checkpoint with an MTP head:
    one more block (block_count, nextn_predict_layers, recurrent_layers extended), holding a
    copy of the last layer's tensors and the blk.N.nextn.* ones."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n = int(reader.fields[f"{arch}.block_count"].contents())
    w = GGUFWriter(dst, arch)
    for k, f in reader.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", "general.alignment"):
            continue
        value = f.contents()
        if k == f"{arch}.block_count":
            value = n + 1
        elif k == f"{arch}.attention.recurrent_layers":
            value = value + [False]
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(k, value, f.types[0], sub_type=sub)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for t in reader.tensors:
        if t.name.startswith(f"blk.{n - 1}."):
            w.add_tensor(t.name.replace(f"blk.{n - 1}.", f"blk.{n}."), t.data,
                         raw_dtype=t.tensor_type)
    H = int(reader.fields[f"{arch}.embedding_length"].contents())
    rng = np.random.default_rng(0)
    for name, shape in (("eh_proj", (H, 2 * H)), ("enorm", (H,)), ("hnorm", (H,)),
                        ("shared_head_norm", (H,))):
        w.add_tensor(f"blk.{n}.nextn.{name}.weight", rng.standard_normal(shape, np.float32),
                     raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_mtp_layers_are_left_out(tmp_path):
    """A file with a multi-token-prediction block (as the converter writes Qwen3-Next's release,
    without --no-mtp) reads as the model without it: the same config and greedy tokens."""
    from test_gguf import greedy
    dst = _with_mtp_layer(path_of("qwen3_next-f32"), str(tmp_path / "mtp.gguf"))
    ck = read_gguf(dst, progress=False)
    plain = read_gguf(path_of("qwen3_next-f32"), progress=False)
    assert ck.config == plain.config
    assert set(ck.weights) == set(plain.weights)
    ref, n = RECORDED.reference("qwen3_next-f32")
    prompt = RECORDED.fix["models"]["qwen3_next"]["prompt_ids"]
    assert greedy(ck.config, ck.weights, prompt, n)[0] == ref["tokens"][:n]

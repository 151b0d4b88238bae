"""GGUF loading (engine/loader/gguf.py, gguf_tokenizer.py) against files from independent writers.

The fixtures in tests/data/gguf/ were written by llama.cpp's own converter (convert_hf_to_gguf.py)
and quantizer (llama_model_quantize) from random checkpoints transformers wrote; see
tests/data/make_gguf_fixtures.py. fixtures.json records what llama.cpp and transformers computed
on them: llama.cpp's tokenization of TOKENIZER_TEXTS (also under other tokenizer.ggml.pre names),
its greedy tokens, top-two margins and first-step logits per file (f32 KV cache), and the same
from transformers for each source checkpoint. The source weights are rebuilt here (deterministic
on CPU) and checked against the sha256 recorded when the fixtures were made.

Other GGUF files (a Q8_0 llama file, split shards, broken files, other pre-tokenizer names) are
written in the tests with gguf-py's GGUFWriter and reference quantizer, llama.cpp's Python package.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from engine.loader.gguf import (build_config, hf_name, llama3_rope, read_gguf, read_metadata,
                                unpermute_rows)
from engine.text.gguf_tokenizer import build_tokenizer
from engine.models.model_config import ModelConfig
from pyx.weights.ggml import QuantizedWeight
from gguf_fixtures import DATA, HERE, QUANT_TIE, TIE, load_script, path_of, trusted

REPO_ROOT = os.path.dirname(HERE)
with open(os.path.join(DATA, "fixtures.json")) as f:
    FIX = json.load(f)

# file stem -> (source model, kind); kind is the converter's outtype or a quantization
FILES = {"qwen2-f32": ("qwen2", "f32"), "qwen2-q8_0": ("qwen2", "q8_0"),
         "qwen2-q4_k_m": ("qwen2", "q4_k_m"), "llama-f32": ("llama", "f32"),
         "qwen3-bf16": ("qwen3", "bf16")}
FLOAT_FILES = ["llama-f32", "qwen2-f32", "qwen3-bf16"]
QUANT_FILES = ["qwen2-q8_0", "qwen2-q4_k_m"]
# Relative RMS error of llama.cpp's blocks against the source weights, per type (measured:
# Q8_0 0.005, Q6_K 0.018, Q4_K 0.071; a row permutation or a wrong scale gives ~1.4).
DEQUANT_TOL = {QT.Q8_0: 0.01, QT.Q6_K: 0.03, QT.Q4_K: 0.1}


maker = load_script(os.path.join(HERE, "data", "make_gguf_fixtures.py"))


@functools.lru_cache(maxsize=None)
def checkpoint(stem: str, dtype: str = "auto"):
    """read_gguf of a fixture, shared by tests that do not consume its weights."""
    return read_gguf(path_of(stem), dtype=dtype, progress=False)


@functools.lru_cache(maxsize=None)
def reader(stem: str) -> GGUFReader:
    return GGUFReader(path_of(stem))


@functools.lru_cache(maxsize=None)
def source_weights(name: str) -> dict[str, np.ndarray]:
    """The source checkpoint's tensors (float32), rebuilt and checked against fixtures.json."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(os.path.join(DATA, f"{name}-source"))
    model = maker.source_model(name, config)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    recorded = FIX["models"][name]["source_sha256"]
    drifted = sorted(k for k, v in weights.items() if maker.tensor_sha256(v) != recorded.get(k))
    if drifted or set(weights) != set(recorded):
        pytest.fail(f"{name}: rebuilt source weights differ from the ones the fixtures were made "
                    f"from ({drifted[:3]}...): torch/transformers changed; rerun "
                    "tests/data/make_gguf_fixtures.py")
    return weights


def source_config(name: str) -> ModelConfig:
    with open(os.path.join(DATA, f"{name}-source", "config.json")) as f:
        return ModelConfig.from_dict(json.load(f))


# ---- the fixtures are what fixtures.json describes

def test_fixtures_are_the_recorded_llama_cpp_files():
    assert FIX["versions"]["llama_cpp_python"] == "0.3.36"
    for stem, (name, kind) in FILES.items():
        entry = FIX["models"][name]["files"][kind]
        assert entry["file"] == f"{stem}.gguf" and entry["bytes"] == os.path.getsize(path_of(stem))
        assert entry["sha256"] == maker.sha256_file(path_of(stem))
        assert entry["tensor_types"] == {t.name: t.tensor_type.name for t in reader(stem).tensors}


# ---- config

@pytest.mark.parametrize("stem", list(FILES))
def test_config_matches_source_config_json(stem):
    name, kind = FILES[stem]
    ours = ModelConfig.from_dict(checkpoint(stem).config)
    src = source_config(name)
    for field in ModelConfig.__slots__:
        if field != "dtype":
            assert getattr(ours, field) == getattr(src, field), field
    assert ours.dtype == {"bf16": "bfloat16"}.get(kind, "float32")
    assert ours.quantization is None    # quantized tensors arrive as QuantizedWeight, like --isq


def test_llama3_rope_is_recovered_from_rope_freqs():
    config = checkpoint("llama-f32").config
    with open(os.path.join(DATA, "llama-source", "config.json")) as f:
        params = dict(json.load(f)["rope_parameters"])
    assert config["rope_theta"] == params.pop("rope_theta")
    assert config["rope_scaling"] == params
    assert "rope_freqs.weight" in {t.name for t in reader("llama-f32").tensors}
    assert not any("rope_freqs" in n for n in checkpoint("llama-f32").weights)


def _transformers_llama3_factors(theta, dim, **params):
    """Per-frequency factors from transformers' own llama3 RoPE (independent of ours)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim,
                         max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, **params})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    return plain / scaled.double().numpy()


@pytest.mark.parametrize("params", [
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),        # Llama 3.1
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),        # Llama 3.2
    dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=2.0,
         original_max_position_embeddings=4096)])
def test_llama3_rope_parameters_from_transformers_factors(params):
    factors = _transformers_llama3_factors(500000.0, 128, **params).astype(np.float32)
    assert llama3_rope("x.gguf", factors, 500000.0, 128) == {"rope_type": "llama3", **params}


def _meta(arch="llama", **extra):
    base = {"general.architecture": arch, f"{arch}.embedding_length": 256,
            f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 768,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.context_length": 4096}
    return {**base, **{f"{arch}.{k}" if not k.startswith(("general.", "tokenizer.")) else k: v
                       for k, v in extra.items()}}


def _tensors(*names, vocab=512):
    out = {"token_embd.weight": SimpleNamespace(shape=[256, vocab], tensor_type=QT.Q4_K)}
    out.update({n: SimpleNamespace(shape=[256, 256], tensor_type=QT.F16) for n in names})
    return out


def test_config_variants_from_metadata():
    # linear RoPE (and the older rope.scale_linear key), partial rotary dims, float16 matrices
    for extra in ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
                  {"rope.scale_linear": 2.0}):
        c = build_config("x.gguf", _meta(**extra, **{"rope.dimension_count": 32}),
                         _tensors("output.weight"))
        assert c["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
        assert c["partial_rotary_factor"] == 0.5 and c["dtype"] == "float16"
        assert c["tie_word_embeddings"] is False and c["vocab_size"] == 512
        assert ModelConfig.from_dict(c).rope.rot_dim == 32
    # YaRN with its betas and attention factor
    c = build_config("x.gguf", _meta("qwen3", **{
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 32768, "rope.scaling.yarn_beta_fast": 16.0,
        "rope.scaling.yarn_beta_slow": 2.0, "rope.scaling.yarn_attn_factor": 0.9}), _tensors())
    assert c["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                 "original_max_position_embeddings": 32768, "beta_slow": 2.0,
                                 "attention_factor": 0.9}
    rope = ModelConfig.from_dict(c).rope
    assert (rope.beta_fast, rope.beta_slow, rope.attention_factor) == (16.0, 2.0, 0.9)
    # a llama file with a sliding window is Mistral; qwen2 keeps its per-layer pattern
    c = ModelConfig.from_dict(build_config("x.gguf", _meta(**{"attention.sliding_window": 64}),
                                           _tensors()))
    assert c.architecture == "MistralForCausalLM" and c.sliding_windows == [64, 64]
    c = ModelConfig.from_dict(build_config("x.gguf", _meta("qwen2", **{
        "attention.sliding_window": 64, "attention.sliding_window_pattern": [False, True]}),
        _tensors()))
    assert c.sliding_windows == [0, 64]
    # EOT/EOM ids join EOS; llama biases follow the tensors
    c = build_config("x.gguf", _meta(**{"tokenizer.ggml.eos_token_id": 2,
                                        "tokenizer.ggml.eot_token_id": 9}),
                     _tensors("blk.0.attn_q.bias"))
    assert c["eos_token_id"] == [2, 9] and c["attention_bias"] is True
    assert ModelConfig.from_dict(c).eos_token_ids == [2, 9]


@pytest.mark.parametrize("meta,match", [
    (_meta(**{"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}), "longrope"),
    (_meta("falcon"), "unsupported GGUF architecture 'falcon'"),
    ({k: v for k, v in _meta().items() if k != "llama.block_count"}, "llama.block_count"),
    (_meta(**{"attention.head_count_kv": [2, 4]}), "differs between layers"),
])
def test_config_refusals_name_the_file(meta, match):
    with pytest.raises(ValueError, match=match) as e:
        build_config("/m/x.gguf", meta, _tensors())
    assert "/m/x.gguf" in str(e.value)


# ---- tokenizer

# transformers' GGUF loader splits SentencePiece text with Metaspace(prepend_scheme="first"): no
# "▁" before text that follows a special token, and none before text that already starts with a
# space. llama.cpp (add_space_prefix) and the sentencepiece library add it; we follow them.
TRANSFORMERS_SPM_DIFFERS = {"   leading spaces", " ", "<s>[INST] hello [/INST] sure</s>"}


@functools.lru_cache(maxsize=None)
def transformers_gguf_tokenizer(stem):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DATA, gguf_file=f"{stem}.gguf")


@pytest.mark.parametrize("stem", ["qwen2-f32", "llama-f32", "qwen3-bf16"])
def test_tokenizer_matches_llama_cpp_and_transformers(stem):
    name = FILES[stem][0]
    ours = checkpoint(stem).tokenizer
    oracle = transformers_gguf_tokenizer(stem)
    differs = TRANSFORMERS_SPM_DIFFERS if name == "llama" else set()
    records = FIX["models"][name]["llama_cpp_tokenize"]
    assert [r["text"] for r in records] == FIX["tokenizer_texts"]
    for r in records:
        text = r["text"]
        for add, expected in ((True, r["ids"]), (False, r["ids_no_special"])):
            got = ours.encode(text, add_special_tokens=add)
            assert got == expected, f"{text!r} (add_special_tokens={add}): llama.cpp {expected}"
            theirs = oracle.encode(text, add_special_tokens=add)
            if text in differs:
                assert theirs != expected, f"{text!r}: transformers now agrees; drop the exception"
            else:
                assert theirs == expected, f"{text!r} (add_special_tokens={add}): transformers"


@pytest.mark.parametrize("pre", list(FIX["models"]["qwen2"]["pre_variants"]))
def test_pre_tokenizer_table_matches_llama_cpp(tmp_path, pre):
    """The qwen2 vocabulary under other tokenizer.ggml.pre names: each picks llama.cpp's regex
    list (and its ignore_merges / add-BOS defaults); llama.cpp's ids are in fixtures.json."""
    path = maker.pre_variant(path_of("qwen2-f32"), str(tmp_path / f"{pre}.gguf"), pre)
    ours = build_tokenizer(read_metadata(GGUFReader(path)), path)
    for r in FIX["models"]["qwen2"]["pre_variants"][pre]:
        assert ours.encode(r["text"]) == r["ids"], repr(r["text"])
        assert ours.encode(r["text"], add_special_tokens=False) == r["ids_no_special"]


def test_unknown_pre_tokenizer_gives_no_tokenizer(tmp_path, caplog):
    path = maker.pre_variant(path_of("qwen2-f32"), str(tmp_path / "x.gguf"), "made-up")
    assert build_tokenizer(read_metadata(GGUFReader(path)), path) is None
    assert "made-up" in caplog.text and path in caplog.text


def test_sentencepiece_tokenizer_matches_the_sentencepiece_library():
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(
        model_file=os.path.join(DATA, "llama-source", "tokenizer.model"))
    ours = checkpoint("llama-f32").tokenizer
    texts = [t for t in FIX["tokenizer_texts"] if "<" not in t and "[" not in t]   # no specials
    assert len(texts) >= 12
    for text in texts:
        assert ours.encode(text) == [1] + sp.encode(text), repr(text)
        assert ours.decode(ours.encode(text)) == sp.decode(sp.encode(text)) == text


@pytest.mark.parametrize("stem", ["qwen2-q4_k_m", "qwen3-bf16"])
def test_byte_level_tokenizer_matches_the_source_tokenizer(stem):
    from transformers import PreTrainedTokenizerFast
    name = FILES[stem][0]
    src = PreTrainedTokenizerFast.from_pretrained(os.path.join(DATA, f"{name}-source"))
    ours = checkpoint(stem).tokenizer
    for text in FIX["tokenizer_texts"] + [FIX["prompt"]]:
        ids = ours.encode(text)
        assert ids == src.encode(text), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == src.decode(ids, skip_special_tokens=True)
    assert ours.encode(FIX["prompt"]) == FIX["models"][name]["prompt_ids"]
    # special and added tokens, ids, template: as the source tokenizer has them
    # bos: config.json's bos_token_id, which the converter writes (the source tokenizer has none)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (480, src.eos_token_id, src.pad_token_id)
    assert ours.all_special_ids == {480, 481, 482}
    assert ours.convert_ids_to_tokens(ours.encode("<think>x</think>")) == \
        src.convert_ids_to_tokens(src.encode("<think>x</think>"))
    assert ours.hf.chat_template == src.chat_template
    messages = [{"role": "user", "content": "hi <|im_end|> there"}]
    assert ours.apply_chat_template(messages) == src.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    ids = ours.encode_chat(messages)        # the special-token guard works on this tokenizer
    assert ids.count(482) == 1 and ids[0] == 481


def test_sentencepiece_tokenizer_special_tokens_and_template():
    ours = checkpoint("llama-f32").tokenizer
    with open(os.path.join(DATA, "llama-source", "tokenizer_config.json")) as f:
        config = json.load(f)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, None)
    assert ours.hf.unk_token == "<unk>" and ours.hf.chat_template == config["chat_template"]
    assert ours.all_special_ids == {0, 1, 2, 3, 4}     # <unk> <s> </s> [INST] [/INST]
    text = ours.apply_chat_template([{"role": "user", "content": "hello"},
                                     {"role": "assistant", "content": "sure"}])
    assert text == "<s>[INST] hello [/INST] sure</s>"
    assert ours.encode(text, add_special_tokens=False) == \
        FIX["models"]["llama"]["llama_cpp_tokenize"][-2]["ids_no_special"]


def test_reading_gguf_does_not_import_torch():
    code = ("import sys; from engine.loader.gguf import read_gguf; "
            f"c = read_gguf({path_of('qwen2-q4_k_m')!r}, progress=False); "
            "c.tokenizer.encode_chat([{'role': 'user', 'content': 'x'}]); c.tokenizer.decode([1]); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'llama_cpp' not in sys.modules, 'llama_cpp imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# ---- weights

@pytest.mark.parametrize("stem", FLOAT_FILES)
def test_float_weights_equal_the_source_checkpoint(stem):
    name, kind = FILES[stem]
    src = source_weights(name)
    weights = checkpoint(stem).weights
    tied = checkpoint(stem).config["tie_word_embeddings"]
    assert set(weights) == set(src) - ({"lm_head.weight"} if tied else set())
    for key, w in weights.items():
        expect = src[key]
        if kind == "bf16" and expect.ndim == 2:     # the converter keeps vectors in F32
            assert w.dtype == ml_dtypes.bfloat16
            expect = expect.astype(ml_dtypes.bfloat16)
        else:
            assert w.dtype == np.float32
        assert w.shape == expect.shape, key
        np.testing.assert_array_equal(np.asarray(w), expect, err_msg=key)


def test_unpermute_is_needed_for_llama_and_only_llama():
    for stem, permuted in (("llama-f32", True), ("qwen2-f32", False)):
        name = FILES[stem][0]
        src, raw = source_weights(name), {t.name: t.data for t in reader(stem).tensors}
        heads = {"q": 4, "k": 2}
        for i in range(2):
            for p in "qk":
                stored = raw[f"blk.{i}.attn_{p}.weight"]
                expect = src[f"model.layers.{i}.self_attn.{p}_proj.weight"]
                assert stored.shape == expect.shape
                assert np.array_equal(stored, expect) != permuted
                if permuted:
                    np.testing.assert_array_equal(unpermute_rows(stored, heads[p]), expect)


@pytest.mark.parametrize("stem", FLOAT_FILES + QUANT_FILES)
def test_weights_are_views_of_the_file(stem):
    ck, r = checkpoint(stem), reader(stem)
    file_bytes = sum(t.n_bytes for t in r.tensors)
    total = 0
    for key, w in ck.weights.items():
        arrays = [b for _, b in w.quant_parts] if isinstance(w, QuantizedWeight) else [w]
        total += sum(a.nbytes for a in arrays)
        if FILES[stem][0] != "llama" or ".q_proj." not in key and ".k_proj." not in key:
            assert all(not a.flags.owndata and not a.flags.writeable for a in arrays), key
    assert total <= 1.1 * file_bytes


def test_dtype_conversion_follows_the_safetensors_policy():
    src = source_weights("llama")
    ck = checkpoint("llama-f32", "bf16")
    q = ck.weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(q, src["model.layers.0.self_attn.q_proj.weight"].astype(q.dtype))
    assert ck.weights["model.norm.weight"].dtype == np.float32     # vectors stay f32
    up = checkpoint("qwen3-bf16", "f32").weights["model.layers.1.mlp.up_proj.weight"]
    assert up.dtype == np.float32
    np.testing.assert_array_equal(up, checkpoint("qwen3-bf16").weights[
        "model.layers.1.mlp.up_proj.weight"].astype(np.float32))
    w = checkpoint("qwen2-q8_0", "f32").weights["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(w, QuantizedWeight)       # block types stay packed under any dtype


@pytest.mark.parametrize("stem", QUANT_FILES)
def test_quantized_tensors_keep_the_file_types_and_bytes(stem):
    ck = checkpoint(stem)
    seen = set()
    for t in reader(stem).tensors:
        w = ck.weights[hf_name(t.name)]
        if t.tensor_type == QT.F32:
            assert isinstance(w, np.ndarray) and w.ndim == 1
            continue
        assert isinstance(w, QuantizedWeight), t.name
        ((qtype, blocks),) = w.quant_parts
        assert qtype == t.tensor_type and blocks.dtype == np.uint8
        assert blocks.nbytes == t.n_bytes and w.shape == (int(t.shape[1]), int(t.shape[0]))
        seen.add(QT(qtype))
    assert seen == {"qwen2-q8_0": {QT.Q8_0}, "qwen2-q4_k_m": {QT.Q4_K, QT.Q6_K}}[stem]


def _pyx_dequantize(qtype):
    """pyx's scalar reference for `qtype`, or None while the kernels lack it."""
    cpu = pytest.importorskip("pyx.cpu_backend", reason="could not import pyx.cpu_backend: the "
                              "CPU extensions are not built (pip install -e .)")
    dequantize, quant_block_size = cpu.dequantize, cpu.quant_block_size
    return dequantize if quant_block_size(int(qtype))[0] else None


@pytest.mark.parametrize("stem", QUANT_FILES)
def test_quantized_weights_are_close_to_the_source(stem):
    src = source_weights("qwen2")
    missing = set()
    for key, w in checkpoint(stem).weights.items():
        if not isinstance(w, QuantizedWeight):
            continue
        ((qtype, blocks),) = w.quant_parts
        ref = quants.dequantize(blocks, QT(qtype)).reshape(w.shape)    # gguf-py's reference
        err = np.linalg.norm(ref - src[key]) / np.linalg.norm(src[key])
        assert err < DEQUANT_TOL[QT(qtype)], (key, QT(qtype).name, err)
        if _pyx_dequantize(qtype) is None:
            missing.add(QT(qtype).name)
        else:
            from pyx.cpu_backend import dequantize_weight
            np.testing.assert_allclose(dequantize_weight(w), ref, rtol=0,
                                       atol=1e-6 * np.abs(ref).max())
    if missing:
        pytest.skip(f"pyx.cpu_backend.dequantize does not handle {sorted(missing)} yet "
                    "(gguf-py's reference was checked)")


# ---- files written here with gguf-py (maker.copy_gguf)

def test_quantized_llama_rows_are_unpermuted_as_blocks(tmp_path):
    """llama-f32 requantized to Q8_0 by gguf-py: the Q/K blocks we return are those of the
    source rows, i.e. the file's rows of blocks put back in Hugging Face order."""
    dst = str(tmp_path / "llama-q8_0.gguf")

    def q8(t):
        if t.tensor_type == QT.F32 and len(t.shape) == 2:
            return quants.quantize(t.data, QT.Q8_0), QT.Q8_0
        return t.data, t.tensor_type

    maker.copy_gguf(path_of("llama-f32"), dst, q8)
    src, raw = source_weights("llama"), {t.name: t.data for t in GGUFReader(dst).tensors}
    weights = read_gguf(dst, progress=False).weights
    for i in range(2):
        for p in "qk":
            w = weights[f"model.layers.{i}.self_attn.{p}_proj.weight"]
            ((qtype, blocks),) = w.quant_parts
            expect = quants.quantize(src[f"model.layers.{i}.self_attn.{p}_proj.weight"], QT.Q8_0)
            assert qtype == QT.Q8_0 and w.shape == (256 if p == "q" else 128, 256)
            np.testing.assert_array_equal(blocks, expect)
            assert not np.array_equal(raw[f"blk.{i}.attn_{p}.weight"], expect)   # needed


def test_split_model_reads_as_one(tmp_path):
    stem = "qwen2-q4_k_m"
    shards = maker.copy_gguf(path_of(stem), str(tmp_path / "model.gguf"), split_max_tensors=10)
    assert [os.path.basename(s) for s in shards] == [f"model-0000{i}-of-00003.gguf"
                                                     for i in (1, 2, 3)]
    whole = checkpoint(stem)
    for given in (shards[0], shards[2]):      # any shard leads to all of them
        ck = read_gguf(given, progress=False)
        assert ck.files == shards and ck.config == whole.config
        assert set(ck.weights) == set(whole.weights)
        for key, w in ck.weights.items():
            if isinstance(w, QuantizedWeight):
                ((qtype, blocks),) = w.quant_parts
                ((qtype0, blocks0),) = whole.weights[key].quant_parts
                assert qtype == qtype0
                np.testing.assert_array_equal(blocks, blocks0)
            else:
                np.testing.assert_array_equal(w, whole.weights[key])
        assert ck.tokenizer.encode(FIX["prompt"]) == whole.tokenizer.encode(FIX["prompt"])
    os.remove(shards[1])
    with pytest.raises(ValueError, match="model-00002-of-00003.gguf.* is missing"):
        read_gguf(shards[0], progress=False)


def _cut(src: str, dst, n: int) -> str:
    with open(src, "rb") as f:
        data = f.read(n)
    with open(dst, "wb") as f:
        f.write(data)
    return str(dst)


def test_bad_files_raise_value_error_naming_the_file(tmp_path):
    src = path_of("qwen2-q4_k_m")
    r = reader("qwen2-q4_k_m")
    size = os.path.getsize(src)
    cases = {"empty": _cut(src, tmp_path / "empty.gguf", 0),
             "magic": str(tmp_path / "magic.gguf")}
    with open(src, "rb") as f:
        data = bytearray(f.read())
    data[:4] = b"GGUX"
    with open(cases["magic"], "wb") as f:
        f.write(data)
    for n in (10, 100, 5000, r.data_offset - 8, r.data_offset + 1000, size - 1):
        cases[f"cut {n}"] = _cut(src, tmp_path / f"cut{n}.gguf", n)
    for what, p in cases.items():
        with pytest.raises(ValueError) as e:
            read_gguf(p, progress=False)
        assert p in str(e.value), what
        assert ("not a GGUF file" if what in ("empty", "magic") else "truncated") in str(e.value)


def test_unsupported_architecture_and_tensor_type(tmp_path):
    dst = maker.copy_gguf(path_of("qwen3-bf16"), str(tmp_path / "falcon.gguf"), arch="falcon")[0]
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'") as e:
        read_gguf(dst, progress=False)
    assert dst in str(e.value)

    def iq4(t):     # one matrix stored in a type the kernels lack (IQ4_NL: 32 values, 18 bytes)
        if t.name == "blk.1.attn_v.weight":
            k, n = (int(d) for d in t.shape)
            return np.zeros((n, k // 32 * 18), np.uint8), QT.IQ4_NL
        return t.data, t.tensor_type

    dst = maker.copy_gguf(path_of("qwen3-bf16"), str(tmp_path / "iq4.gguf"), iq4)[0]
    with pytest.raises(ValueError, match="blk.1.attn_v.weight has type IQ4_NL") as e:
        read_gguf(dst, progress=False)
    assert dst in str(e.value)


# ---- model level: greedy tokens of the Llama graph on GGUF weights

class PagedRun:
    """One sequence through the model's paged-KV forward: `step(tokens)` feeds the tokens after
    the ones already computed and returns the logits of the last one."""

    def __init__(self, config: dict, weights: dict, max_tokens: int, block: int = 16,
                 kernels=None, num_threads: int | None = None):
        from engine.models.registry import get_model_class
        from pyx.cpu_backend import CpuBackend
        mc = ModelConfig.from_dict(config)
        backend = CpuBackend(kernels=kernels, num_threads=num_threads)
        self.model = get_model_class(mc.architecture)(mc, weights, backend)
        self.block, num_blocks = block, -(-max_tokens // block)
        if mc.linear_attention is not None:     # hybrid: the linear layers' state in row 0
            self.kv = self.model.allocate_caches(num_blocks + 1, block, np.float32, 1)
        else:
            shape = self.model.kv_cache_shape(num_blocks + 1, block)
            self.kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
                       for _ in range(self.model.num_layers)]
        self.hybrid = mc.linear_attention is not None
        self.table = np.arange(num_blocks, 0, -1, dtype=np.int32)[None]     # block 0 unused
        self.seq: list[int] = []

    def step(self, tokens: list[int]) -> np.ndarray:
        from engine.runner.forward_batch import ForwardBatch
        done, block = len(self.seq), self.block
        self.seq += tokens
        pos = np.arange(done, len(self.seq), dtype=np.int32)
        batch = ForwardBatch(
            token_ids=np.array(tokens, np.int32), positions=pos,
            slot_mapping=(self.table[0, pos // block] * block + pos % block).astype(np.int32),
            query_start_loc=np.array([0, len(pos)], np.int32),
            seq_lens=np.array([len(self.seq)], np.int32), block_tables=self.table,
            logits_indices=np.array([len(pos) - 1], np.int32))
        if self.hybrid:
            from engine.core.hybrid_state import StatePlan
            batch.state_plan = StatePlan(np.array([0, len(pos)]), np.array([0]), np.array([0]),
                                         np.array([done == 0]))
        return self.model.forward(batch, self.kv)[0].copy()


def greedy(config: dict, weights: dict, prompt: list[int], n: int):
    """(tokens, first step's logits): prefill, then one token per step."""
    run = PagedRun(config, weights, len(prompt) + n)
    first = run.step(list(prompt))
    out = [int(np.argmax(first))]
    while len(out) < n:
        out.append(int(np.argmax(run.step([out[-1]]))))
    return out, first


@pytest.mark.parametrize("stem", FLOAT_FILES)
def test_float_gguf_greedy_matches_transformers(stem):
    name = FILES[stem][0]
    m = FIX["models"][name]
    ref = m["transformers"]
    n = trusted(ref["margins"], TIE)
    assert n >= 8, f"{name}: transformers near-tie at step {n}; change the seed"
    assert len(m["prompt_ids"]) > 128     # past llama3's (64) and yarn's (128) original context
    ck = read_gguf(path_of(stem), progress=False)
    tokens, first = greedy(ck.config, ck.weights, m["prompt_ids"], n)
    ref_first = np.array(ref["first_logits"])
    np.testing.assert_allclose(first, ref_first, rtol=0,
                               atol=1e-4 * max(1.0, np.abs(ref_first).max()))
    assert tokens == ref["tokens"][:n]


def test_permuted_qk_changes_the_tokens():
    """The un-permute matters at model level too: the file's raw q/k rows give other tokens."""
    m = FIX["models"]["llama"]
    ck = read_gguf(path_of("llama-f32"), progress=False)
    raw = {t.name: t.data for t in reader("llama-f32").tensors}
    for i in range(2):
        for p in "qk":
            name = f"model.layers.{i}.self_attn.{p}_proj.weight"
            ck.weights[name] = raw[f"blk.{i}.attn_{p}.weight"]
    n = trusted(m["transformers"]["margins"], TIE)
    assert greedy(ck.config, ck.weights, m["prompt_ids"], n)[0] != m["transformers"]["tokens"][:n]


@pytest.mark.parametrize("stem", QUANT_FILES)
def test_quantized_gguf_greedy_matches_llama_cpp(stem):
    """Taper on the packed blocks against llama.cpp on the same file (f32 KV cache). llama.cpp
    and Taper each round activations to 8 bits once, which moves their logits from float64 on the
    same weights by a few hundredths (first step, max: llama.cpp 0.028 for Q8_0, 0.037 for
    Q4_K_M), so they differ by about as much. Comparison stops where llama.cpp's top two are
    within 0.05."""
    name, kind = FILES[stem]
    types = {QT[t] for t in FIX["models"][name]["files"][kind]["tensor_types"].values()} - {QT.F32}
    lacking = sorted(t.name for t in types if _pyx_dequantize(t) is None)
    if lacking:
        pytest.skip(f"the CPU backend does not compute on {lacking} yet")
    m = FIX["models"][name]
    ref = m["files"][kind]["llama_cpp"]
    n = trusted(ref["margins"], QUANT_TIE)
    assert n >= 8, f"{stem}: llama.cpp near-tie at step {n}; change the seed"
    ck = read_gguf(path_of(stem), progress=False)
    tokens, first = greedy(ck.config, ck.weights, m["prompt_ids"], n)
    ref_first = np.array(ref["first_logits"])
    np.testing.assert_allclose(first, ref_first, rtol=0, atol=QUANT_TIE)
    assert tokens == ref["tokens"][:n]
    if kind == "q4_k_m":    # 4-bit weights move the logits well past the tolerance
        float_first = np.array(m["transformers"]["first_logits"])
        assert np.abs(ref_first - float_first).max() > 4 * QUANT_TIE


def float64_logits(stem: str, tokens: list[int]) -> np.ndarray:
    """transformers in float64 on the file's own weights, dequantized by gguf-py: the exact
    value of what the quantized file describes. Logits at every position of `tokens`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    name = FILES[stem][0]
    config = AutoConfig.from_pretrained(os.path.join(DATA, f"{name}-source"))
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    state = {}
    for key, w in checkpoint(stem).weights.items():
        if isinstance(w, QuantizedWeight):
            w = np.concatenate([quants.dequantize(b, QT(t)).reshape(b.shape[0], w.k)
                                for t, b in w.quant_parts])
        state[key] = torch.from_numpy(np.asarray(w, np.float64))
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


QUANT_SPLIT_TOL = 1e-3     # measured max 1.9e-4 (Q4_K_M), 1.4e-4 (Q8_0)


@pytest.mark.parametrize("stem", QUANT_FILES)
def test_quantized_decode_logits_against_float64_on_the_file_weights(stem):
    """Taper's matmuls on the packed blocks with T <= quant_gemv_max_t(type, isa) token rows
    (decode) against the exact reference, teacher-forced: an 8-token prompt, then one prompt
    token per step. By default they round each activation row to 8 bits once, as llama.cpp does: the
    logits are 0.03-0.05 off float64. With kernels act_split=on each row is two 8-bit rows
    (pyx/quant_kernels.c): every step within QUANT_SPLIT_TOL.
    After the whole prompt (a float32 prefill, then the LM head on one row) Taper's default is
    no further off than llama.cpp's own first-step logits (fixtures.json), and with the split
    over 20x closer."""
    name, kind = FILES[stem]
    types = {QT[t] for t in FIX["models"][name]["files"][kind]["tensor_types"].values()} - {QT.F32}
    if any(_pyx_dequantize(t) is None for t in types):
        pytest.skip("the CPU backend does not compute on this file's types yet")
    prompt = FIX["models"][name]["prompt_ids"]
    tokens, p = prompt[:40], 8
    ref = float64_logits(stem, tokens)[p - 1:-1]
    full = float64_logits(stem, prompt)[-1]
    llama_err = np.abs(np.array(FIX["models"][name]["files"][kind]["llama_cpp"]["first_logits"])
                       - full).max()

    def run(tokens, kernels=None):
        return PagedRun(checkpoint(stem).config, dict(checkpoint(stem).weights), len(tokens),
                        kernels=kernels)

    def decode(tokens, kernels=None):
        r = run(tokens, kernels)
        return np.stack([r.step(tokens[:p])] + [r.step([t]) for t in tokens[p:-1]])

    assert np.abs(decode(tokens) - ref).max() > 10 * QUANT_SPLIT_TOL
    assert np.abs(run(prompt).step(list(prompt)) - full).max() <= llama_err
    split = "act_split=on"
    assert np.abs(decode(tokens, split) - ref).max() < QUANT_SPLIT_TOL
    assert (np.abs(run(prompt, split).step(list(prompt)) - full).max()
            < QUANT_SPLIT_TOL < llama_err / 20)


@pytest.mark.parametrize("stem", ["llama-f32", "qwen2-q4_k_m"])
def test_llm_generates_from_a_gguf_file(stem):
    """The whole engine (LLM with weight_file): the file's own tokenizer encodes the prompt text,
    greedy tokens as above."""
    from engine import LLM, SamplingParams
    name, kind = FILES[stem]
    m = FIX["models"][name]
    if kind == "f32":
        ref, tie = m["transformers"], TIE
    else:
        ref, tie = m["files"][kind]["llama_cpp"], QUANT_TIE
        types = {QT[t] for t in m["files"][kind]["tensor_types"].values()} - {QT.F32}
        if any(_pyx_dequantize(t) is None for t in types):
            pytest.skip("the CPU backend does not compute on this file's types yet")
    n = trusted(ref["margins"], tie)
    llm = LLM(DATA, weight_file=f"{stem}.gguf", num_kv_blocks=64)
    assert llm.engine.tokenizer.encode(FIX["prompt"]) == m["prompt_ids"]
    out = llm.generate([FIX["prompt"]], SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True))[0]
    assert list(out.token_ids) == ref["tokens"][:n]
    assert out.text     # decoded by the file's tokenizer (random tokens: byte soup)

"""GGUF for Gemma-2, Gemma-3 (text), Phi-3, GLM-4 and StableLM (with StableLM-2 12B's per-head
q/k LayerNorm) (engine/loader/gguf_dense.py) on
files llama.cpp's own converter wrote (tests/data/make_gguf_dense_fixtures.py): each family's
metadata keys, tensor names and the converter's weight transforms, and the file's tokenizer.

The reference, recorded in tests/data/gguf/dense_fixtures.json, is transformers on the weights
each file holds (gguf-py's dequantization of every tensor, put back in the source model), and on
the source checkpoint itself. Each family's quirk test shows the tokens or logits move far past
the tolerance when the quirk's metadata is ignored.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf import GGUFReader

from engine.loader.gguf import read_gguf
from engine.models.model_config import ModelConfig
from server_fakes import LiveServer, client_for, post_json
from gguf_fixtures import (DATA, HERE, QUANT_TIE, RecordedFixtures, load_script, path_of,
                           source_config, trusted)
from test_gguf import greedy, maker

RECORDED = RecordedFixtures("dense_fixtures.json", min_trusted_steps=8)
FIX, FILES = RECORDED.fix, RECORDED.files
FLOAT_FILES, QUANT_FILES = RECORDED.float_files, RECORDED.quant_files
reference, atol = RECORDED.reference, RECORDED.atol
ARCH = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
        "glm4": "Glm4ForCausalLM", "stablelm": "StableLmForCausalLM",
        "stablelm_qk": "StableLmForCausalLM"}


def first_logits(ck, stem: str) -> np.ndarray:
    name, _ = FILES[stem]
    return greedy(ck.config, ck.weights, FIX["models"][name]["prompt_ids"], 1)[1]


def test_fixtures_are_the_recorded_files():
    assert set(ARCH) == set(FIX["models"])
    for stem, (name, kind) in FILES.items():
        entry = FIX["models"][name]["files"][kind]
        assert entry["file"] == f"{stem}.gguf" and entry["bytes"] == os.path.getsize(path_of(stem))
        assert entry["sha256"] == maker.sha256_file(path_of(stem))


@pytest.mark.parametrize("stem", list(FILES))
def test_config_matches_the_source_config(stem):
    """What llama.cpp's keys give equals what transformers' config.json says, quirk by quirk."""
    name, _ = FILES[stem]
    ours = ModelConfig.from_dict(read_gguf(path_of(stem), progress=False).config)
    src = source_config(name)
    assert ours.architecture == src.architecture == ARCH[name]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "qkv_bias",
                "o_bias", "qk_norm", "sliding_windows", "hidden_act", "query_pre_attn_scalar",
                "attn_softcap", "final_softcap", "parallel_residual", "max_position_embeddings"):
        assert getattr(ours, key) == getattr(src, key), key
    assert ours.rms_norm_eps == pytest.approx(src.rms_norm_eps, rel=1e-6)
    for mine, theirs in ((ours.rope, src.rope), (ours.local_rope, src.local_rope)):
        if theirs is None:
            assert mine is None
            continue
        for key in ("rope_type", "theta", "rot_dim", "factor", "is_neox",
                    "original_max_position_embeddings"):
            assert getattr(mine, key) == getattr(theirs, key), key
        np.testing.assert_allclose(mine.short_factor, theirs.short_factor, rtol=1e-6)
        np.testing.assert_allclose(mine.long_factor, theirs.long_factor, rtol=1e-6)


def test_float_weights_equal_the_source_checkpoint():
    """gemma2-f32 holds the source weights (rebuilt by transformers here) with 1 added to every
    norm; subtracting it again gives the source values to the float32 rounding of w + 1, and
    adding it back (the Gemma graph) gives exactly the file's values."""
    import transformers

    with open(os.path.join(DATA, "gemma2-source", "config.json")) as f:
        cfg = transformers.Gemma2Config(**{k: v for k, v in json.load(f).items()
                                           if k not in ("architectures", "transformers_version")})
    dense_maker = load_script(os.path.join(HERE, "data", "make_gguf_dense_fixtures.py"))
    model = dense_maker.source_model("gemma2", cfg)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    ck = read_gguf(path_of("gemma2-f32"), progress=False)
    raw = {t.name: np.asarray(t.data) for t in GGUFReader(path_of("gemma2-f32")).tensors}
    assert set(ck.weights) == set(state) - {"lm_head.weight"}     # tied: the converter drops it
    for k, w in ck.weights.items():
        if k.endswith("norm.weight"):
            np.testing.assert_allclose(w, state[k], rtol=0, atol=2e-7, err_msg=k)
            np.testing.assert_array_equal(w + np.float32(1), state[k] + np.float32(1))
        else:
            np.testing.assert_array_equal(w, state[k], err_msg=k)
    np.testing.assert_array_equal(ck.weights["model.norm.weight"] + np.float32(1),
                                  raw["output_norm.weight"])


@pytest.mark.parametrize("stem", FLOAT_FILES + QUANT_FILES)
def test_gguf_greedy_matches_transformers_on_the_file_weights(stem):
    name, kind = FILES[stem]
    ref = RECORDED.assert_greedy_matches_reference(stem)
    if kind == "f32":       # the file's weights are the source's: the same tokens
        assert ref["tokens"] == FIX["models"][name]["transformers"]["tokens"]


LLAMA_CPP_FILES = [s for s, (n, k) in FILES.items()
                   if "llama_cpp" in FIX["models"][n]["files"][k]]


@pytest.mark.parametrize("stem", LLAMA_CPP_FILES)
def test_gguf_greedy_matches_llama_cpp(stem):
    """llama.cpp's own run of the file (recorded by the fixture maker, f32 KV cache) reads the
    same model from it: Taper's greedy tokens equal llama.cpp's until llama.cpp's top two come
    within 0.05 (its arithmetic differs from float32 transformers by up to ~0.02 here), and
    the first-step logits agree to that."""
    name, kind = FILES[stem]
    m = FIX["models"][name]
    ref = m["files"][kind]["llama_cpp"]
    n = max(1, trusted(ref["margins"], QUANT_TIE))
    ck = read_gguf(path_of(stem), progress=False)
    tokens, first = greedy(ck.config, ck.weights, m["prompt_ids"], max(n, 8))
    assert tokens[:n] == ref["tokens"][:n]
    np.testing.assert_allclose(first, ref["first_logits"], rtol=0, atol=QUANT_TIE)


def test_llama_cpp_covers_the_families():
    assert {FILES[s][0] for s in LLAMA_CPP_FILES} == set(ARCH)
    assert set(TOKENIZE_MODELS) == set(ARCH)


TOKENIZE_MODELS = [n for n, m in FIX["models"].items() if "llama_cpp_tokenize" in m]


@pytest.mark.parametrize("name", TOKENIZE_MODELS)
def test_tokenizer_matches_llama_cpp(name):
    """The file's tokenizer splits text as llama.cpp does (special tokens parsed), with and
    without BOS: Gemma's SentencePiece without a space prefix, GLM-4's and StableLM's byte-level
    BPE, and Phi-3's special tokens taking the whitespace after them (llama.cpp's rule for files
    named Phi-3)."""
    m = FIX["models"][name]
    stem = f"{name}-{next(iter(m['files']))}"
    ours = read_gguf(path_of(stem), progress=False).tokenizer
    for r in m["llama_cpp_tokenize"]:
        for add, expected in ((True, r["ids"]), (False, r["ids_no_special"])):
            got = ours.encode(r["text"], add_special_tokens=add)
            assert got == expected, f"{r['text']!r} (add_special_tokens={add}): llama.cpp"


def test_phi3_rstrip_is_needed():
    """Without Phi-3's rstrip the whitespace after <|user|> and <|end|> becomes tokens, which
    llama.cpp does not make."""
    from engine.text import gguf_tokenizer
    from engine.loader.gguf import open_reader, read_metadata
    meta = read_metadata(open_reader(path_of("phi3-f16")))
    text = "<|user|>\n  hi there<|end|>\n<|assistant|>  ok</s>  x"
    want = next(r["ids"] for r in FIX["models"]["phi3"]["llama_cpp_tokenize"]
                if r["text"] == text)
    assert gguf_tokenizer.build_tokenizer(meta).encode(text) == want
    meta["general.name"] = "Some Model"
    assert gguf_tokenizer.build_tokenizer(meta).encode(text) != want


def _add_one_to_norms(ck):
    for k in ck.weights:
        if k.endswith("norm.weight"):
            ck.weights[k] = ck.weights[k] + np.float32(1)


def _set(**values):
    def mutate(ck):
        ck.config.update(values)
    return mutate


def _drop_longrope(ck):
    ck.config["rope_scaling"] = None


# (file, what is ignored, how): each must move the first-step logits far past the tolerance
QUIRKS = [
    ("gemma2-f32", "norms stored as 1 + w", _add_one_to_norms),
    ("gemma2-f32", "attn_logit_softcapping", _set(attn_logit_softcapping=None)),
    ("gemma2-f32", "final_logit_softcapping", _set(final_logit_softcapping=None)),
    ("gemma2-f32", "sliding_window (every layer full)",
     _set(layer_types=["full_attention"] * 2)),
    ("gemma2-f32", "the alternating pattern (every layer sliding)",
     _set(layer_types=["sliding_attention"] * 2)),
    ("gemma3-f16", "norms stored as 1 + w (q/k norms too)", _add_one_to_norms),
    ("gemma3-f16", "rope.freq_base_swa", _set(rope_local_base_freq=1_000_000.0)),
    ("gemma3-f16", "rope.scaling linear x8 (global layers)", _set(rope_scaling=None)),
    ("gemma3-f16", "the 5-local-1-global pattern (every layer sliding)",
     _set(layer_types=["sliding_attention"] * 6)),
    ("phi3-f16", "rope_factors_long/short", _drop_longrope),
    ("glm4-f16", "rope.dimension_count (partial rotary)", _set(partial_rotary_factor=1.0)),
    ("stablelm-f16", "use_parallel_residual", _set(use_parallel_residual=False)),
    ("stablelm-f16", "rope.dimension_count (partial rotary)", _set(partial_rotary_factor=1.0)),
    ("stablelm_qk-f16", "attn_q_norm/attn_k_norm (per-head LayerNorm)",
     _set(qk_layernorm=False)),
]


@pytest.mark.parametrize("stem,quirk,mutate", QUIRKS, ids=[f"{s}:{q}" for s, q, _ in QUIRKS])
def test_each_quirk_matters(stem, quirk, mutate):
    ref, _ = reference(stem)
    ref_first = np.array(ref["first_logits"])
    ck = read_gguf(path_of(stem), progress=False)
    if "use_parallel_residual" in quirk:    # its post-attention norm: the input norm's copy
        for i in range(ck.config["num_hidden_layers"]):
            for kind in ("weight", "bias"):
                ck.weights[f"model.layers.{i}.post_attention_layernorm.{kind}"] = \
                    ck.weights[f"model.layers.{i}.input_layernorm.{kind}"].copy()
    mutate(ck)
    first = first_logits(ck, stem)
    assert np.abs(first - ref_first).max() > 100 * atol(stem, ref_first), quirk


def test_glm4_rotates_interleaved_pairs_and_phi3_halves():
    """GLM-4's file keeps HF's interleaved-pair layout (no permutation for text models); the
    graph must rotate pairs (2i, 2i+1) there and halves for Phi-3."""
    for stem, neox in (("glm4-f16", False), ("phi3-f16", True)):
        mc = ModelConfig.from_dict(read_gguf(path_of(stem), progress=False).config)
        assert mc.rope.is_neox is neox


@pytest.mark.parametrize("stem", ["gemma2-f32", "gemma3-f16", "phi3-q8_0", "glm4-f16",
                                  "stablelm-f16"])
def test_llm_generates_from_the_gguf_file(stem):
    """The whole engine: the file's own tokenizer encodes the prompt text as the source tokenizer
    did; greedy tokens as above."""
    RECORDED.assert_llm_generates(stem)


def test_gemma_tokenizer_matches_sentencepiece():
    """Gemma's converter writes add_space_prefix false: no "▁" before the text, as the
    SentencePiece model (trained without a dummy prefix) encodes it."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(DATA, "gemma2-source",
                                                            "tokenizer.model"))
    tok = read_gguf(path_of("gemma2-f32"), progress=False).tokenizer
    texts = [t for t in maker.TOKENIZER_TEXTS if "<" not in t and "[" not in t]
    for text in texts:
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), text
    assert tok.encode("Hello")[1:] != [sp.piece_to_id("▁Hello")]


@pytest.mark.parametrize("stem", ["glm4-f16", "phi3-q8_0"])
def test_server_serves_the_gguf_file(tmp_path, stem):
    """`python -m server --w DIR --f FILE.gguf` with the official openai client: the reference
    tokens, as text the server's own detokenizer writes (special tokens kept, as /detokenize
    keeps them)."""
    name, _ = FILES[stem]
    m = FIX["models"][name]
    ref, n = reference(stem)
    server = LiveServer(tmp_path, DATA, "--f", f"{stem}.gguf", "--mem", "32")
    try:
        client = client_for(server.port)
        assert [x.id for x in client.models.list()] == [stem]
        out = client.completions.create(model=stem, prompt=m["prompt_ids"], max_tokens=n,
                                        temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "skip_special_tokens": False})
        status, text = post_json(server.port, "/detokenize", {"tokens": ref["tokens"][:n]})
        assert status == 200
        assert out.choices[0].text == text["prompt"]
        assert out.usage.completion_tokens == n
    finally:
        server.close()


def test_merges_outside_the_vocabulary_name_the_file(tmp_path):
    """A GGUF whose tokenizer.ggml.merges names a piece the vocabulary lacks: a ValueError naming
    the file, the merge and the piece (not the tokenizers library's bare Exception or panic)."""
    src = path_of("stablelm-f16")
    merges = list(GGUFReader(src).fields["tokenizer.ggml.merges"].contents())
    for i, bad, missing in ((3, "Ġt zzqq", "zzqq"), (0, None, None)):
        if bad is None:     # both parts are tokens, their join is not
            left, right = merges[0].split(" ")
            bad, missing = f"{left} {right}{right}{right}", f"{right}{right}{right}"
        corrupt = merges[:i] + [bad] + merges[i + 1:]
        dst = maker.copy_gguf(src, str(tmp_path / f"bad{i}.gguf"),
                              overrides={"tokenizer.ggml.merges": corrupt})[0]
        with pytest.raises(ValueError) as e:
            read_gguf(dst, progress=False)
        msg = str(e.value)
        assert dst in msg and f"tokenizer.ggml.merges[{i}]" in msg and repr(missing) in msg, msg


@pytest.mark.parametrize("arch,meta,tensors,match", [
    ("glm4", {"rope.dimension_sections": [8, 12, 12, 0]}, {}, "M-RoPE"),
    ("phi3", {"rope.scaling.original_context_length": 64}, {"rope_factors_long.weight": object()},
     "rope_factors_short"),
    ("gemma3", {"attention.sliding_window": 16, "attention.sliding_window_pattern": [1, 0, 1]},
     {}, "3 entries for 2 layers"),
    ("gemma2", {"rope.freq_base_swa": 5.0}, {}, "one RoPE base"),
    ("stablelm", {}, {}, "layer_norm_epsilon"),
])
def test_family_refusals_name_the_file_and_key(arch, meta, tensors, match):
    from engine.loader.gguf import _Meta
    from engine.loader.gguf_dense import family_config
    config = {"head_dim": 64, "num_hidden_layers": 2, "hidden_size": 256,
              "num_attention_heads": 4, "rope_theta": 10000.0, "rope_scaling": None}
    with pytest.raises(ValueError, match=match) as e:
        family_config("x.gguf", _Meta("x.gguf", {f"{arch}.{k}": v for k, v in meta.items()}, arch),
                      tensors, config, 64)
    assert "x.gguf" in str(e.value)

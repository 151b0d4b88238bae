"""Make the GGUF fixtures of the dense families of issue 16 in tests/data/gguf/ with llama.cpp's
own converter: Gemma-2, Gemma-3 (text), Phi-3, GLM-4 and StableLM.

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python tests/data/make_gguf_dense_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

As tests/data/make_gguf_moe_fixtures.py (whose machinery this reuses): transformers writes a
random checkpoint per family with the family's quirks switched on, convert_hf_to_gguf.py turns it
into GGUF (float, and for Phi-3 also the converter's own Q8_0, so no built llama.cpp is needed),
and the reference is transformers on the weights each file holds: every tensor dequantized by
gguf-py and put back in place of the source parameter it came from, undoing what the converter
did to it (Gemma's norms stored as 1 + w, fused tensors), each checked to be close to the source
(so the mapping below is right). transformers also records its greedy data on the source
checkpoint itself. All of it goes to tests/data/gguf/dense_fixtures.json; the source tokenizer
files and config.json are committed under tests/data/gguf/<name>-source/.

The configurations are ones llama.cpp reads back as transformers runs them: where llama.cpp
derives a setting instead of reading it from the file (Gemma's attention scale from head_dim,
Gemma-2's alternating and Gemma-3's 5-local-1-global layer pattern, StableLM's RoPE base), the
source config holds that value. Gemma-2's converter drops lm_head, so its embeddings are tied.

When llama-cpp-python is installed, llama.cpp's own greedy tokens, top-two margins and first-step
logits (f32 KV cache) on each file are recorded too (`llama_cpp`; `llama_cpp_error` where
llama.cpp cannot load the file); `--llama-cpp-greedy-only` adds just those to an existing
dense_fixtures.json. The tests never import llama_cpp.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "gguf")
FIXTURES_JSON = os.path.join(OUT_DIR, "dense_fixtures.json")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


maker = _load("make_gguf_fixtures")
moe_maker = _load("make_gguf_moe_fixtures")

# DESIGN.md's tiny-256 shape (hidden 256, 4 heads of 64, 2 KV heads, 2 layers, vocab 512).
TINY_256 = dict(maker.TINY_256, vocab_size=512, max_position_embeddings=512)
# Gemma-3 needs 6 layers for one global layer (llama.cpp's fixed pattern), so it is narrower.
SMALL_6 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)

MODELS = {
    # (1 + w) norms stored with the 1 added, both soft-caps, a sliding window (16) shorter than
    # the prompt on even layers, query_pre_attn_scalar = head_dim (llama.cpp's rule below 27B).
    # Tied: with embeddings ~ N(0, 0.15^2) x sqrt(hidden) the head mostly repeats the last
    # token, so they are ~ N(0, 0.02^2) and the projections x4.
    "gemma2": dict(config="Gemma2Config", tokenizer="sentencepiece-gemma", outtypes=("f32",),
                   seed=0, scale=4.0, embed_std=0.02,
                   kwargs=dict(TINY_256, rms_norm_eps=1e-6, sliding_window=16,
                               query_pre_attn_scalar=64, attn_logit_softcapping=10.0,
                               final_logit_softcapping=10.0, tie_word_embeddings=True,
                               bos_token_id=1, eos_token_id=2, pad_token_id=None)),
    # q/k norms (1 + w), layers 0-4 local (window 16, RoPE base 1e4) and layer 5 global (base
    # 1e6, linear scaling x8), untied lm_head; stored F16.
    "gemma3": dict(config="Gemma3TextConfig", tokenizer="sentencepiece-gemma",
                   outtypes=("f16",), seed=0, scale=2.0,
                   kwargs=dict(SMALL_6, rms_norm_eps=1e-6, sliding_window=16,
                               query_pre_attn_scalar=32, tie_word_embeddings=False,
                               layer_types=["sliding_attention"] * 5 + ["full_attention"],
                               rope_parameters={
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10_000.0}},
                               bos_token_id=1, eos_token_id=2, pad_token_id=None)),
    # fused qkv and gate_up, LongRoPE (original context 64, under the prompt) with partial rotary
    # 0.75 (Phi-4-mini's), so the converter writes rope_factors_long/short of 24 entries; F16
    # and the converter's Q8_0.
    "phi3": dict(config="Phi3Config", tokenizer="sentencepiece-phi3", outtypes=("f16", "q8_0"),
                 seed=0, scale=2.0,
                 kwargs=dict(TINY_256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                             original_max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                             pad_token_id=None,
                             rope_parameters={
                                 "rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0 + 0.03 * i for i in range(24)],
                                 "long_factor": [1.0 + 0.4 * i for i in range(24)]})),
    # q/k/v bias, half of each head rotated in interleaved pairs, post-norms, fused gate_up
    # (the converter needs <|endoftext|> and <|user|> among the added tokens)
    # (seed 1, x8: 15 different tokens in 16 steps; at x2 and x4 it repeats one token)
    "glm4": dict(config="Glm4Config", tokenizer="bytelevel-glm", outtypes=("f16",), seed=1,
                 scale=8.0,
                 kwargs=dict(TINY_256, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
                             attention_bias=True, tie_word_embeddings=False,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None)),
    # LayerNorm with bias, a quarter of each head rotated, q/k/v bias, parallel residual
    "stablelm": dict(config="StableLmConfig", tokenizer="bytelevel", outtypes=("f16",), seed=1,
                     scale=8.0,
                     kwargs=dict(TINY_256, layer_norm_eps=1e-5, use_qkv_bias=True,
                                 partial_rotary_factor=0.25, use_parallel_residual=True,
                                 tie_word_embeddings=False, bos_token_id=None,
                                 eos_token_id=None)),
    # StableLM-2 12B's layout: a LayerNorm per q and k head (stacked by the converter as
    # attn_q_norm/attn_k_norm, heads x head_dim), parallel residual, no qkv bias; narrower
    "stablelm_qk": dict(config="StableLmConfig", tokenizer="bytelevel", outtypes=("f16",),
                        seed=1, scale=8.0,
                        kwargs=dict(SMALL_6, num_hidden_layers=2, layer_norm_eps=1e-5,
                                    use_qkv_bias=False, qk_layernorm=True,
                                    partial_rotary_factor=0.25, use_parallel_residual=True,
                                    tie_word_embeddings=False, bos_token_id=None,
                                    eos_token_id=None)),
}
NEW_TOKENS = 24


def source_config(name: str, token_ids: dict | None = None):
    return maker.source_config(name, token_ids, MODELS)


def source_model(name: str, config=None):
    """The transformers model of `name` with its scaled random weights (deterministic on CPU)."""
    return maker.source_model(name, config, MODELS)


# llama-cpp-python 0.3.36's StableLMModel.modify_tensors returns the generator of its stacked
# per-head q/k norms from inside a generator, so they are never written and the converter stops
# ("Unprocessed norms"); the patch iterates that generator as the code means to (and as earlier
# converters, which wrote StableLM-2 12B's files, did). Nothing else changes.
STABLELM_QK_PATCH = """
from conversion.stablelm import StableLMModel
_modify_tensors = StableLMModel.modify_tensors
def _modify_stacking(self, data_torch, name, bid):
    stacked = yield from _modify_tensors(self, data_torch, name, bid)
    if stacked is not None:
        yield from stacked
StableLMModel.modify_tensors = _modify_stacking
"""


def convert(llama_cpp_src: str, src_dir: str, out_path: str, outtype: str) -> None:
    import subprocess
    import sys

    code = maker.CONVERT_WRAPPER.format(src=llama_cpp_src).replace(
        "convert.main()", STABLELM_QK_PATCH + "convert.main()")
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)      # use the gguf-py that ships with the converter
    subprocess.run([sys.executable, "-c", code, "--outtype", outtype, "--outfile", out_path,
                    src_dir], check=True, env=env, cwd=llama_cpp_src)


def build_tokenizer(kind: str, directory: str) -> dict:
    if kind == "bytelevel":
        return maker.build_bytelevel_tokenizer(directory)
    if kind == "bytelevel-glm":
        return maker.build_bytelevel_tokenizer(directory, extra_special=("<|user|>",))
    if kind == "sentencepiece-gemma":
        return maker.build_sentencepiece_tokenizer(directory, add_dummy_prefix=False)
    if kind == "sentencepiece-phi3":
        return build_phi3_tokenizer(directory)
    return maker.build_sentencepiece_tokenizer(directory)


PHI3_SPECIAL = ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>")
# Text whose tokenization shows how special tokens take the whitespace after them (llama.cpp
# strips it after Phi-3's special tokens, except <unk> <s> <|endoftext|>, and after </s>).
SPECIAL_TEXTS = ["<|user|>\n  hi there<|end|>\n<|assistant|>  ok</s>  x",
                 "<|endoftext|>  a [INST]  b [/INST]\n c", "<s>  d<unk>  e"]


def build_phi3_tokenizer(directory: str) -> dict:
    """The SentencePiece vocabulary with Phi-3's added special tokens after it (ids 480-483, in
    tokenizer_config.json's added_tokens_decoder, where Phi-3's converter reads them; llama.cpp
    needs <|endoftext|> in a file it names Phi-3)."""
    ids = maker.build_sentencepiece_tokenizer(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    first = 480
    for i, text in enumerate(PHI3_SPECIAL):
        config["added_tokens_decoder"][str(first + i)] = dict(
            content=text, lstrip=False, rstrip=False, normalized=False, single_word=False,
            special=True)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return ids


# GGUF tensor (per layer) -> transformers parameter, per family where it differs from the
# llama-style names of make_gguf_moe_fixtures.py.
_SANDWICH = {"post_attention_norm.weight": "post_attention_layernorm.weight",
             "ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_LAYER = {
    "gemma2": _SANDWICH, "gemma3": _SANDWICH,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "glm4": {"post_attention_norm.weight": "post_self_attn_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_mlp_layernorm.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "stablelm": {"attn_norm.bias": "input_layernorm.bias",
                 "ffn_norm.bias": "post_attention_layernorm.bias"},
}
_COMMON = {**moe_maker._LAYER, "attn_output.bias": "self_attn.o_proj.bias",
           "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
           "ffn_down.weight": "mlp.down_proj.weight"}
_GLOBAL = {**moe_maker._GLOBAL, "output_norm.bias": "model.norm.bias"}
_GEMMA_ARCHS = ("gemma2", "gemma3")


def file_weights(path: str, model) -> dict:
    """{transformers parameter: the file's values} for every parameter of `model`, dequantized
    by gguf-py, with the converter's transforms undone; each checked to be close to the source."""
    import numpy as np
    from gguf import GGUFReader, quants

    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    out = {}
    for t in r.tensors:
        if t.name.startswith("rope_factors_"):
            continue                    # LongRoPE settings, compared with the config below
        arr = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32) \
            .reshape([int(d) for d in reversed(t.shape.tolist())])
        if arch in _GEMMA_ARCHS and t.name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)   # Gemma*Model.modify_tensors stored 1 + w
        if t.name in _GLOBAL:
            out[_GLOBAL[t.name]] = arr
            continue
        _, layer, rest = t.name.split(".", 2)
        if arch == "stablelm" and rest in ("attn_q_norm.weight", "attn_k_norm.weight"):
            for h, row in enumerate(arr):       # StableLMModel._stack_qk_norm, undone
                out[f"model.layers.{layer}.self_attn.{rest[5]}_layernorm.norms.{h}.weight"] = row
            continue
        hf = _LAYER[arch].get(rest) or _COMMON[rest]
        out[f"model.layers.{layer}.{hf}"] = arr
    return maker.checked_against_source(out, model, path)


def reference(model, path: str, prompt_ids: list[int]) -> dict:
    """transformers' greedy data on the weights the GGUF file holds."""
    return maker.transformers_greedy_on(model, file_weights(path, model), prompt_ids, NEW_TOKENS)


def record_llama_cpp(record: dict) -> None:
    """In place: llama.cpp's greedy data on every file of `record` (needs llama_cpp)."""
    for entry in record["models"].values():
        first = os.path.join(OUT_DIR, next(iter(entry["files"].values()))["file"])
        try:
            entry["llama_cpp_tokenize"] = maker.llama_cpp_tokenize(
                first, maker.TOKENIZER_TEXTS + SPECIAL_TEXTS)
        except ValueError:
            entry.pop("llama_cpp_tokenize", None)
        for f in entry["files"].values():
            path = os.path.join(OUT_DIR, f["file"])
            f.pop("llama_cpp", None)
            f.pop("llama_cpp_error", None)
            try:
                f["llama_cpp"] = maker.llama_cpp_greedy(path, entry["prompt_ids"], NEW_TOKENS)
            except ValueError as e:     # llama_cpp's "Failed to load model from file"
                f["llama_cpp_error"] = str(e).replace(OUT_DIR + os.sep, "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True,
                        help="llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python "
                             "sdist)")
    parser.add_argument("--only", nargs="*", help="remake only these models (others are kept)")
    parser.add_argument("--llama-cpp-greedy-only", action="store_true",
                        help="only record llama.cpp's greedy data in dense_fixtures.json")
    args = parser.parse_args()
    if args.llama_cpp_greedy_only:
        import importlib.metadata as md
        with open(FIXTURES_JSON) as f:
            record = json.load(f)
        record["versions"]["llama_cpp_python"] = md.version("llama_cpp_python")
        record_llama_cpp(record)
        with open(FIXTURES_JSON, "w") as f:
            json.dump(record, f, indent=1, ensure_ascii=False)
        return
    src_root = tempfile.mkdtemp(prefix="gguf-dense-src-")
    from transformers import AutoModelForCausalLM

    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("transformers", "torch", "tokenizers",
                                           "sentencepiece", "gguf", "numpy")}
    versions["converter"] = "llama-cpp-python 0.3.36 sdist: vendor/llama.cpp/convert_hf_to_gguf.py"
    record = dict(versions=versions, prompt=maker.PROMPT, new_tokens=NEW_TOKENS, models={})
    if args.only and os.path.isfile(FIXTURES_JSON):
        with open(FIXTURES_JSON) as f:
            record["models"] = json.load(f)["models"]
    for name, spec in MODELS.items():
        if args.only and name not in args.only:
            continue
        src = os.path.join(src_root, name)
        os.makedirs(src)
        ids = build_tokenizer(spec["tokenizer"], src)
        model = source_model(name, source_config(name, ids))
        model.generation_config.eos_token_id = ids["generation_eos"]
        model.generation_config.bos_token_id = ids["bos_token_id"]
        model.save_pretrained(src)
        maker.commit_source(name, src)
        prompt_ids = maker.prompt_ids_of(src, spec["tokenizer"].startswith("bytelevel"))
        source = AutoModelForCausalLM.from_pretrained(src, dtype="float32").eval()
        entry = dict(prompt_ids=prompt_ids, files={},
                     transformers=maker.transformers_greedy(source, prompt_ids, NEW_TOKENS))
        for outtype in spec["outtypes"]:
            path = os.path.join(OUT_DIR, f"{name}-{outtype}.gguf")
            convert(args.llama_cpp, src, path, outtype)
            entry["files"][outtype] = dict(
                file=os.path.basename(path), bytes=os.path.getsize(path),
                sha256=maker.sha256_file(path), tensor_types=maker.gguf_tensor_types(path),
                transformers=reference(source, path, prompt_ids))
        record["models"][name] = entry
        print(f"{name}: " + ", ".join(f"{k} {v['bytes'] / 1e6:.2f} MB"
                                      for k, v in entry["files"].items()))
    if importlib.util.find_spec("llama_cpp") is not None:
        record["versions"]["llama_cpp_python"] = md.version("llama_cpp_python")
        record_llama_cpp(record)
    with open(FIXTURES_JSON, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
    shutil.rmtree(src_root)


if __name__ == "__main__":
    main()

"""Make the GGUF fixtures in tests/data/gguf/ with llama.cpp's own converter and quantizer.

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python tests/data/make_gguf_fixtures.py \
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

For each model below: a tokenizer is built offline (a byte-level BPE trained with `tokenizers`,
or a SentencePiece BPE trained with `sentencepiece`), transformers writes a random checkpoint
(`from_config` + `save_pretrained`, weights scaled up as in tests/checkpoints.py), llama.cpp's
convert_hf_to_gguf.py (with its own gguf-py) turns it into GGUF, and llama.cpp's quantizer
(llama_cpp.llama_model_quantize, from the installed llama-cpp-python) makes the quantized files.

The byte-level tokenizer is a toy, so the converter cannot recognise its pre-tokenizer from the
hash of its output on llama.cpp's check text (that hash depends on the whole vocabulary); we tell
it "qwen2", the regex the toy was built with, by replacing `get_vocab_base_pre` in the converter
process. Everything else runs unchanged.

Then llama_cpp records, per file, its greedy tokens for a fixed prompt with the top-two logit
margin per step and the first step's logits (f32 KV cache), and its tokenization of the
tokenizer test texts (for qwen2 also under other tokenizer.ggml.pre names); transformers records
the same greedy data for the source checkpoint. All of it goes to tests/data/gguf/fixtures.json.
Reruns reproduce every file byte for byte (checked with the versions recorded there).

The source checkpoints are not committed: tests rebuild the weights with `source_model()`
(deterministic on CPU) and check them against the sha256 recorded here. The source tokenizer
files and config.json are committed under tests/data/gguf/<name>-source/.

Only this script imports llama_cpp; the test suite never does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "gguf")
FIXTURES_JSON = os.path.join(OUT_DIR, "fixtures.json")

# DESIGN.md's tiny-256 shape (K-quants need rows that are multiples of 256), 2 layers.
TINY_256 = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)

MODELS = {
    # Byte-level BPE ("gpt2" in GGUF, pre-tokenizer "qwen2"), qkv bias, untied lm_head, vocab
    # padded past the tokenizer like real Qwen2 files; F32 plus two llama.cpp quantizations.
    # Weights scaled x2, not x8: at x8 the random model amplifies 8-bit activation rounding into
    # logit changes of ~0.3, so no two quantized engines agree for long (tests/test_isq.py saw
    # the same). Seed 3: llama.cpp's top two stay >= 0.05 apart for all 24 steps on both files.
    "qwen2": dict(config="Qwen2Config", tokenizer="bytelevel", outtype="f32", seed=3, scale=2.0,
                  quants={"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"},
                  kwargs=dict(TINY_256, vocab_size=512, max_position_embeddings=512,
                              rms_norm_eps=1e-6, tie_word_embeddings=False,
                              bos_token_id=None, eos_token_id=None,  # set from the tokenizer
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # SentencePiece BPE with byte fallback ("llama" in GGUF); Q/K rows permuted by the converter;
    # tied embeddings; llama3 RoPE with a small original context, so the converter writes
    # rope_freqs and the test prompt runs past the original context.
    "llama": dict(config="LlamaConfig", tokenizer="sentencepiece", outtype="f32", seed=0, scale=8.0,
                  quants={},
                  kwargs=dict(TINY_256, vocab_size=512, max_position_embeddings=512,
                              rms_norm_eps=1e-5, tie_word_embeddings=True,
                              bos_token_id=1, eos_token_id=2,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                               "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    # DESIGN.md's *tiny* family (hidden 96): q/k RMSNorm, head_dim 32 * 4 heads != hidden,
    # YaRN RoPE, tied embeddings, stored BF16 by the converter.
    "qwen3": dict(config="Qwen3Config", tokenizer="bytelevel", outtype="bf16", seed=0, scale=8.0,
                  quants={},
                  kwargs=dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                               "factor": 4.0,
                                               "original_max_position_embeddings": 128})),
}

NEW_TOKENS = 24

CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Hello world! Hello there, how are you doing today? I'm fine, thanks.",
    "It's a truth universally acknowledged that we'll need more tests, isn't it?",
    "She said: \"Don't worry, they've already left.\" He replied, 'OK then.'",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159 1,000,000",
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n",
    "for (int i = 0; i < n; i++) { total += values[i]; }",
    "café naïve résumé façade jalapeño über straße",
    "你好世界，世界你好。我们今天去公园散步吧。",
    "こんにちは世界、今日はいい天気ですね。",
    "Привет мир, как дела? Всё хорошо.",
    "emoji time 😀🎉🚀 and more 👍🏽 ❤️ 🦙",
    "    indented line\n\ttabbed line\n\n\nthree newlines   three spaces",
    "The model reads the prompt, then it writes one token after another.",
    "Tokenizers split text into pieces; merges join frequent pairs of pieces.",
    "A small vocabulary keeps the embedding table tiny for the test files.",
    "Quantized weights are stored in blocks with a scale for every block.",
    "the the the of of and and to to in in is is it it that that",
]

# Text the tokenizer tests encode (ours against transformers' GGUF loader, llama.cpp, and the
# source tokenizer): ASCII, unicode, emoji, whitespace runs, special and added tokens.
TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's 3.14159 and they'll say I'm 42, won't they?",
    "café naïve résumé über straße",
    "你好世界，我们今天去公园",
    "Привет мир",
    "emoji 😀🎉🚀👍🏽❤️🦙 done",
    "   leading spaces",
    "trailing spaces   ",
    "a  b   c    d\te\t\tf\ng\n\nh\n\n\n",
    " ",
    "",
    "\n\n",
    "x" * 40,
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nfirst</think> answer",
    "<s>[INST] hello [/INST] sure</s>",
    "text<|endoftext|>more",
]

PROMPT = ("The model reads the prompt, then it writes one token after another. Tokenizers split "
          "text into pieces; merges join frequent pairs of pieces. Hello world! Hello there, how "
          "are you doing today? The quick brown fox jumps over the lazy dog while the cat sleeps "
          "in the sun. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123. It's a truth universally "
          "acknowledged that we'll need more tests, isn't it? café naïve résumé "
          "你好世界 😀🎉 "
          "A small vocabulary keeps the embedding table tiny for the test files.")

# Other tokenizer.ggml.pre values the qwen2 vocabulary is tokenized with (by llama.cpp here, by
# the tests with ours): each names a different split regex list in llama-vocab.cpp.
PRE_VARIANTS = ["default", "llama-bpe", "gpt-2", "starcoder", "falcon", "tekken", "gpt-4o"]

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                  "[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}"
                  "{% endif %}{% endfor %}")


# ---- tokenizers

def build_bytelevel_tokenizer(directory: str, extra_special: tuple[str, ...] = ()) -> dict:
    """Qwen2-style byte-level BPE (NFC normaliser, Qwen2's split regex), trained on CORPUS, with
    special <|endoftext|> <|im_start|> <|im_end|> (then `extra_special`) and a plain added token
    <think>/</think>. Returns the token ids config.json needs."""
    from tokenizers import AddedToken, Regex, Tokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=480, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                      *extra_special)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", chat_template=CHATML,
                                 clean_up_tokenization_spaces=False)
    hf.save_pretrained(directory)
    return dict(bos_token_id=tok.token_to_id("<|endoftext|>"),
                eos_token_id=tok.token_to_id("<|im_end|>"),
                generation_eos=[tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


def build_sentencepiece_tokenizer(directory: str, add_dummy_prefix: bool = True) -> dict:
    """Llama-style SentencePiece BPE with byte fallback (identity normalisation, digits split,
    whitespace-only pieces), control symbols [INST] [/INST] and a user-defined <sep> (which the
    converter stores as a NORMAL piece), written as tokenizer.model plus a
    tokenizer_config.json with the chat template. Gemma's vocabularies have no dummy prefix
    (add_dummy_prefix=False, which Gemma's converter writes as add_space_prefix false)."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=480, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        add_dummy_prefix=add_dummy_prefix, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=["[INST]", "[/INST]"], user_defined_symbols=["<sep>"],
        hard_vocab_limit=False, num_threads=1, minloglevel=2)
    with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    decoder = {str(i): dict(content=sp.id_to_piece(i), lstrip=False, rstrip=False,
                            normalized=False, single_word=False, special=True)
               for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    config = dict(tokenizer_class="LlamaTokenizer", add_bos_token=True, add_eos_token=False,
                  bos_token="<s>", eos_token="</s>", unk_token="<unk>", legacy=True,
                  clean_up_tokenization_spaces=False, chat_template=LLAMA_TEMPLATE,
                  added_tokens_decoder=decoder)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return dict(bos_token_id=1, eos_token_id=2, generation_eos=[2])


# ---- source checkpoints

def source_config(name: str, token_ids: dict | None = None, models: dict | None = None):
    """The transformers config of `name` in `models` (default this file's MODELS)."""
    import transformers

    spec = (models or MODELS)[name]
    kwargs = dict(spec["kwargs"])
    if token_ids is not None:
        kwargs.update(bos_token_id=token_ids["bos_token_id"],
                      eos_token_id=token_ids["eos_token_id"])
    return getattr(transformers, spec["config"])(**kwargs)


def source_model(name: str, config=None, models: dict | None = None):
    """The transformers model of `name` in `models` (default this file's MODELS) with its scaled
    random weights (deterministic on CPU). Tests call this with the committed config.json to
    rebuild the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(HERE))
    from checkpoints import scale_weights

    spec = (models or MODELS)[name]
    config = config if config is not None else source_config(name, None, models)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config)
    scale_weights(model, scale=spec["scale"], seed=spec["seed"],
                  embed_std=spec.get("embed_std", 0.15))
    return model.eval()


def tensor_sha256(array) -> str:
    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def write_source(name: str, directory: str) -> dict:
    """Tokenizer, config.json, generation_config.json and model.safetensors of `name`."""
    os.makedirs(directory, exist_ok=True)
    spec = MODELS[name]
    build = (build_bytelevel_tokenizer if spec["tokenizer"] == "bytelevel"
             else build_sentencepiece_tokenizer)
    ids = build(directory)
    config = source_config(name, ids)
    model = source_model(name, config)
    model.generation_config.eos_token_id = ids["generation_eos"]
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.save_pretrained(directory)
    return {k: tensor_sha256(v.detach().float().numpy()) for k, v in model.state_dict().items()}


# ---- llama.cpp

CONVERT_WRAPPER = """
import sys
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
sys.path.insert(0, {src!r})
import convert_hf_to_gguf as convert
from conversion.base import TextModel
# A toy vocabulary cannot match the converter's hash table of known pre-tokenizers.
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
convert.main()
"""


def convert(llama_cpp_src: str, src_dir: str, out_path: str, outtype: str) -> None:
    code = CONVERT_WRAPPER.format(src=llama_cpp_src)
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)      # use the gguf-py that ships with the converter
    subprocess.run([sys.executable, "-c", code, "--outtype", outtype, "--outfile", out_path,
                    src_dir], check=True, env=env, cwd=llama_cpp_src)


def quantize(src: str, dst: str, ftype_name: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = 4
    status = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype_name}) returned {status}")


# An f32 KV cache (llama.cpp's default is f16), so the recorded logits move only by what the
# weights' and activations' quantization does.
LLAMA_CPP_CONTEXT = dict(type_k=0, type_v=0)     # GGML_TYPE_F32


def llama_cpp_greedy(path: str, prompt_ids: list[int], steps: int) -> dict:
    """llama.cpp's greedy tokens after prompt_ids, and the top-two logit margin at each step."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True,
                n_threads=4, seed=0, verbose=False, **LLAMA_CPP_CONTEXT)
    llm.eval(prompt_ids)
    tokens, margins, first = [], [], None
    for _ in range(steps):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        first = first if first is not None else [round(float(x), 5) for x in logits]
        top2 = np.argsort(logits)[-2:]
        tokens.append(int(top2[1]))
        margins.append(round(float(logits[top2[1]] - logits[top2[0]]), 5))
        llm.eval([tokens[-1]])
    llm.close()
    return dict(tokens=tokens, margins=margins, first_logits=first)


def llama_cpp_tokenize(path: str, texts: list[str]) -> list[dict]:
    """llama.cpp's token ids for each text, with and without its default special tokens
    (special tokens in the text parsed, as transformers does)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    out = [dict(text=t, ids=llm.tokenize(t.encode(), add_bos=True, special=True),
                ids_no_special=llm.tokenize(t.encode(), add_bos=False, special=True))
           for t in texts]
    llm.close()
    return out


def round_matrices_to_bf16(model) -> None:
    """In place: what the converter's bf16 outtype stores (matrices bf16, vectors kept f32)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(p.bfloat16().float())


def transformers_greedy(model, prompt_ids: list[int], steps: int) -> dict:
    """transformers' greedy tokens (float32 compute) and top-two margins, one token at a time."""
    import torch

    ids = torch.tensor([prompt_ids])
    tokens, margins, first = [], [], None
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids).logits[0, -1].double()
            first = first if first is not None else [round(float(x), 5) for x in logits]
            top2 = torch.topk(logits, 2)
            tokens.append(int(top2.indices[0]))
            margins.append(round(float(top2.values[0] - top2.values[1]), 5))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return dict(tokens=tokens, margins=margins, first_logits=first)


def commit_source(name: str, src: str) -> None:
    """What the tests compare against: the source's config and tokenizer files (not the
    weights), copied to OUT_DIR/<name>-source/."""
    committed = os.path.join(OUT_DIR, f"{name}-source")
    shutil.rmtree(committed, ignore_errors=True)
    os.makedirs(committed)
    for f in ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja", "tokenizer.model"):
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), committed)


def prompt_ids_of(src: str, bytelevel: bool) -> list[int]:
    """PROMPT's ids by the source's own tokenizer (SentencePiece ones with BOS 1 first)."""
    if bytelevel:
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(src).encode(PROMPT)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(src, "tokenizer.model"))
    return [1] + sp.encode(PROMPT)


def checked_against_source(out: dict, model, path: str) -> dict:
    """`out` ({transformers parameter: a GGUF file's values}) reshaped to `model`'s parameters,
    after checking it names every one of them (a tied lm_head taken from the embedding) and each
    is close to the source value, so a file-to-parameter mapping can not be silently wrong."""
    import numpy as np

    state = model.state_dict()
    if "lm_head.weight" not in out and model.config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    assert set(out) == set(state), (set(out) ^ set(state))
    for k, v in out.items():
        src = state[k].float().numpy()
        v = v.reshape(src.shape)
        out[k] = v
        err = np.sqrt(np.mean((v - src) ** 2) / max(np.mean(src ** 2), 1e-30))
        assert err < 0.02, f"{path}: {k} differs from the source by {err:.3f} (relative RMS)"
    return out


def transformers_greedy_on(model, weights: dict, prompt_ids: list[int], steps: int) -> dict:
    """transformers_greedy on a copy of `model` holding `weights` (a GGUF file's values)."""
    import copy

    import torch

    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, v in weights.items():
            m.state_dict()[k].copy_(torch.from_numpy(v))
    return transformers_greedy(m, prompt_ids, steps)


def copy_gguf(src: str, dst: str, tensor=None, arch: str | None = None, overrides=None,
              tensors: bool = True, split_max_tensors: int = 0,
              leave_out: tuple[str, ...] = ()) -> list[str]:
    """Rewrite GGUF `src` as `dst` with gguf-py's GGUFWriter: the same metadata (values of the
    keys in `overrides` replaced, the keys in `leave_out` left out), tensors passed through
    `tensor(reader_tensor) -> (array, ggml type)` (or (array, ggml type, another name), or None
    to leave that tensor out) or all left out, optionally another general.architecture or split
    into shards. Returns the files written. The tests use it too (it needs no llama_cpp)."""
    from pathlib import Path

    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(dst, arch or r.fields["general.architecture"].contents(),
                   split_max_tensors=split_max_tensors)
    for key, f in r.fields.items():
        if (key.startswith("GGUF.") or key in ("general.architecture", "general.alignment")
                or key in leave_out):
            continue
        value = (overrides or {}).get(key, f.contents())
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, f.types[0], sub_type=sub)
    for t in r.tensors if tensors else []:
        out = tensor(t) if tensor else (t.data, t.tensor_type)
        if out is not None:
            data, qtype, *name = out
            w.add_tensor(name[0] if name else t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [str(p) for p in w.format_shard_names(Path(dst))]


def pre_variant(src: str, dst: str, pre: str) -> str:
    """A tokenizer-only copy of `src` (no tensors) with tokenizer.ggml.pre = `pre`: the same
    vocabulary and merges split by another of llama.cpp's pre-tokenizers."""
    copy_gguf(src, dst, overrides={"tokenizer.ggml.pre": pre}, tensors=False)
    return dst


def gguf_tensor_types(path: str) -> dict[str, str]:
    from gguf import GGUFReader
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions(llama_cpp_src: str) -> dict:
    import importlib.metadata as md

    out = {p: md.version(p) for p in ("llama_cpp_python", "transformers", "torch", "tokenizers",
                                      "sentencepiece", "gguf", "numpy")}
    with open(os.path.join(llama_cpp_src, "gguf-py", "pyproject.toml")) as f:
        out["converter_gguf_py"] = next(line.split('"')[1] for line in f
                                        if line.startswith("version"))
    out["converter"] = "llama-cpp-python 0.3.36 sdist: vendor/llama.cpp/convert_hf_to_gguf.py"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True,
                        help="llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python "
                             "sdist)")
    parser.add_argument("--keep", help="keep the source checkpoints in this directory")
    args = parser.parse_args()
    src_root = args.keep or tempfile.mkdtemp(prefix="gguf-src-")
    os.makedirs(OUT_DIR, exist_ok=True)

    from transformers import AutoModelForCausalLM

    record = dict(versions=versions(args.llama_cpp), llama_cpp_context=LLAMA_CPP_CONTEXT,
                  prompt=PROMPT, new_tokens=NEW_TOKENS,
                  tokenizer_texts=TOKENIZER_TEXTS, models={})
    for name, spec in MODELS.items():
        src = os.path.join(src_root, name)
        hashes = write_source(name, src)
        commit_source(name, src)
        prompt_ids = prompt_ids_of(src, spec["tokenizer"] == "bytelevel")
        model = AutoModelForCausalLM.from_pretrained(src, dtype="float32").eval()
        if spec["outtype"] == "bf16":   # the reference for a BF16 file: its weights, rounded
            round_matrices_to_bf16(model)
        entry = dict(source_sha256=hashes, prompt_ids=prompt_ids,
                     transformers=transformers_greedy(model, prompt_ids, NEW_TOKENS), files={})

        base = os.path.join(OUT_DIR, f"{name}-{spec['outtype']}.gguf")
        convert(args.llama_cpp, src, base, spec["outtype"])
        paths = {spec["outtype"]: base}
        for qname, ftype in spec["quants"].items():
            paths[qname] = os.path.join(OUT_DIR, f"{name}-{qname}.gguf")
            quantize(base, paths[qname], ftype)
        for kind, path in paths.items():
            entry["files"][kind] = dict(
                file=os.path.basename(path), bytes=os.path.getsize(path), sha256=sha256_file(path),
                tensor_types=gguf_tensor_types(path),
                llama_cpp=llama_cpp_greedy(path, prompt_ids, NEW_TOKENS))
        entry["llama_cpp_tokenize"] = llama_cpp_tokenize(base, TOKENIZER_TEXTS)
        if spec["tokenizer"] == "bytelevel" and name == "qwen2":
            entry["pre_variants"] = {
                pre: llama_cpp_tokenize(pre_variant(base, os.path.join(src_root, f"{pre}.gguf"),
                                                    pre), TOKENIZER_TEXTS)
                for pre in PRE_VARIANTS}
        record["models"][name] = entry
        print(f"{name}: " + ", ".join(f"{k} {v['bytes'] / 1e6:.2f} MB"
                                      for k, v in entry["files"].items()))
    with open(FIXTURES_JSON, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
    if not args.keep:
        shutil.rmtree(src_root)


if __name__ == "__main__":
    main()

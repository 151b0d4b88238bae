"""Random-weight checkpoints with Qwen2.5-0.5B's exact shapes, for throughput benchmarks.

    python -m bench.make_checkpoint            # writes (or reuses) everything under bench/.cache/

Writes, under bench/.cache/ (reused when present):
  qwen2.5-0.5b-random-f32/   config.json + model.safetensors (F32)   <- Taper loads these
  qwen2.5-0.5b-random-bf16/  config.json + model.safetensors (BF16)
  spm/tokenizer.model        a small SentencePiece model, only for llama.cpp's converter
  gguf-src-{f32,bf16}/       symlinks (config, weights, tokenizer.model) the converter reads
  qwen2.5-0.5b-random-{f32,bf16}.gguf   from llama.cpp's own convert_hf_to_gguf.py
  qwen2.5-0.5b-random-{q8_0,q4_k_m}.gguf   the f32 GGUF through llama.cpp's own quantizer
                                           (llama_model_quantize, via llama-cpp-python)

Both dtypes hold the SAME weights: values are drawn in f32 (seeded NumPy), rounded to bf16
(round-to-nearest-even), and the f32 checkpoint stores those bf16 values widened exactly. So the
f32 and bf16 runs, Taper's and llama.cpp's, all compute with one set of weights.

The Taper directories carry no tokenizer files (the bench feeds token ids); the SentencePiece model
lives apart because llama.cpp's Qwen2 converter tries `_set_vocab_sentencepiece()` first and pads
the vocabulary up to config.vocab_size with [PAD] tokens, which is all a GGUF needs here.

Needs numpy and safetensors' file format only (written by hand below: bf16 has no NumPy dtype);
the GGUF step needs llama.cpp's converter (LLAMACPP_SRC, default /tmp/llamacpp_src), torch (the
converter imports it) and `sentencepiece` (bench-only dependency); the quantized GGUFs need
llama-cpp-python (bench-only dependency).

Qwen2.5-0.5B's hidden size 896 is not a multiple of 256, so llama.cpp's Q4_K_M puts the tensors
whose rows are 896 long in other types (its llama_tensor_get_type fallbacks); `gguf_type_counts`
lists what a file actually holds.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parent / ".cache"
LLAMACPP_SRC = Path(os.environ.get("LLAMACPP_SRC", "/tmp/llamacpp_src"))
NAME = "qwen2.5-0.5b-random"
SEED = 20261122

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "use_cache": True,
    "transformers_version": "4.43.1",
}


# ---- weights

def tensor_shapes(cfg: dict = CONFIG) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes of Qwen2ForCausalLM (tied embeddings: no lm_head.weight)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.q_proj.bias", (q,)),
            (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16, as uint16 bit patterns (no NaNs in our data)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def make_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Scale like a trained small model: matrices std 0.02, biases std 0.02, norm weights ~1."""
    if name.endswith("norm.weight"):
        x = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
    else:
        x = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    return x


def write_safetensors(path: Path, tensors: list[tuple[str, np.ndarray]], dtype: str) -> None:
    """safetensors layout: u64 LE header length, JSON header, then the raw little-endian data."""
    header, offset = {}, 0
    for name, arr in tensors:
        nbytes = arr.nbytes
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                      # align the data section to 8 bytes
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())
    tmp.rename(path)


def make_checkpoints(cache: Path = CACHE, name: str = NAME, config: dict = CONFIG,
                     seed: int = SEED) -> dict[str, Path]:
    dirs = {dt: cache / f"{name}-{dt}" for dt in ("f32", "bf16")}
    if all((d / "model.safetensors").is_file() and (d / "config.json").is_file()
           for d in dirs.values()):
        return dirs
    t0 = time.time()
    rng = np.random.default_rng(seed)
    f32, bf16 = [], []
    for tname, shape in tensor_shapes(config):
        bits = f32_to_bf16_bits(make_tensor(rng, tname, shape))
        bf16.append((tname, bits))
        f32.append((tname, (bits.astype(np.uint32) << 16).view(np.float32)))
    for dt, tensors, st_dtype in (("f32", f32, "F32"), ("bf16", bf16, "BF16")):
        d = dirs[dt]
        d.mkdir(parents=True, exist_ok=True)
        cfg = dict(config, torch_dtype="float32" if dt == "f32" else "bfloat16")
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (d / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}) + "\n")
        write_safetensors(d / "model.safetensors", tensors, st_dtype)
    n = sum(int(np.prod(s)) for _, s in tensor_shapes(config))
    print(f"wrote {n / 1e6:.1f}M-parameter checkpoints to {cache} in {time.time() - t0:.0f}s")
    return dirs


# ---- tokenizer + GGUF (llama.cpp side only)

def _training_text() -> str:
    """Deterministic English-ish text from the standard library's docstrings."""
    import argparse as m1, collections as m2, email as m3, http.client as m4, json as m5
    import logging as m6, pathlib as m7, subprocess as m8, textwrap as m9, unittest as m10
    parts = []
    for mod in (m1, m2, m3, m4, m5, m6, m7, m8, m9, m10):
        for obj_name in sorted(dir(mod)):
            doc = getattr(getattr(mod, obj_name, None), "__doc__", None)
            if isinstance(doc, str):
                parts.append(doc)
    return "\n".join(line.strip() for p in parts for line in p.splitlines() if line.strip())


def make_spm_tokenizer(cache: Path = CACHE, vocab_size: int = 1000) -> Path:
    out = cache / "spm" / "tokenizer.model"
    if out.is_file():
        return out
    import sentencepiece as spm
    out.parent.mkdir(parents=True, exist_ok=True)
    corpus = out.parent / "corpus.txt"
    corpus.write_text(_training_text())
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out.with_suffix("")), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=1,
        minloglevel=2)
    return out


def make_gguf(dtype: str, cache: Path = CACHE, name: str = NAME, config: dict = CONFIG) -> Path:
    out = cache / f"{name}-{dtype}.gguf"
    if out.is_file():
        return out
    ckpt = make_checkpoints(cache, name, config)[dtype]
    tok = make_spm_tokenizer(cache)
    src = cache / (f"gguf-src-{dtype}" if name == NAME else f"gguf-src-{name}-{dtype}")
    src.mkdir(parents=True, exist_ok=True)
    for f in (ckpt / "config.json", ckpt / "model.safetensors", tok):
        link = src / f.name
        if not link.exists():
            link.symlink_to(f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LLAMACPP_SRC / "gguf-py"),
                                                      env.get("PYTHONPATH")]))
    tmp = out.with_suffix(".tmp.gguf")
    cmd = [sys.executable, str(LLAMACPP_SRC / "convert_hf_to_gguf.py"), str(src),
           "--outtype", dtype, "--outfile", str(tmp)]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.time()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({res.returncode})")
    tmp.rename(out)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return out


QUANT_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
                "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
                "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
                "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1"}
GGML_TYPE_F32 = 0


def make_quant_gguf(qtype: str, cache: Path = CACHE, threads: int | None = None,
                    name: str = NAME, config: dict = CONFIG, src: Path | None = None,
                    out: Path | None = None, float_embd_output: bool = False) -> Path:
    """An f32 GGUF (default: the named checkpoint's) quantized by llama.cpp's own quantizer
    (llama_model_quantize with its default parameters: no imatrix, output/embedding types chosen
    by the ftype; `float_embd_output` keeps token_embd and output in F32 instead, as --isq
    does), cached beside it (or at `out`)."""
    if out is None:
        suffix = f"-{qtype}-f32eo.gguf" if float_embd_output else f"-{qtype}.gguf"
        out = (cache / f"{name}{suffix}" if src is None
               else src.with_name(src.name.replace("-f32.gguf", suffix)))
    if out.is_file():
        return out
    import ctypes
    import llama_cpp
    src = src or make_gguf("f32", cache, name, config)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[qtype])
    params.nthread = threads or len(os.sched_getaffinity(0))
    if float_embd_output:
        params.output_tensor_type = params.token_embedding_type = GGML_TYPE_F32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.gguf")
    print(f"quantizing {src.name} to {qtype} with llama.cpp's llama_model_quantize", flush=True)
    t0 = time.time()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({qtype}) failed ({rc})")
    tmp.rename(out)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return out


def gguf_type_counts(path: Path) -> dict:
    """{ggml type name: (tensor count, bytes)} of a GGUF file, and the file's weight bytes."""
    from gguf import GGUFReader
    counts: dict[str, list[int]] = {}
    for t in GGUFReader(str(path)).tensors:
        c = counts.setdefault(t.tensor_type.name, [0, 0])
        c[0] += 1
        c[1] += int(t.n_bytes)
    return {k: tuple(v) for k, v in sorted(counts.items(), key=lambda kv: -kv[1][1])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-gguf", action="store_true", help="only the safetensors checkpoints")
    ap.add_argument("--dtype", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    ap.add_argument("--quant", nargs="*", default=[], choices=list(QUANT_FTYPES),
                    help="also the llama.cpp-quantized GGUFs (needs llama-cpp-python)")
    args = ap.parse_args(argv)
    for dt, d in make_checkpoints().items():
        print(f"{dt}: {d}")
    if not args.no_gguf:
        for dt in args.dtype:
            print(f"{dt} gguf: {make_gguf(dt)}")
        for q in args.quant:
            path = make_quant_gguf(q)
            print(f"{q} gguf: {path}: " + ", ".join(
                f"{n} x{c} ({b / 1e6:.1f} MB)" for n, (c, b) in gguf_type_counts(path).items()))


if __name__ == "__main__":
    main()

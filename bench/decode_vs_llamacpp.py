"""Batch-1 decode of a real model against llama.cpp, both engines alternated in one run.

    python -m bench.decode_vs_llamacpp [--threads 1] [--dtype f32 bf16] [--rounds 3]
        [--gen-len 64] [--prompt-len 128] [--kernels KEY=VALUE,... ...] [--no-llama]

SmolLM2-135M-Instruct (bench/real_model.py): Taper runs the float32 checkpoint of the GGUF's
dequantized weights (tests/real_model.py f32_dir; `--dtype bf16` loads it as bf16), llama.cpp
(llama-cpp-python, the site-packages named by --llama-site) runs the same weights requantized by
its own quantizer to F32 or BF16. Both at --threads threads (Taper through OMP_NUM_THREADS, set
before the engine is imported). Each --kernels value is one Taper row (an engine with those kernel
choices; default: one row with every default). Each round runs one greedy generation of
--gen-len tokens after a random --prompt-len prompt in each row, the Taper rows first, then
llama.cpp; decode tok/s = tokens after the first / time of those steps. The machine is shared: each figure prints the CPU share
other processes used while it ran, and the summary keeps the best round of each engine and the
ratio of the medians.

    python -m bench.decode_vs_llamacpp --linear [--threads 1] [--dtype f32 bf16] [--batch 1 16]

times Taper's `linear` alone on SmolLM2-135M's matrix shapes (random weights, rotated over copies
so that ~300 MB pass per timing and caches do not flatter them) in each kernels gemv_prefetch
variant, the variants alternated, best of 4: weight GB/s and GFLOP/s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# llama.cpp's llama_ftype for the requantized files
LLAMA_FTYPES = {"f32": 0, "bf16": 32}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", nargs="+", default=["f32"], choices=list(LLAMA_FTYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--kernels", nargs="+", default=[""], metavar="KEY=VALUE,...",
                    help="Taper's kernel choices, as the server's --kernels: one row each")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--linear", action="store_true",
                    help="time the linear op alone per gemv_prefetch variant (module docstring)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1], help="token rows for --linear")
    ap.add_argument("--llama-site", default="/tmp/lcpvenv/lib/python3.11/site-packages",
                    help="site-packages holding llama_cpp (llama-cpp-python)")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.linear:
        return linear_variants(args.dtype, args.batch)
    if not args.no_llama and args.llama_site not in sys.path:
        sys.path.append(args.llama_site)

    from bench.real_model import tests_module
    from bench.throughput import OtherLoad, llama_cpp_greedy_run, taper_run
    from engine import LLM

    real_model = tests_module()
    gguf, f32 = real_model.smollm2_gguf(), real_model.f32_dir()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.threads} thread(s) per engine; prompt {args.prompt_len}, {args.gen_len} generated")
    rng = np.random.default_rng(0)
    summary = []
    for dt in args.dtype:
        engines = {f"taper {k}".strip(): LLM(f32, dtype=dt, kernels=k, max_num_seqs=1,
                                              enable_prefix_caching=False, kv_cache_memory_mb=64)
                   for k in args.kernels}
        lcp = None
        if not args.no_llama:
            from llama_cpp import Llama
            path = requantized(gguf, dt)
            lcp = Llama(path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=args.threads,
                        n_threads_batch=args.threads, verbose=False)
        vocab = next(iter(engines.values())).engine.model_config.vocab_size
        for llm in engines.values():                                      # warm-ups
            taper_run(llm, [rng.integers(0, vocab, 16).tolist()], 4)
        if lcp:
            llama_cpp_greedy_run(lcp, rng.integers(0, vocab, 16).tolist(), 4)
        runs = {name: [] for name in engines}
        if lcp:
            runs["llama.cpp"] = []
        tokens = {}
        for r in range(args.rounds):
            prompt = rng.integers(0, vocab, args.prompt_len).tolist()
            for name in runs:
                load = OtherLoad()
                m = (taper_run(engines[name], [prompt], args.gen_len) if name in engines
                     else llama_cpp_greedy_run(lcp, prompt, args.gen_len))
                other = load.fraction()
                runs[name].append(m["decode_tok_s"])
                tokens.setdefault(r, {})[name] = m["tokens"]
                print(f"  {dt} round {r + 1} {name:>24}: decode {m['decode_tok_s']:6.2f} tok/s "
                      f"({m['decode_step_ms']:.2f} ms/step)  [others {100 * other:.0f}% CPU, "
                      f"load {os.getloadavg()[0]:.2f}]", flush=True)
        # the Taper rows' greedy tokens are the same: the kernel choices change speed only
        for r, by_row in tokens.items():
            rows = [by_row[name] for name in engines]
            if any(t != rows[0] for t in rows):
                print(f"  {dt} round {r + 1}: the Taper rows' greedy tokens differ")
        summary.append((dt, runs))
        del engines, lcp
    print("summary (decode tok/s, batch 1: best and median of the rounds)")
    for dt, runs in summary:
        l = runs.get("llama.cpp")
        for name, t in runs.items():
            line = f"  {dt} {name:>24}: {max(t):6.2f} / {np.median(t):6.2f}"
            if l and name != "llama.cpp":
                line += f", / llama.cpp (medians) {np.median(t) / np.median(l):.3f}x"
            print(line)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


# SmolLM2-135M's matrices (N, K): the fused qkv and gate+up projections as Taper runs them
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate+up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def linear_variants(dtypes, batches):
    import ml_dtypes
    from pyx.cpu_backend import CpuBackend
    from pyx.kernel_config import CHOICES
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    backends = {v: CpuBackend(kernels=f"gemv_prefetch={v}") for v in CHOICES["gemv_prefetch"].values}
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        w32 = 0.02 * rng.standard_normal((n, k), dtype=np.float32)
        for dt in dtypes:
            w = w32 if dt == "f32" else w32.astype(ml_dtypes.bfloat16)
            ws = [w] + [w.copy() for _ in range(int(3e8 // w.nbytes))]
            for t in batches:
                x = rng.standard_normal((t, k), dtype=np.float32)
                out = np.empty((t, n), np.float32)
                best = dict.fromkeys(backends, float("inf"))
                for _ in range(4):
                    for v, b in backends.items():
                        t0 = time.perf_counter()
                        for wi in ws:
                            b.linear(x, wi, None, out)
                        best[v] = min(best[v], (time.perf_counter() - t0) / len(ws))
                print(f"  {name:8s} {n:5d}x{k:<5d} {dt:4s} T={t:<3d} " + "  ".join(
                    f"{v} {w.nbytes / s / 1e9:5.1f} GB/s {2 * t * n * k / s / 1e9:5.1f} GFLOP/s"
                    for v, s in best.items()), flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def requantized(gguf: str, name: str) -> str:
    """The GGUF requantized by llama.cpp's quantizer to `name`, made once (bench/real_model.py's
    cache)."""
    import llama_cpp
    from bench.real_model import CACHE
    out = os.path.join(CACHE, f"smollm2-135m-instruct-from-q4_1-{name}.gguf")
    if os.path.exists(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[name]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(gguf.encode(), (out + ".part").encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize to {name} failed ({status})")
    os.replace(out + ".part", out)
    return out


if __name__ == "__main__":
    main()

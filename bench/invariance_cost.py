"""What `--batch-invariant` costs on the CPU backend: throughput with the switch off and on.

    python -m bench.invariance_cost [--dtype bf16 f32] [--batch 1 16] [--prompt-len 128]
        [--gen-len 32] [--reps 3] [--wait-quiet S] [--json out.json]
    python -m bench.invariance_cost --ops [--threads N]   # linear and paged_attention alone

The Qwen2.5-0.5B-shaped random checkpoints of bench/make_checkpoint.py and the measurement of
bench/throughput.py (`taper_run`: prefill tokens/s over the steps that compute the prompts, decode
tokens/s over the rest, greedy, prefix caching off). Off and on alternate within each repetition,
so a burst of other load on a shared machine hits both, and the best of --reps is kept per figure.
Prints both and the ratio on / off for prefill, decode and decode p50 (the median step).
"""
from __future__ import annotations

import argparse
import gc
import json

from bench.make_checkpoint import make_checkpoints
from bench.throughput import (SEED, describe, keep_best, machine_info, random_prompts, taper_run,
                              wait_quiet)


def make_llm(model_dir, dtype: str, batch_invariant: bool, max_b: int, prompt_len: int,
             gen_len: int):
    from engine import LLM
    llm = LLM(str(model_dir), dtype=dtype, batch_invariant=batch_invariant, max_num_seqs=max_b,
              max_num_batched_tokens=max(max_b * prompt_len, 2048),
              kv_cache_memory_mb=max(64, max_b * (prompt_len + gen_len) * 24576 * 2 // 2**20),
              enable_prefix_caching=False)
    taper_run(llm, random_prompts(2, 16, SEED + 99), 4)                      # warm-up
    return llm


def op_costs(reps: int = 15, threads: int | None = None) -> list[dict]:
    """The two ops the switch changes, alone: best-of-`reps` milliseconds, off and on (the minimum
    resists other load on a shared machine better than a mean). Qwen2.5-0.5B's projections and LM
    head in bf16, and its attention (14 query heads, 2 KV heads of 64) over a 2048-token context:
    one decode row, and a 512-token prefill chunk. threads: OpenMP threads per op (default all;
    1 is the steadiest figure where other processes compete for the cores)."""
    import time

    import ml_dtypes
    import numpy as np

    from pyx.cpu_backend import CpuBackend
    rng = np.random.default_rng(0)
    backends = {inv: CpuBackend(batch_invariant=inv, num_threads=threads) for inv in (False, True)}

    def best_ms(fn):
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return 1e3 * best

    rows = []
    for name, (N, K) in {"qkv 1152x896": (1152, 896), "gate_up 9728x896": (9728, 896),
                         "down 896x4864": (896, 4864), "lm_head 151936x896": (151936, 896)}.items():
        w = (rng.standard_normal((N, K)) * 0.05).astype(ml_dtypes.bfloat16)
        for T in (1, 16, 128):
            x = rng.standard_normal((T, K)).astype(np.float32)
            out = np.empty((T, N), np.float32)
            ms = {inv: best_ms(lambda: b.linear(x, w, None, out)) for inv, b in backends.items()}
            rows.append({"op": f"linear bf16 {name}", "T": T, "off_ms": ms[False],
                         "on_ms": ms[True]})
    Hq, Hkv, D, BS, L = 14, 2, 64, 16, 2048
    NB = L // BS + 1
    kc = rng.standard_normal((NB, BS, Hkv, D)).astype(np.float32)
    vc = rng.standard_normal((NB, BS, Hkv, D)).astype(np.float32)
    table = np.arange(1, NB, dtype=np.int32)[None]
    for label, T in (("decode row, context 2048", 1), ("prefill chunk 512, context 2048", 512)):
        q = rng.standard_normal((T, Hq, D)).astype(np.float32)
        out = np.empty_like(q)
        qsl = np.array([0, T], np.int32)
        ms = {inv: best_ms(lambda: b.paged_attention(out, q, kc, vc, table,
                                                     np.array([L], np.int32), qsl, D ** -0.5, 0))
              for inv, b in backends.items()}
        rows.append({"op": f"paged_attention {label}", "T": T, "off_ms": ms[False],
                     "on_ms": ms[True]})
    print(f"threads per op: {backends[False].num_threads}")
    print(f"{'op (best of ' + str(reps) + ', ms)':<52}{'T':>5}{'off':>9}{'on':>9}{'on/off':>8}")
    for r in rows:
        print(f"{r['op']:<52}{r['T']:>5}{r['off_ms']:>9.3f}{r['on_ms']:>9.3f}"
              f"{r['on_ms'] / r['off_ms']:>8.2f}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "f32"], choices=["f32", "bf16"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    ap.add_argument("--ops", action="store_true", help="only the op timings (linear, attention)")
    ap.add_argument("--threads", type=int, default=None, help="with --ops: threads per op")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores; taper ISA {info['taper_isa']}; "
          "load average %.2f %.2f %.2f" % info["loadavg_start"])
    if args.ops:
        rows = op_costs(threads=args.threads)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "ops": rows}, f, indent=1, default=str)
        return
    print(f"prompt {args.prompt_len} tokens, {args.gen_len} generated, greedy; best of "
          f"{args.reps}")
    dirs = make_checkpoints()
    results = {}
    for dt in args.dtype:
        llms = {inv: make_llm(dirs[dt], dt, inv, max(args.batch), args.prompt_len, args.gen_len)
                for inv in (False, True)}
        for b in args.batch:
            best = {False: None, True: None}
            tokens = {}
            for r in range(args.reps):
                prompts = random_prompts(b, args.prompt_len, SEED + 1000 * b + r)
                for inv in (False, True):
                    if args.wait_quiet:
                        wait_quiet(args.wait_quiet)
                    cur = taper_run(llms[inv], prompts, args.gen_len)
                    tokens.setdefault(inv, cur["tokens"])
                    print(describe(f"{dt} batch {b:>2} {'on ' if inv else 'off'}", cur),
                          flush=True)
                    best[inv] = keep_best(best[inv], cur)
            results[f"{dt} b{b}"] = {"off": best[False], "on": best[True],
                                     "same_greedy_tokens": tokens[False] == tokens[True]}
        del llms
        gc.collect()
    print("\nsummary (tokens/s, best of reps; on/off = the switch's cost, 1.00 = free)")
    print(f"{'case':<10}{'prefill off':>12}{'on':>9}{'on/off':>7}{'decode off':>12}{'on':>8}"
          f"{'on/off':>7}{'p50 off':>9}{'on':>8}{'on/off':>7}{'others':>8}")
    for case, r in results.items():
        off, on = r["off"], r["on"]
        others = max(off["other_load"] + on["other_load"])
        print(f"{case:<10}{off['prefill_tok_s']:>12.1f}{on['prefill_tok_s']:>9.1f}"
              f"{on['prefill_tok_s'] / off['prefill_tok_s']:>7.2f}"
              f"{off['decode_tok_s']:>12.2f}{on['decode_tok_s']:>8.2f}"
              f"{on['decode_tok_s'] / off['decode_tok_s']:>7.2f}"
              f"{off['decode_p50_tok_s']:>9.2f}{on['decode_p50_tok_s']:>8.2f}"
              f"{on['decode_p50_tok_s'] / off['decode_p50_tok_s']:>7.2f}{100 * others:>7.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()

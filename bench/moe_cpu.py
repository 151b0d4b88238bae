"""Batch-1 decode of a Qwen3-30B-A3B-shaped mixture of experts on the CPU: Taper against llama.cpp
on the same GGUF files.

    python -m bench.moe_cpu                      # 2 layers, Q8_0 (+ Q4_K_M with llama_cpp)
    python -m bench.moe_cpu --layers 4 --quant q8_0 --reps 3 --wait-quiet 120

The model has Qwen3-30B-A3B's shapes (hidden 2048, 32 query heads and 4 KV heads of 128, q/k
RMSNorm, 128 experts of 768 with 8 routed per token, renormalised, vocab 151936) but only
`--layers` layers and random weights (N(0, 0.02^2) matrices, norms 1). It is written straight to
GGUF (general.architecture qwen3moe, llama.cpp's tensor names and metadata keys, experts merged
as blk.N.ffn_{gate,up,down}_exps) with gguf-py's Q8_0 quantizer; the Q4_K_M file is that Q8_0
file through llama.cpp's own quantizer (llama_model_quantize with allow_requantize, so from 8-bit
values; the speed does not depend on which values). Both engines load the same files; the bench
feeds token ids (the file's vocabulary is placeholder pieces).

Printed per file: decode tokens/s for each engine (the best of --reps runs, prompt --prompt-len,
--gen-len new tokens), the bytes one decode step must read (every non-expert matrix, one row of
the embedding, and only the 8 routed experts' slices of the merged expert tensors: 8/128 of
them), and the bandwidth bound: NumPy's multi-threaded copy bandwidth measured in the same run
divided by those bytes. Files go to bench/.cache/ (about 1.9 GB for 2 layers at Q8_0).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench.throughput import (OtherLoad, bench_llama, bench_taper, machine_info,
                              stream_copy_bandwidth)

CACHE = Path(__file__).parent / ".cache"
# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B), layers aside.
SHAPE = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
             expert_ff=768, dense_ff=6144, vocab=151936, rope_theta=1e6, eps=1e-6)


# The least a byte-level BPE vocabulary needs to load in both engines: merges whose pieces exist.
PLACEHOLDER_PIECES, PLACEHOLDER_MERGES = ["a", "b", "ab"], ["a b"]


def make_q8_0_gguf(path: Path, layers: int, seed: int = 0) -> Path:
    """The Q8_0 file (reused when present)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter, quants

    if path.exists():
        return path
    s, rng = SHAPE, np.random.default_rng(seed)
    H, D = s["hidden"], s["head_dim"]
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(str(tmp), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(s["dense_ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(s["expert_ff"])
    w.add_file_type(7)                                        # LLAMA_FTYPE_MOSTLY_Q8_0
    # Placeholder vocabulary: one piece per id (the bench feeds ids, nothing is tokenized).
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(PLACEHOLDER_PIECES + [f"<t{i}>" for i in range(3, s["vocab"])])
    w.add_token_types([1] * s["vocab"])
    w.add_token_merges(PLACEHOLDER_MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def matrix(name, *shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= 0.02
        w.add_tensor(name, quants.quantize(x, QT.Q8_0), raw_dtype=QT.Q8_0)

    def ones(name, n):
        w.add_tensor(name, np.ones(n, np.float32))

    matrix("token_embd.weight", s["vocab"], H)
    for i in range(layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", H)
        matrix(b + "attn_q.weight", s["heads"] * D, H)
        matrix(b + "attn_k.weight", s["kv_heads"] * D, H)
        matrix(b + "attn_v.weight", s["kv_heads"] * D, H)
        ones(b + "attn_q_norm.weight", D)
        ones(b + "attn_k_norm.weight", D)
        matrix(b + "attn_output.weight", H, s["heads"] * D)
        ones(b + "ffn_norm.weight", H)
        w.add_tensor(b + "ffn_gate_inp.weight",
                     0.02 * rng.standard_normal((s["experts"], H), dtype=np.float32))
        matrix(b + "ffn_gate_exps.weight", s["experts"], s["expert_ff"], H)
        matrix(b + "ffn_up_exps.weight", s["experts"], s["expert_ff"], H)
        matrix(b + "ffn_down_exps.weight", s["experts"], H, s["expert_ff"])
    ones("output_norm.weight", H)
    matrix("output.weight", s["vocab"], H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def make_q4_k_m_gguf(src: Path, dst: Path) -> Path:
    """llama.cpp's own Q4_K_M quantizer on the Q8_0 file (reused when present)."""
    import llama_cpp

    if dst.exists():
        return dst
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}) failed")
    tmp.rename(dst)
    return dst


def bytes_per_token(path: Path) -> dict:
    """Bytes one batch-1 decode step reads from the file's weights: every tensor except the
    embedding (one row) and the merged experts (top_k of E slices)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    E, k = SHAPE["experts"], SHAPE["top_k"]
    out = {"experts": 0, "other": 0, "file": 0, "types": {}}
    for t in r.tensors:
        n = int(t.n_bytes)
        out["file"] += n
        out["types"][t.tensor_type.name] = out["types"].get(t.tensor_type.name, 0) + 1
        if t.name == "token_embd.weight":
            out["other"] += n // SHAPE["vocab"]
        elif "_exps." in t.name:
            out["experts"] += n * k // E
        else:
            out["other"] += n
    out["total"] = out["experts"] + out["other"]
    return out


def read_through(path: Path) -> None:
    """Read the whole file once, so its pages are cached: both engines map the file and a decode
    step touches only the routed experts, so a cold cache turns the first hundreds of steps into
    disk reads (measured: Taper 1.7 against 15.7 tok/s warm)."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--quant", nargs="+", default=["q8_0", "q4_k_m"], choices=["q8_0", "q4_k_m"])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama.cpp threads (Taper uses one OpenMP thread per core)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="wait up to this many seconds for an idle machine before each run")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    try:
        import llama_cpp  # noqa: F401
        have_llama = not args.no_llama
    except ImportError:
        have_llama = False
    CACHE.mkdir(exist_ok=True)
    stem = f"qwen3-30b-a3b-shaped-{args.layers}l-random"
    t = time.perf_counter()
    files = {"q8_0": make_q8_0_gguf(CACHE / f"{stem}-q8_0.gguf", args.layers)}
    if "q4_k_m" in args.quant:
        if have_llama:
            files["q4_k_m"] = make_q4_k_m_gguf(files["q8_0"], CACHE / f"{stem}-q4_k_m.gguf")
        else:
            print("q4_k_m skipped: llama_cpp (its quantizer) is not installed")
    print(f"files ready in {time.perf_counter() - t:.0f} s")
    info = machine_info()
    bw = stream_copy_bandwidth()
    copy = max(v for k, v in bw.items() if k.startswith("copy_"))
    print(json.dumps(info), json.dumps(bw), sep="\n")

    results = {"machine": info, "bandwidth": bw, "shape": dict(SHAPE, layers=args.layers),
               "runs": {}}
    for q in args.quant:
        if q not in files:
            continue
        path = files[q]
        b = bytes_per_token(path)
        bound = copy * 1e9 / b["total"]
        print(f"\n{q}: {path.name} {b['file'] / 1e9:.2f} GB ({b['types']}); per decoded token "
              f"{b['total'] / 1e6:.1f} MB read ({b['experts'] / 1e6:.1f} MB routed experts, "
              f"{b['other'] / 1e6:.1f} MB the rest); bound {bound:.1f} tok/s at {copy:.1f} GB/s")
        run = {"bytes": b, "bound_tok_s": bound}
        read_through(path)
        load = OtherLoad()
        run["taper"] = bench_taper(q, path.parent, [1], args.prompt_len, args.gen_len,
                                   args.reps, args.wait_quiet, weight_file=path.name)["b1"]
        if have_llama:
            run["llama_cpp"] = bench_llama(q, path, args.prompt_len, args.gen_len, args.reps,
                                           args.threads, args.wait_quiet)["b1"]
        run["other_load"] = load.fraction()
        for engine in ("taper", "llama_cpp"):
            if engine in run:
                tok_s = run[engine]["decode_tok_s"]
                others = run[engine]["other_load"]
                others = max(others) if isinstance(others, list) else others
                print(f"  {engine:<9} decode {tok_s:6.2f} tok/s = {100 * tok_s / bound:4.0f}% of "
                      f"the bound, {tok_s * b['total'] / 1e9:5.2f} GB/s of weights "
                      f"[others: up to {100 * others:.0f}% CPU]")
        results["runs"][q] = run
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

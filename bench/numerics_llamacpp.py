"""Per-step logits of Taper and llama.cpp on the same quantized GGUF files, against the exact
reference: the file's own weights dequantized (by the `gguf` package, llama.cpp's Python code)
and run in float64 by transformers.

    LLAMACPP_SRC=/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        python -m bench.numerics_llamacpp            # makes the files on first use (bench/.cache)

The model is a random Qwen2 (hidden 1024, 4 layers, 16 heads of 64, 4 KV heads, intermediate
2816, a 32000-token tied embedding), written as F32 GGUF by llama.cpp's converter and quantized
by llama.cpp's own quantizer to Q8_0, Q6_K and Q4_K_M (bench/make_checkpoint.py). All three
engines are teacher-forced on one token sequence (a random prompt, then the reference's greedy
continuation), so every step sees the same inputs: Taper and llama.cpp take the prompt in one
batch, then one token per step (the decode path), with an f32 KV cache on both.

Distances per step between each engine's logits and the reference's: max |diff| and RMS, and
whether the argmax agrees; the table shows their mean and worst over the steps. Taper runs twice:
as it computes by default (the decode matmul rounds each activation row to 8 bits once, as
llama.cpp does) and with kernels act_split=on (each row as two 8-bit rows, pyx/quant_kernels.c).

llama.cpp (llama-cpp-python) and torch are bench-only dependencies; nothing in the test suite
imports this file.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.make_checkpoint import CACHE, make_gguf, make_quant_gguf, tensor_shapes

NAME = "qwen2-1024x4-random"
SEED = 20261126
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 4096, "max_window_layers": 4,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 4096,
    "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
    "use_cache": True, "transformers_version": "4.43.1",
}
QUANTS = ["q8_0", "q6_k", "q4_k_m"]
SPLIT = "act_split=on"        # the KernelConfig of the second Taper mode


# ---- the three engines, teacher-forced on `tokens`; rows = logits predicting tokens[p+1:]

def reference_model(config: dict, weights: dict):
    """transformers' Qwen2 in float64 on the file's dequantized weights."""
    import torch
    import transformers
    cfg = transformers.Qwen2Config(**{k: v for k, v in config.items()
                                      if k not in ("architectures", "dtype", "torch_dtype")})
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float64).eval()
    state = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in weights.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def reference_logits(model, tokens: list[int], prompt_len: int) -> np.ndarray:
    """One causal pass; rows predict tokens[prompt_len:] (and one past the end)."""
    import torch
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, prompt_len - 1:].numpy()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n)
    return [int(t) for t in out[0]]


def taper_logits(config: dict, weights: dict, tokens: list[int], prompt_len: int,
                 step_ms: list | None = None, kernels: str | None = None) -> np.ndarray:
    """Taper's CPU backend built with `kernels`: the prompt in one forward, then one token per
    forward (each decode forward's wall time appended to step_ms)."""
    from engine.runner.forward_batch import ForwardBatch
    from engine.models.model_config import ModelConfig
    from engine.models.registry import get_model_class
    from pyx.cpu_backend import CpuBackend

    mc = ModelConfig.from_dict(config)
    model = get_model_class(mc.architecture)(mc, dict(weights),   # it takes the dict
                                             CpuBackend(kernels=kernels))
    block = 16
    num_blocks = -(-len(tokens) // block)
    shape = model.kv_cache_shape(num_blocks, block)
    kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
          for _ in range(model.num_layers)]
    table = np.arange(num_blocks, dtype=np.int32)[None]
    rows, done = [], 0
    for end in range(prompt_len, len(tokens)):
        pos = np.arange(done, end, dtype=np.int32)
        batch = ForwardBatch(
            token_ids=np.array(tokens[done:end], np.int32), positions=pos,
            slot_mapping=(table[0, pos // block] * block + pos % block).astype(np.int32),
            query_start_loc=np.array([0, len(pos)], np.int32),
            seq_lens=np.array([end], np.int32), block_tables=table,
            logits_indices=np.array([len(pos) - 1], np.int32))
        t0 = time.perf_counter()
        rows.append(np.array(model.forward(batch, kv)[0], np.float64))
        if step_ms is not None and end > prompt_len:
            step_ms.append(1e3 * (time.perf_counter() - t0))
        done = end
    return np.stack(rows)


def llama_cpp_logits(path: Path, tokens: list[int], prompt_len: int, threads: int) -> np.ndarray:
    """llama.cpp on the same file: the prompt in one eval, then one token per eval; f32 KV."""
    from llama_cpp import Llama
    n_ctx = 64 * ((len(tokens) + 63) // 64)
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                logits_all=True, n_threads=threads, n_threads_batch=threads, seed=0,
                verbose=False, type_k=0, type_v=0)     # GGML_TYPE_F32 KV cache
    llm.eval(tokens[:prompt_len])
    rows = [np.array(llm.scores[prompt_len - 1], np.float64)]
    for t in tokens[prompt_len:-1]:
        llm.eval([t])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], np.float64))
    llm.close()
    return np.stack(rows)


# ---- distances

def distances(x: np.ndarray, ref: np.ndarray) -> dict:
    d = x - ref
    maxabs, rms = np.abs(d).max(-1), np.sqrt((d * d).mean(-1))
    agree = np.argmax(x, -1) == np.argmax(ref, -1)
    return dict(max_mean=float(maxabs.mean()), max_worst=float(maxabs.max()),
                rms_mean=float(rms.mean()), rms_worst=float(rms.max()),
                agree=int(agree.sum()), steps=len(agree))


def top2_margins(ref: np.ndarray) -> np.ndarray:
    top = np.sort(ref, -1)
    return top[:, -1] - top[:, -2]


def dequantized_weights(path: Path):
    """(config, Taper's weights as loaded, the same weights dequantized by gguf to float32)."""
    from gguf import quants
    from engine.loader.gguf import read_gguf
    from pyx.weights.ggml import QuantizedWeight
    ck = read_gguf(str(path), progress=False)
    deq = {}
    for k, v in ck.weights.items():
        if isinstance(v, QuantizedWeight):
            deq[k] = np.concatenate([quants.dequantize(b, t).reshape(b.shape[0], v.k)
                                     for t, b in v.quant_parts])
        else:
            deq[k] = np.asarray(v, np.float32)
    return ck.config, ck.weights, deq


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def versions() -> str:
    import importlib.metadata as md
    out = []
    for pkg in ("llama_cpp_python", "transformers", "torch", "gguf", "numpy"):
        try:
            out.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", nargs="+", default=QUANTS, choices=QUANTS)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--llama-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-llama", action="store_true", help="Taper and the reference only")
    ap.add_argument("--speed-reps", type=int, default=2,
                    help="extra teacher-forced runs of each Taper mode for the step times")
    args = ap.parse_args(argv)
    from pyx.cpu_backend import CpuBackend
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, "
          f"Taper ISA {CpuBackend().isa}; {versions()}")
    print(f"model: {NAME} ({sum(int(np.prod(s)) for _, s in tensor_shapes(CONFIG)) / 1e6:.0f}M "
          f"parameters); prompt {args.prompt_len} random tokens, {args.steps} teacher-forced steps")
    rng = np.random.default_rng(SEED)
    prompt = [int(t) for t in rng.integers(3, CONFIG["vocab_size"], args.prompt_len)]
    rows, speed = [], []
    for q in args.quant:
        path = make_quant_gguf(q, name=NAME, config=CONFIG)
        t0 = time.time()
        config, weights, deq = dequantized_weights(path)
        model = reference_model(config, deq)
        tokens = reference_greedy(model, prompt, args.steps)
        ref = reference_logits(model, tokens, args.prompt_len)[:-1]
        del model
        margins = top2_margins(ref)
        times = {"taper": [], f"taper, {SPLIT}": []}

        def split():
            return taper_logits(config, weights, tokens, args.prompt_len,
                                times[f"taper, {SPLIT}"], kernels=SPLIT)
        engines = {"taper": lambda: taper_logits(config, weights, tokens, args.prompt_len,
                                                 times["taper"]),
                   f"taper, {SPLIT}": split}
        if not args.no_llama:
            for th in args.llama_threads:
                engines[f"llama.cpp {th} thr"] = (
                    lambda th=th: llama_cpp_logits(path, tokens, args.prompt_len, th))
        for label, fn in engines.items():
            d = distances(fn(), ref)
            rows.append((q, label, d, float(np.median(margins))))
        for _ in range(args.speed_reps):    # more decode steps, the two modes interleaved
            engines["taper"]()
            split()
        speed.append((q, {k: float(np.percentile(v, 25)) for k, v in times.items()}))
        print(f"  {q}: done in {time.time() - t0:.0f}s", flush=True)
    print()
    print("| file | engine | max-abs mean / worst | RMS mean / worst | argmax = ref | ref top-2 margin (median) |")
    print("|---|---|---:|---:|---:|---:|")
    for q, label, d, m in rows:
        print(f"| {q} | {label} | {d['max_mean']:.4f} / {d['max_worst']:.4f} | "
              f"{d['rms_mean']:.5f} / {d['rms_worst']:.5f} | {d['agree']}/{d['steps']} | {m:.3f} |")
    print()
    print(f"Taper decode step, batch 1, {os.environ.get('OMP_NUM_THREADS', 'all')} threads "
          "(ms, 25th percentile of all steps; the machine is shared):")
    for q, t in speed:
        print(f"  {q}: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items())
              + f" (x{t[f'taper, {SPLIT}'] / t['taper']:.2f})")


if __name__ == "__main__":
    main()

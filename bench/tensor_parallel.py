"""Decode throughput of tensor parallel on the CPU backend: the same random-weight checkpoint at
tensor_parallel_size 1 (one process, every core) and N (N MPI processes, the cores split between
them), greedy decode of a few sequences.

    python -m bench.tensor_parallel [--tp 1 2] [--batch 1 8] [--tokens 48]

The checkpoint (written once under bench/.cache/, 300 MB): Llama-shaped, hidden 768, 8 layers,
12 heads of 64 with 4 KV heads, intermediate 2048, vocabulary 32,000, float32, tied embeddings
(75 M parameters): large enough that a decode step reads its weights from memory, small enough
for a 2-core machine. Decode tok/s = sequences x (tokens - 1) / (time of the whole generation -
time of a 1-token generation of the same prompts), the median of --runs rounds; the load average
is printed beside it, since on a shared machine other processes take cores from the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

CACHE = os.path.join(os.path.dirname(__file__), ".cache", "tp-bench-f32")
SHAPE = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000)


def make_checkpoint(path: str = CACHE) -> str:
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    s = SHAPE
    H, I, D = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * D, s["num_key_value_heads"] * D
    rng = np.random.default_rng(0)

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(s["vocab_size"], H, std=0.1),
         "model.norm.weight": np.ones(H, np.float32)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": normal(q, H), p + "self_attn.k_proj.weight":
                  normal(kv, H), p + "self_attn.v_proj.weight": normal(kv, H),
                  p + "self_attn.o_proj.weight": normal(H, q), p + "mlp.gate_proj.weight":
                  normal(I, H), p + "mlp.up_proj.weight": normal(I, H),
                  p + "mlp.down_proj.weight": normal(H, I),
                  p + "input_layernorm.weight": np.ones(H, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(H, np.float32)})
    save_file(w, os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def decode_tok_s(model: str, tp: int, batch: int, tokens: int, runs: int) -> tuple[float, float]:
    """(median decode tok/s, median seconds of the 1-token generation)."""
    from engine import LLM, SamplingParams
    llm = LLM(model, tensor_parallel_size=tp, num_kv_blocks=512, enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, SHAPE["vocab_size"], 32).tolist() for _ in range(batch)]

    def timed(n):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    try:
        timed(4)                        # warm-up
        rates, firsts = [], []
        for _ in range(runs):
            first, whole = timed(1), timed(tokens)
            rates.append(batch * (tokens - 1) / (whole - first))
            firsts.append(first)
    finally:
        llm.engine.shutdown()
    return statistics.median(rates), statistics.median(firsts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model = make_checkpoint()
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.1f}")
    print("| tensor parallel | batch | decode tok/s | 1-token generation (s) | load avg |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        for tp in args.tp:
            rate, first = decode_tok_s(model, tp, batch, args.tokens, args.runs)
            print(f"| {tp} | {batch} | {rate:.1f} | {first:.3f} | {os.getloadavg()[0]:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()

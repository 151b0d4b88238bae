"""LoRA serving cost on the CPU: 16 concurrent requests spread over 4 adapters against the same 16
requests on the base model, and the time an adapter takes to swap into a slot.

    python -m bench.lora [--clients 16] [--adapters 4] [--rank 16] [--targets all]
        [--prompt-len 64] [--gen-len 64] [--reps 3] [--wait-quiet S] [--json out.json]

Base: a random-weight bf16 Llama with SmolLM2-135M's shapes (hidden 576, 30 layers, 9 query and
3 KV heads, intermediate 1536, vocabulary 49152, tied embeddings), made once under bench/.cache/.
Adapters: PEFT-format directories (adapter_config.json + adapter_model.safetensors, written here)
of rank --rank on every projection (--targets all: q/k/v/o/gate/up/down) or on q and v (--targets
qv, PEFT's default for Llama), with random A and B.

One engine (--enable-lora, --max-loras = --adapters, prefix caching off so the reps compute the
same work) runs both rows, interleaved rep by rep: `base` sends the 16 requests with no adapter,
`lora` the same prompts with request i on adapter i % 4; the whole batch is submitted at once
and timed to its last token (prefill, then decode of --gen-len tokens each, greedy, ignore_eos).
The ratio is lora time over base time per rep (median, and best rep over best rep), in wall time
and in this process's CPU time: on a machine other processes load, wall time counts the time they
took the cores, CPU time does not (with OMP_NUM_THREADS=1, no thread waits on another: the
cleanest figure there).
`swap` is the time to copy one adapter into a slot (every projection of every layer), measured
over the swaps of a run with --max-loras 1 where the adapters take turns.

On a shared machine each rep prints the share of the CPUs other processes used meanwhile
(`[others: N%]`); --wait-quiet S waits up to S seconds for a quiet machine before each rep.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.make_checkpoint import CACHE, f32_to_bf16_bits, make_tensor, write_safetensors
from bench.throughput import OtherLoad, machine_info, wait_quiet

SEED = 20261128
BASE_NAME = "smollm2-135m-shape-random-bf16"
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qv": ["q_proj", "v_proj"]}


def module_shape(name: str, c: dict) -> tuple[int, int]:
    """(in, out) of a Llama projection."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[name]


def make_base(cache: Path = CACHE) -> Path:
    d = cache / BASE_NAME
    if (d / "model.safetensors").is_file():
        return d
    c, rng = CONFIG, np.random.default_rng(SEED)
    names = [("model.embed_tokens.weight", (c["vocab_size"], c["hidden_size"]))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        names += [(p + "input_layernorm.weight", (c["hidden_size"],)),
                  (p + "post_attention_layernorm.weight", (c["hidden_size"],))]
        names += [(p + ("self_attn." if m[0] in "qkvo" else "mlp.") + m + ".weight",
                   module_shape(m, c)[::-1]) for m in TARGETS["all"]]
    names.append(("model.norm.weight", (c["hidden_size"],)))
    tensors = [(n, f32_to_bf16_bits(make_tensor(rng, n, s))) for n, s in names]
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    write_safetensors(d / "model.safetensors", tensors, "BF16")
    return d


def make_adapter(path: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT adapter directory as peft's save_pretrained writes it (float32 weights)."""
    if (path / "adapter_model.safetensors").is_file():
        return path
    c, rng = CONFIG, np.random.default_rng(seed)
    tensors = []
    for n in range(c["num_hidden_layers"]):
        for m in targets:
            fan_in, fan_out = module_shape(m, c)
            where = f"base_model.model.model.layers.{n}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}"
            a = rng.uniform(-1, 1, (rank, fan_in)) / np.sqrt(fan_in)
            b = 0.02 * rng.standard_normal((fan_out, rank))
            tensors += [(f"{where}.{m}.lora_A.weight", a.astype(np.float32)),
                        (f"{where}.{m}.lora_B.weight", b.astype(np.float32))]
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none", "base_model_name_or_path": BASE_NAME}, indent=2))
    write_safetensors(path / "adapter_model.safetensors", tensors, "F32")
    return path


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def run_batch(llm, prompts, names, gen_len: int) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, tokens generated) of one generate call."""
    from engine import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True, lora_name=n)
              for n in names]
    start, cpu = time.perf_counter(), cpu_seconds()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return wall, cpu, sum(len(o.token_ids) for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=list(TARGETS), default="all")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wait-quiet", type=float, default=0.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from engine import LLM
    base = make_base()
    adapters = {f"lora{i}": str(make_adapter(
        CACHE / f"{BASE_NAME}-lora{i}-r{args.rank}-{args.targets}", args.rank,
        TARGETS[args.targets], SEED + 1 + i)) for i in range(args.adapters)}
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(3, CONFIG["vocab_size"], args.prompt_len).tolist()
               for _ in range(args.clients)]
    lora_names = [f"lora{i % args.adapters}" for i in range(args.clients)]
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, Taper ISA {info['taper_isa']}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"base {base.name}; {args.adapters} adapters of rank {args.rank} on {args.targets}; "
          f"{args.clients} requests of {args.prompt_len} prompt + {args.gen_len} output tokens")

    llm = LLM(str(base), dtype="bf16", enable_prefix_caching=False, max_num_seqs=args.clients,
              lora=dict(modules=adapters, max_loras=args.adapters, max_lora_rank=args.rank))
    run_batch(llm, prompts[:2], [None, lora_names[0]], 4)          # warm up both paths
    rows = {"base": [], "lora": []}
    for rep in range(args.reps):
        for row, names in (("base", [None] * args.clients), ("lora", lora_names)):
            if args.wait_quiet:
                wait_quiet(args.wait_quiet)
            probe = OtherLoad()
            wall, cpu, tokens = run_batch(llm, prompts, names, args.gen_len)
            others = probe.fraction()
            rows[row].append({"wall_s": wall, "cpu_s": cpu, "tok_s": tokens / wall,
                              "others": others})
            print(f"  rep {rep + 1} {row:4}: {tokens / wall:7.1f} tok/s ({wall:.2f} s wall, "
                  f"{cpu:.2f} s CPU) [others: {100 * others:.0f}%]", flush=True)
    for key, what in (("wall_s", "wall time"), ("cpu_s", "CPU time")):
        ratios = [lo[key] / b[key] for b, lo in zip(rows["base"], rows["lora"])]
        best = {row: min(r[key] for r in runs) for row, runs in rows.items()}
        print(f"lora/base {what} per rep: {', '.join(f'{r:.3f}' for r in ratios)}; median "
              f"{statistics.median(ratios):.3f} (lora {100 * (statistics.median(ratios) - 1):+.1f}%"
              f"); best reps: lora/base {best['lora'] / best['base']:.3f}")

    # swap time: one slot, the adapters take turns
    swapper = LLM(str(base), dtype="bf16", enable_prefix_caching=False, max_num_seqs=args.clients,
                  lora=dict(modules=adapters, max_loras=1, max_lora_rank=args.rank))
    for i in range(2 * args.adapters):
        run_batch(swapper, prompts[:1], [f"lora{i % args.adapters}"], 2)
    manager = swapper.engine.lora
    swap_ms = 1000 * manager.swap_seconds / manager.num_swaps
    mb = next(iter(manager.adapters())).nbytes / 2**20
    print(f"swap: {swap_ms:.1f} ms per adapter ({manager.num_swaps} swaps; {mb:.1f} MB of "
          f"float32 A and B^T each on the host, into {manager.dtype.name} slots of rank "
          f"{args.rank})")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": info, "args": vars(args), "rows": rows,
            "swap_ms": swap_ms, "swaps": manager.num_swaps}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

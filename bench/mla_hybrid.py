"""Multi-head latent attention and hybrid linear attention on the CPU (issue 29's benchmarks),
beside llama.cpp on the same weights, in one run.

    python -m bench.mla_hybrid [--llama-site DIR] [--llama-cpp SRC] [--prompt-len 128]
        [--gen-len 32] [--reps 2] [--turns 5] [--moe-loop] [--speed-only] [--json out.json]

Models (random weights from transformers, written once under bench/.cache/mla_hybrid/):
  deepseek_v2_lite  DeepSeek-V2-Lite's architecture at 1/8 of its width: hidden 256, 16 heads,
                    kv_lora_rank 64, qk_nope 16, qk_rope 8, v 16 (each 1/8 of 2048, 512, 128, 64,
                    128), no q_lora_rank, 64 routed experts (moe_intermediate 176), 6 active, 2
                    shared, softmax routing, the first layer dense (intermediate 1368),
                    vocabulary 12800; all 27 layers (llama.cpp tells V2-Lite's layout, no
                    q_lora_rank, from 27 or 26 layers and refuses the file otherwise)
  qwen3_next        Qwen3-Next-80B-A3B's at 1/8: hidden 256, gated attention 16 query / 2 KV
                    heads of 32 (a quarter rotated), gated DeltaNet 16 key / 32 value heads of 16,
                    convolution 4, three linear layers then one full, experts of 64 with a
                    shared expert of 64, 10 active, vocabulary 18992; 8 layers (of 48) and 128
                    experts (of 512), to fit the machine
  mha               a plain Llama with deepseek_v2_lite's size (hidden 256, 27 layers, 16 heads of
                    16, every head its own K/V): only its KV pool is read
llama.cpp's own converter (convert_hf_to_gguf.py of the source tree --llama-cpp, default the
llama-cpp-python 0.3.36 sdist's vendor/llama.cpp; `--no-mtp`, the checkpoints have no MTP head)
writes each as an f32 GGUF. Both engines run that file for figure 1 (Taper reads deepseek2
and qwen3next GGUFs: engine/loader/gguf_deepseek.py, gguf_hybrid.py); llama.cpp is
llama-cpp-python, importable or found under --llama-site. Figures 2 and 3 read Taper's pools and
run the safetensors checkpoint the file was converted from (the same float32 values).

Figures:
1. Decode and prefill tok/s, batch 1, greedy: --prompt-len random tokens then --gen-len tokens
   (bench.throughput's taper_run and llama_cpp_greedy_run: prefill = the prompt's one step or
   eval, decode = the tokens after the first over their steps), best of --reps after a warm-up;
   llama.cpp with n_threads 1 and the cores (--llama-threads), the faster kept per phase (on a
   shared machine OpenMP's spinning threads lose most when another process takes a core); the
   ratios Taper / llama.cpp and how many greedy tokens
   the two agree on. --moe-loop: Taper a second time with its MoE blocks on the loop over
   experts (one linear per expert from Python, the path before the one-call moe_experts kernel),
   for the old/new ratio in the same run.
2. KV bytes per token, read from each engine's pool (the runner's kv_caches: bytes / pool
   tokens): DeepSeek's latent cache against the plain-MHA model, and what DeepSeek's K/V would
   take up-projected (heads x (qk_nope + qk_rope + v)); Qwen3-Next's full-attention K/V per token
   and its linear layers' state per sequence.
3. Hybrid multi-turn: a conversation of --turns turns on qwen3_next (a 256-token first prompt;
   each turn then adds the reply of 32 tokens and 40 new user tokens), the same token sequences
   replayed by three engines: prefix caching with state snapshots (the default), prefix caching
   with state_snapshots=0 (the history's blocks are cached but no linear-layer state is, so every
   hit is cut back to nothing), and no prefix caching, each replay on a fresh engine, the best
   of --reps per turn. Time to first token of each turn (the engine steps until the request's
   first token) and the prompt tokens the cache gave it.

The machine may be shared: each figure prints the CPU share others took meanwhile
(bench.throughput.OtherLoad), and the load average is printed at start and end.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.throughput import (OtherLoad, describe, keep_best, llama_cpp_greedy_run,
                              machine_info, same_prefix, taper_run)

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "mla_hybrid"
LLAMA_CPP_SRC = "/work/llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp"
SEED = 29

MODELS = {
    "deepseek_v2_lite": ("DeepseekV2Config", dict(
        hidden_size=256, intermediate_size=1368, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, moe_intermediate_size=176, first_k_dense_replace=1,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
        vocab_size=12800, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "qwen3_next": ("Qwen3NextConfig", dict(
        hidden_size=256, intermediate_size=640, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=128, num_experts_per_tok=10, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[],
        vocab_size=18992, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "mha": ("LlamaConfig", dict(
        hidden_size=256, intermediate_size=1368, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, head_dim=16, vocab_size=12800, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
}

# The conversation of figure 3.
FIRST_PROMPT, REPLY, USER_TURN = 256, 32, 40


def _tests_helpers():
    """tests/checkpoints.py's scale_weights and tests/data/make_gguf_fixtures.py's tokenizer and
    converter wrapper (they import their neighbours as top-level modules, as pytest does)."""
    for sub in ("tests", "tests/data"):
        if str(ROOT / sub) not in sys.path:
            sys.path.insert(0, str(ROOT / sub))
    import make_gguf_fixtures
    from checkpoints import scale_weights
    return scale_weights, make_gguf_fixtures


def make_checkpoint(name: str) -> Path:
    """The transformers checkpoint of MODELS[name] (float32, a byte-level tokenizer for the
    converter), made once."""
    out = CACHE / name
    if (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    scale_weights, maker = _tests_helpers()
    out.mkdir(parents=True, exist_ok=True)
    ids = maker.build_bytelevel_tokenizer(str(out))
    cls, kwargs = MODELS[name]
    config = getattr(transformers, cls)(**kwargs, bos_token_id=ids["bos_token_id"],
                                        eos_token_id=ids["eos_token_id"])
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    # the tests' scaling (linear weights x 4, norms about 1): logits that vary from token to
    # token, so the two engines' greedy tokens say something
    scale_weights(model, scale=4.0, seed=SEED)
    model.save_pretrained(str(out))
    return out


def make_gguf(name: str, llama_cpp_src: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on the checkpoint: an f32 GGUF, made once."""
    out = CACHE / f"{name}-f32.gguf"
    if out.is_file():
        return out
    src = make_checkpoint(name)
    _, maker = _tests_helpers()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)      # the gguf-py that ships with the converter
    tmp = out.with_suffix(".part")
    extra = ["--no-mtp"] if name == "qwen3_next" else []
    res = subprocess.run([sys.executable, "-c", maker.CONVERT_WRAPPER.format(src=llama_cpp_src),
                          *extra, "--outtype", "f32", "--outfile", str(tmp), str(src)],
                         env=env, cwd=llama_cpp_src, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {name} ({res.returncode})")
    tmp.rename(out)
    return out


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    # ids below the byte-level tokenizer's specials (480..484), so no EOS/BOS lands in a prompt
    return np.random.default_rng(seed).integers(3, min(vocab, 480), length).tolist()


# ---- 1. decode and prefill against llama.cpp

def loop_over_experts(llm) -> int:
    """Puts every MoE block of the engine on the loop over experts (pyx/moe.py's
    _experts_one_by_one, what the CPU ran before moe_experts); returns how many."""
    from pyx.moe import MoE
    blocks = [o for o in gc.get_objects() if isinstance(o, MoE) and o.one_call]
    for b in blocks:
        b.one_call, b.gate_up, b.down = False, b.gate_up.experts, b.down.experts
    return len(blocks)


def taper_speed(gguf: Path, vocab: int, prompt_len: int, gen_len: int, reps: int,
                moe_loop: bool = False) -> dict:
    from engine import LLM
    llm = LLM(str(gguf.parent), weight_file=gguf.name, backend="cpu", max_num_seqs=2,
              kv_cache_memory_mb=128,
              max_num_batched_tokens=max(1024, prompt_len), enable_prefix_caching=False)
    label = "taper"
    if moe_loop:
        label = f"taper, loop over experts ({loop_over_experts(llm)} blocks)"
    taper_run(llm, [random_prompt(16, vocab, SEED + 99)], 4)              # warm-up
    best = None
    for r in range(reps):
        cur = taper_run(llm, [random_prompt(prompt_len, vocab, SEED + r)], gen_len)
        print(describe(f"{label} {gguf.stem}", cur), flush=True)
        best = keep_best(best, cur)
    del llm
    gc.collect()
    return best


def llama_speed(gguf: Path, vocab: int, prompt_len: int, gen_len: int, reps: int,
                threads: int) -> dict:
    import llama_cpp
    n_ctx = 64 * ((prompt_len + gen_len + 16 + 63) // 64)
    llm = llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    llama_cpp_greedy_run(llm, random_prompt(16, vocab, SEED + 99), 4)   # warm-up
    best = None
    for r in range(reps):
        cur = llama_cpp_greedy_run(llm, random_prompt(prompt_len, vocab, SEED + r), gen_len)
        print(describe(f"llama.cpp {gguf.stem}, {threads} threads", cur), flush=True)
        best = keep_best(best, cur)
    llm.close()
    gc.collect()
    return best


# ---- 2. KV bytes per token

def pool_bytes_per_token(model_dir: Path) -> dict:
    """The engine's KV pool, read back: bytes per token (each array once: MLA hands one latent
    array as both K and V), and for a hybrid model the state bytes per sequence slot."""
    from engine import LLM
    llm = LLM(str(model_dir), backend="cpu", num_kv_blocks=8, block_size=16, max_num_seqs=2)
    runner, config = llm.engine.runner, llm.engine.model_config
    tokens = 8 * 16
    kv, state, seen = 0, 0, set()
    la = config.linear_attention
    kinds = la.layer_types if la is not None else ["full_attention"] * len(runner.kv_caches)
    for kind, arrays in zip(kinds, runner.kv_caches):
        for a in arrays:
            if id(a) in seen:
                continue
            seen.add(id(a))
            if kind == "full_attention":
                kv += a.nbytes
            else:
                state += a.nbytes
    out = {"kv_bytes_per_token": kv / tokens,
           "kv_layers": sum(k == "full_attention" for k in kinds)}
    if la is not None:
        rows = runner.kv_caches[kinds.index("linear_attention")][0].shape[0]
        out.update(state_rows=rows, state_bytes_per_row=state / rows)
    del llm
    gc.collect()
    return out


# ---- 3. hybrid multi-turn time to first token

def _first_token(llm, prompt: list[int], max_tokens: int) -> dict:
    """One request: time from add_request to the step that yields its first token, then the
    rest of its generation; the prompt tokens the prefix cache gave it."""
    from engine import SamplingParams
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rid = f"turn-{time.monotonic_ns()}"
    load = OtherLoad()
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, params)
    ttft, final = None, None
    while eng.has_unfinished():
        for o in eng.step():
            if ttft is None and o.new_token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                final = o
    return {"ttft_s": ttft, "prompt_tokens": len(prompt),
            "cached_tokens": final.num_cached_tokens, "tokens": list(final.token_ids),
            "other_load": load.fraction()}


def multi_turn(model_dir: Path, vocab: int, turns: int, reps: int) -> dict:
    from engine import LLM
    rng = np.random.default_rng(SEED + 7)
    variants = {"snapshots": dict(enable_prefix_caching=True),
                "prefix cache, no snapshots": dict(enable_prefix_caching=True, state_snapshots=0),
                "no prefix cache": dict(enable_prefix_caching=False)}
    def fresh(kw):
        llm = LLM(str(model_dir), backend="cpu", max_num_seqs=2, kv_cache_memory_mb=256,
                  max_num_batched_tokens=2048, **kw)
        _first_token(llm, random_prompt(16, vocab, SEED + 98), 2)          # warm-up
        return llm

    # the conversation, made once by the default engine's replies
    llm, prompts = fresh(variants["snapshots"]), []
    history = random_prompt(FIRST_PROMPT, vocab, SEED + 5)
    for _ in range(turns):
        prompts.append(history)
        reply = _first_token(llm, history, REPLY)["tokens"]
        history = history + reply + rng.integers(3, 480, USER_TURN).tolist()
    del llm
    gc.collect()
    res = {}
    for label, kw in variants.items():
        rows = None
        for _ in range(reps):     # each replay on a fresh engine; the best TTFT per turn kept
            llm = fresh(kw)
            cur = [_first_token(llm, p, REPLY) for p in prompts]
            for i, r in enumerate(cur):
                print(f"  {label:27} turn {i + 1}: prompt {r['prompt_tokens']:4}, reused "
                      f"{r['cached_tokens']:4}, TTFT {1e3 * r['ttft_s']:7.1f} ms  "
                      f"[others: {100 * r['other_load']:.0f}% CPU]", flush=True)
            rows = cur if rows is None else [min(a, b, key=lambda r: r["ttft_s"])
                                             for a, b in zip(rows, cur)]
            del llm
            gc.collect()
        res[label] = rows
    same = all(a["tokens"] == b["tokens"] for rows in res.values()
               for a, b in zip(rows, res["snapshots"]))
    return {"turns": res, "same_tokens": same}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-site", metavar="DIR",
                    help="a site-packages directory holding llama_cpp (appended to sys.path)")
    ap.add_argument("--llama-cpp", default=LLAMA_CPP_SRC, metavar="SRC",
                    help="llama.cpp source tree whose convert_hf_to_gguf.py writes the GGUFs")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--llama-threads", nargs="+", type=int, default=None,
                    help="llama.cpp n_threads to try, the best kept per phase (default: 1 and "
                         "the number of cores)")
    ap.add_argument("--moe-loop", action="store_true",
                    help="figure 1 also times Taper on the loop over experts (the old path)")
    ap.add_argument("--speed-only", action="store_true", help="figure 1 only")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.llama_site:
        sys.path.append(args.llama_site)
    llama = importlib.util.find_spec("llama_cpp") is not None
    cores = len(os.sched_getaffinity(0))
    info = machine_info()
    print(f"{info['cpu']}, {cores} cores, load average {os.getloadavg()}, llama.cpp: "
          f"{info['llama_cpp'] or 'not importable (--llama-site DIR)'}", flush=True)
    result = {"machine": info, "speed": {}}

    print(f"1. decode and prefill, batch 1, prompt {args.prompt_len}, {args.gen_len} generated "
          f"(f32 weights; best of {args.reps}):", flush=True)
    for name in ("deepseek_v2_lite", "qwen3_next"):
        vocab = MODELS[name][1]["vocab_size"]
        gguf = make_gguf(name, args.llama_cpp)
        row = {"taper": taper_speed(gguf, vocab, args.prompt_len, args.gen_len, args.reps)}
        if args.moe_loop:
            row["taper_moe_loop"] = taper_speed(gguf, vocab, args.prompt_len, args.gen_len,
                                                args.reps, moe_loop=True)
            old, new = row["taper_moe_loop"], row["taper"]
            print(f"  {name}: moe_experts / loop over experts: prefill "
                  f"{new['prefill_tok_s'] / old['prefill_tok_s']:.2f}x, decode "
                  f"{new['decode_tok_s'] / old['decode_tok_s']:.2f}x, decode CPU per token "
                  f"{old['decode_cpu_ms'] / new['decode_cpu_ms']:.2f}x ({new['decode_cpu_ms']:.1f} "
                  f"vs {old['decode_cpu_ms']:.1f} ms); greedy tokens agree for "
                  f"{same_prefix(new['tokens'], old['tokens'])} of {len(new['tokens'])}",
                  flush=True)
        if llama:
            row["llama"] = None
            for th in args.llama_threads or sorted({1, cores}):
                cur = llama_speed(gguf, vocab, args.prompt_len, args.gen_len, args.reps, th)
                cur.update(prefill_threads=th, decode_threads=th)
                if row["llama"] is None:
                    row["llama"] = cur
                    continue
                for phase in ("prefill", "decode"):      # the best thread count per phase
                    if cur[f"{phase}_tok_s"] > row["llama"][f"{phase}_tok_s"]:
                        row["llama"].update({k: v for k, v in cur.items()
                                             if k.startswith(phase)})
            t, ll = row["taper"], row["llama"]
            agree = same_prefix(t["tokens"], ll["tokens"])
            print(f"  {name}: Taper / llama.cpp prefill "
                  f"{t['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x ({t['prefill_tok_s']:.0f} vs "
                  f"{ll['prefill_tok_s']:.0f} tok/s), decode "
                  f"{t['decode_tok_s'] / ll['decode_tok_s']:.2f}x ({t['decode_tok_s']:.1f} vs "
                  f"{ll['decode_tok_s']:.1f} tok/s; llama.cpp threads {ll['prefill_threads']} / "
                  f"{ll['decode_threads']}), decode CPU per token "
                  f"{ll['decode_cpu_ms'] / t['decode_cpu_ms']:.2f}x ({t['decode_cpu_ms']:.1f} vs "
                  f"{ll['decode_cpu_ms']:.1f} ms); greedy tokens agree for {agree} of "
                  f"{len(t['tokens'])}", flush=True)
            row["tokens_agree"] = agree
        result["speed"][name] = row
    if args.speed_only:
        finish(result, args.json)
        return

    print("2. KV bytes per token (the engine's pools, f32):", flush=True)
    kv = {name: pool_bytes_per_token(make_checkpoint(name))
          for name in ("deepseek_v2_lite", "mha", "qwen3_next")}
    ds = MODELS["deepseek_v2_lite"][1]
    up = (ds["num_attention_heads"] * (ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"]
                                       + ds["v_head_dim"]) * 4 * ds["num_hidden_layers"])
    kv["deepseek_v2_lite"]["up_projected_kv_bytes_per_token"] = up
    for name, r in kv.items():
        extra = (f", state {r['state_bytes_per_row'] / 1024:.1f} KiB per sequence"
                 if "state_rows" in r else "")
        print(f"  {name:17} {r['kv_bytes_per_token']:8.0f} B/token over {r['kv_layers']} "
              f"attention layers{extra}", flush=True)
    mla = kv["deepseek_v2_lite"]["kv_bytes_per_token"]
    print(f"  MLA / MHA: {mla / kv['mha']['kv_bytes_per_token']:.3f}; MLA / its own K/V "
          f"up-projected ({up} B/token): {mla / up:.3f}", flush=True)
    result["kv"] = kv

    print(f"3. qwen3_next multi-turn, {args.turns} turns, time to first token:", flush=True)
    mt = multi_turn(make_checkpoint("qwen3_next"), MODELS["qwen3_next"][1]["vocab_size"],
                    args.turns, args.reps)
    last = {k: rows[-1] for k, rows in mt["turns"].items()}
    base = last["snapshots"]["ttft_s"]
    print("  turn %d TTFT: " % args.turns + ", ".join(
        f"{k} {1e3 * v['ttft_s']:.1f} ms ({v['ttft_s'] / base:.2f}x)" for k, v in last.items())
        + f"; replies identical across the three: {mt['same_tokens']}", flush=True)
    result["multi_turn"] = mt
    finish(result, args.json)


def finish(result: dict, json_path: str | None):
    result["loadavg_end"] = os.getloadavg()
    print(f"load average at the end {result['loadavg_end']}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()

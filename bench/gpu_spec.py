"""Speculative decoding on the GPU (issue 30): decode tokens/s at batch 1 and 8 with prompt lookup
(n-gram) and with a draft model, against no speculation, with CUDA graphs over the verify steps off
and on (KernelConfig graphs_verify), in one run; acceptance, tokens per verify step, and the
weight-read bound of the steps each row took.

    python -m bench.gpu_spec [--k 4] [--gen-len 128] [--batch 1 8] [--graphs-verify off on]
        [--draft-agreement 0.7] [--edit-rate 0.05] [--json FILE]
    python -m bench.gpu_spec --backend cpu --tiny      # the same rows on the CPU, tiny shapes

Weights are random and made on the device (no real model reaches the GPU machine): a target of
Llama-3-8B's shapes and a draft of Llama-3.2-1B's (its lm_head untied, which reads the same bytes
a step), one vocabulary of 128256 ids. Left to chance, a random draft agrees with a random target
on next to no token, and a random model's greedy output loops or not as it happens; so the values
are chosen to set the acceptance instead, while every weight is still read and every product
computed as in any checkpoint of those shapes (dense bf16 kernels take the same time whatever the
values):
  - each layer's o_proj and down_proj are zero, so the residual stream is the token's embedding
    row and the greedy next token a function of the last token; lm_head row v is embedding row
    v - 1, so that function is t -> t + 1 (at 4096 dims the embedding row's product with itself
    is ~64 standard deviations of its products with the other rows, whose largest is ~5): the
    target counts, whatever the context;
  - the draft counts the same way, except from the tokens a fraction 1 - draft_agreement of the
    ids (chosen at random) whose embedding rows are negated: from those it proposes another id.
    Along the count each draft is then accepted with probability draft_agreement until the
    first rejection: the geometric model of a real draft's acceptance;
  - each prompt is a run of the count with a fraction edit_rate of its ids replaced by random ones
    (an edited copy of what the output will be: code editing's case), ending with the run's first
    two ids again, so the output repeats the prompt from there and the n-gram lookup finds it
    except around the edits.
The expected output is known (the count from the prompt's last id): every row checks its greedy
tokens against it, speculation or not.

Rows, per batch size B: none (no speculation: the decode graphs), ngram and draft_model with
num_speculative_tokens k, each under graphs_verify off and on (a decode-only verify step replays
the k + 1 graph, sequences with fewer drafts padded with filler rows; `graphs` counts the replays
of decode and verify graphs over the decode steps). The backends differ in graphs_verify, which a backend reads once,
so the weights are made once per setting. Decode tok/s = tokens after each sequence's first / the
time after the step that gave every sequence its first. `bound`: the same steps at the copy
bandwidth measured in the run (decode steps x the target's weight bytes, plus the draft forwards x
the draft's, over bandwidth): at B=1 without speculation bench.gpu_throughput's batch-1 roofline.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import traceback
from collections import Counter

import numpy as np

from bench.gpu_throughput import LLAMA3_8B, copy_bandwidth

LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001,
}
# The CPU smoke test's shapes: small, but wide enough (128) that t -> t + 1 wins by a margin
TINY_TARGET = {**LLAMA3_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "vocab_size": 2048, "max_position_embeddings": 1024, "rope_scaling": None}
TINY_DRAFT = {**TINY_TARGET, "num_hidden_layers": 1}
METHODS = ("none", "ngram", "draft_model")
SEED = 20261129


# ---- the weights

def counting_weights(xp, config, expected_shapes, seed: int, dtype, agreement: float = 1.0,
                     std: float = 0.02) -> dict:
    """Every tensor of a Llama graph whose greedy next token is t + 1 (mod V) for a fraction
    `agreement` of the ids t and another id for the rest (module docstring): random
    N(0, std^2) matrices, norm weights 1, o_proj and down_proj zero, lm_head row v = embedding
    row v - 1, then the embedding rows of the disagreeing ids negated. Made with `xp` (CuPy on
    the device, NumPy on the CPU), matrices cast to `dtype`."""
    if config.tie_word_embeddings:
        raise ValueError("counting weights need an untied lm_head (its rows are the embedding's "
                         "shifted by one id)")
    # every operation in float32, then a cast: the one path bench.gpu_throughput's bf16 arrays
    # take on the device
    rng = xp.random.default_rng(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = xp.ones(shape, xp.float32)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = xp.zeros(shape, xp.float32).astype(dtype)
        elif name not in ("lm_head.weight", "model.embed_tokens.weight"):
            w = rng.standard_normal(shape, dtype=xp.float32)
            w *= std
            weights[name] = w.astype(dtype)
            del w
    embed = rng.standard_normal((config.vocab_size, config.hidden_size), dtype=xp.float32)
    embed *= std
    weights["lm_head.weight"] = xp.roll(embed, 1, axis=0).astype(dtype)
    if agreement < 1.0:
        wrong = xp.asarray(np.random.default_rng(seed + 1).random(config.vocab_size) >= agreement)
        embed = xp.where(wrong[:, None], -embed, embed)
    weights["model.embed_tokens.weight"] = embed.astype(dtype)
    return weights


def expected_per_verify(agreement: float, k: int) -> float:
    """Tokens a verify step of k drafts gives when each is accepted with probability `agreement`
    until the first rejection: 1 + a + ... + a^k."""
    return sum(agreement ** i for i in range(k + 1))


def step_bytes(config, expected_shapes, itemsize: int) -> int:
    """Weight bytes one decode step reads: every matrix but the embedding table (a step reads its
    tokens' rows), and the f32 norm weights."""
    total = 0
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            total += 4 * shape[0]
        elif name != "model.embed_tokens.weight":
            total += itemsize * shape[0] * shape[1]
    return total


def host_copy_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """A NumPy copy's bytes read + written per second (median): the CPU smoke run's bound."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(times))


# ---- prompts and runs

def counting_prompts(rng, vocab: int, count: int, length: int, edit_rate: float):
    """(prompts, expected outputs' first ids): each an edited run c, c+1, ... of `length` ids
    (mod V; the first two kept), then c, c+1 again; the target's output is c+2, c+3, ... The runs
    lie apart, so no sequence's lookup finds another's."""
    stride = vocab // count
    prompts, starts = [], []
    for i in range(count):
        c = i * stride + int(rng.integers(0, max(1, stride - length)))
        run = (c + np.arange(length)) % vocab
        edits = rng.random(length) < edit_rate
        edits[:2] = False
        run[edits] = rng.integers(0, vocab, int(edits.sum()))
        prompts.append(run.tolist() + [c % vocab, (c + 1) % vocab])
        starts.append((c + 2) % vocab)
    return prompts, starts


def count_replays(engine) -> Counter | None:
    """Graph replays by query length (1: decode, k + 1: verify), counted from here on; None
    without graphs."""
    from engine.runner.cuda_graph import uniform_query_len
    graphs = engine.runner.graph_runner
    if graphs is None:
        return None
    counts = Counter()
    replay = graphs.run

    def counted(batch, key=None):
        q = uniform_query_len(batch)       # None: uneven drafts, padded into the verify graph
        counts[graphs.pad_query_len if q is None else q] += 1
        return replay(batch, key)
    graphs.run = counted
    return counts


def generate(engine, prompts: list, starts: list, gen_len: int, tag: str) -> dict:
    """Greedy, ignore_eos: decode tok/s, the steps, acceptance, and whether the tokens are the
    count they must be."""
    from engine.sampling.sampling_params import SamplingParams
    spec = engine.speculator
    stats0 = (spec.stats.num_drafts, spec.stats.num_draft_tokens,
              spec.stats.num_accepted_tokens) if spec else (0, 0, 0)
    draft = spec.draft_model if spec else None
    forwards0 = draft.num_forward_calls if draft is not None else 0
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in ids}
    first_at, decode_steps, draft_forwards = None, 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        if first_at is not None:
            decode_steps += 1
        for out in outs:
            if out.finish_reason == "error":    # the engine fails the step's requests, not us
                raise RuntimeError(f"request {out.request_id}: {out.error}")
            tokens[out.request_id] += out.new_token_ids
        if first_at is None and all(tokens.values()):
            first_at = time.perf_counter()
            if draft is not None:
                forwards0 = draft.num_forward_calls
    end = time.perf_counter()
    if draft is not None:
        draft_forwards = draft.num_forward_calls - forwards0
    decoded = sum(len(t) - 1 for t in tokens.values())
    vocab = engine.model_config.vocab_size
    expected = sum(int(np.sum(np.asarray(tokens[rid]) == (s + np.arange(len(tokens[rid])))
                              % vocab)) for rid, s in zip(ids, starts))
    res = {"decode_tok_s": decoded / (end - first_at), "decode_s": end - first_at,
           "decoded": decoded,
           "decode_steps": decode_steps, "draft_forwards": draft_forwards,
           "expected_tokens": expected, "tokens": sum(len(t) for t in tokens.values())}
    if spec:
        s = spec.stats
        drafts, draft_tokens, accepted = (s.num_drafts - stats0[0],
                                          s.num_draft_tokens - stats0[1],
                                          s.num_accepted_tokens - stats0[2])
        res.update(acceptance=accepted / draft_tokens if draft_tokens else 0.0,
                   tokens_per_verify=1 + accepted / drafts if drafts else 1.0,
                   draft_tokens=draft_tokens)
    return res


def show(r: dict, base: dict | None) -> str:
    label = r["method"] + (f" k={r['k']}" if r["method"] != "none" else "")
    ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:5.2f}x none" if base else " " * 10
    acc = (f"  acceptance {100 * r['acceptance']:5.1f}%  tokens/verify "
           f"{r['tokens_per_verify']:4.2f}" if "acceptance" in r else "")
    graphs = r.get("graph_replays")
    replays = (f"  graphs {graphs.get('1', 0)} decode + {graphs.get(str(r['k'] + 1), 0)} "
               f"verify of {r['decode_steps']} steps" if graphs is not None else "")
    return (f"  B={r['batch']} {label:17} graphs_verify {r['graphs_verify']:3}: decode "
            f"{r['decode_tok_s']:8.1f} tok/s {ratio}  {r['vs_bound']:.2f} x bound "
            f"({r['bound_tok_s']:.0f}){acc}{replays}  tokens as expected "
            f"{r['expected_tokens']}/{r['tokens']}")


def run(backend_for, engine_backend: str = "cuda", batches=(1, 8), graphs_verify=("off", "on"),
        k: int = 4, gen_len: int = 128, draft_agreement: float = 0.7, edit_rate: float = 0.05,
        target_dict: dict = LLAMA3_8B, draft_dict: dict = LLAMA32_1B,
        json_rows: list | None = None) -> list[dict]:
    """Every row (module docstring). backend_for(graphs_verify) -> a backend with that setting;
    engine_backend: the EngineConfig's backend name ("cuda": CUDA graphs captured)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.models.llama import LlamaForCausalLM, expected_shapes
    from engine.models.model_config import ModelConfig
    from pyx.cpu_backend import CpuBackend

    if not 0.0 <= draft_agreement <= 1.0 or not 0.0 <= edit_rate < 1.0:
        raise ValueError(f"draft agreement must be in [0, 1] and edit rate in [0, 1), got "
                         f"{draft_agreement} and {edit_rate}")
    target_config = ModelConfig.from_dict(dict(target_dict))
    draft_config = ModelConfig.from_dict(dict(draft_dict))
    if target_config.vocab_size != draft_config.vocab_size:
        raise ValueError("the target and the draft must share one vocabulary")
    V, B_max = target_config.vocab_size, max(batches)
    prompt_len = gen_len + 2 * k + 8 + 2
    rng = np.random.default_rng(SEED)
    warm = counting_prompts(rng, V, B_max, 24 + 2 * k, edit_rate)
    measured = {B: counting_prompts(rng, V, B, prompt_len - 2, edit_rate) for B in batches}
    max_len = prompt_len + gen_len + 2 * k + 16
    block_size = 16
    cuda_graph = engine_backend == "cuda"
    # rows: json_rows as they come, so that an interrupted run (the step's time limit) keeps them
    rows, bases = (json_rows if json_rows is not None else []), {}
    for setting in graphs_verify:
        backend = backend_for(setting)
        on_cpu = isinstance(backend, CpuBackend)
        xp = np if on_cpu else backend.xp
        if on_cpu:
            dtype, itemsize, bandwidth, device = np.float32, 4, host_copy_bandwidth(), "CPU"
        else:
            import ml_dtypes
            dtype, itemsize, bandwidth = ml_dtypes.bfloat16, 2, copy_bandwidth(xp)
            props = xp.cuda.runtime.getDeviceProperties(backend.device.id)
            device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            device += f", {backend.num_sms} SMs, sm_{backend.device.compute_capability}"
        t0 = time.perf_counter()
        target = LlamaForCausalLM(target_config, counting_weights(
            xp, target_config, expected_shapes, SEED, dtype), backend)
        draft = LlamaForCausalLM(draft_config, counting_weights(
            xp, draft_config, expected_shapes, SEED + 2, dtype, draft_agreement), backend)
        backend.synchronize()
        made_s = time.perf_counter() - t0
        target_bytes = step_bytes(target_config, expected_shapes, itemsize)
        draft_bytes = step_bytes(draft_config, expected_shapes, itemsize)
        print(f"device: {device}; {datetime.date.today()}; kernels {backend.kernels}")
        print(f"weights read per decode step: target {target_bytes / 1e9:.3g} GB, draft "
              f"{draft_bytes / 1e9:.3g} GB (made and placed in {made_s:.1f} s); copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s; batch-1 bound {bandwidth / target_bytes:.0f} tok/s; "
              f"draft agreement {draft_agreement} (at k drafts "
              f"{expected_per_verify(draft_agreement, k):.2f} tokens a verify step), prompt "
              f"edits {edit_rate}, k = {k}, "
              f"{gen_len} tokens out of {prompt_len}-token prompts", flush=True)
        for method in METHODS:
            if method == "none" and setting != graphs_verify[0]:
                continue                # without drafts graphs_verify changes nothing
            spec = None if method == "none" else {"method": method, "num_speculative_tokens": k}
            if method == "draft_model":
                spec["model"] = "llama-3.2-1b-counting (made on the device)"
            config = EngineConfig(
                model="llama-3-8b-counting", backend=engine_backend,
                dtype="f32" if on_cpu else "bf16", max_num_seqs=B_max, cuda_graph=cuda_graph,
                max_num_batched_tokens=max(2048, B_max * (prompt_len + 8)),
                enable_prefix_caching=False, max_model_len=max_len,
                num_kv_blocks=B_max * -(-max_len // block_size) + 8, block_size=block_size,
                kernels=backend.kernels, speculative_config=spec)
            loaded = (backend, target, target_config) + (
                ((draft, draft_config),) if method == "draft_model" else ())
            common = {"device": device, "method": method, "graphs_verify": setting, "k": k,
                      "gen_len": gen_len, "prompt_len": prompt_len,
                      "draft_agreement": draft_agreement, "edit_rate": edit_rate,
                      "target_bytes_per_step": target_bytes, "draft_bytes_per_step": draft_bytes,
                      "bandwidth": bandwidth}
            engine = None
            try:    # one method failing on the device leaves the others' figures
                engine = LLMEngine(config, loaded=loaded)
                generate(engine, *warm, 16, f"warm-{method}")  # workspaces, cuBLAS, the cost model
                replays = count_replays(engine)
                for B in batches:
                    if replays is not None:
                        replays.clear()
                    r = generate(engine, *measured[B], gen_len, f"{method}-{B}")
                    bound = bandwidth * r["decoded"] / (r["decode_steps"] * target_bytes
                                                        + r["draft_forwards"] * draft_bytes)
                    row = {**common, "batch": B, "bound_tok_s": bound, **r,
                           "graph_replays": ({str(q): n for q, n in sorted(replays.items())}
                                             if replays is not None else None)}
                    row["vs_bound"] = row["decode_tok_s"] / bound
                    if method == "none":
                        bases[B] = row
                    elif B in bases:
                        row["vs_none"] = row["decode_tok_s"] / bases[B]["decode_tok_s"]
                    rows.append(row)
                    print(show(row, bases.get(B) if method != "none" else None), flush=True)
            except Exception as e:
                traceback.print_exc()
                rows.append({**common, "batch": None, "error": f"{type(e).__name__}: {e}"})
                print(f"FAILED: {method} graphs_verify {setting}: {rows[-1]['error']}",
                      flush=True)
            del engine
            gc.collect()
        # the device memory back before the other setting's weights are made
        del target, draft
        gc.collect()
        backend.synchronize()
        if not on_cpu:
            xp.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (the CPU smoke run) instead of Llama-3-8B and 3.2-1B's")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--graphs-verify", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--draft-agreement", type=float, default=0.7)
    p.add_argument("--edit-rate", type=float, default=0.05)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.backend == "cuda":
        from pyx.cuda_backend import CudaBackend

        def backend_for(setting):
            return CudaBackend(dtype="bf16", kernels=f"graphs_verify={setting}")
        settings = args.graphs_verify
    else:
        from pyx.cpu_backend import CpuBackend

        def backend_for(setting):
            return CpuBackend(kernels=f"graphs_verify={setting}")
        settings = ["off"]
        if "on" in args.graphs_verify:
            print("graphs_verify on: not run on the CPU (no CUDA graphs there)")
    shapes = (dict(target_dict=TINY_TARGET, draft_dict=TINY_DRAFT) if args.tiny else {})
    rows, interrupted = [], False
    try:
        run(backend_for, args.backend, args.batch, settings, args.k, args.gen_len,
            args.draft_agreement, args.edit_rate, json_rows=rows, **shapes)
    except KeyboardInterrupt:       # gpu_check.sh's timeout sends SIGINT first
        interrupted = True
        print(f"FAILED: interrupted after {len(rows)} rows; those are written", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    wrong = [r for r in rows if "error" not in r and r["expected_tokens"] != r["tokens"]]
    for r in wrong:
        print(f"FAILED: B={r['batch']} {r['method']} graphs_verify {r['graphs_verify']}: "
              f"{r['tokens'] - r['expected_tokens']} of {r['tokens']} greedy tokens are not the "
              f"count the weights make")
    return 1 if interrupted or wrong or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

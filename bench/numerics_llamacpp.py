"""Taper's and llama.cpp's logits and greedy tokens on the same quantized GGUF files, against the
exact reference: the file's own weights dequantized (by the `gguf` package, llama.cpp's Python
code) and run in float64 by transformers.

    LLAMACPP_SRC=/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        python -m bench.numerics_llamacpp            # makes the files on first use (bench/.cache)

Two tables.

Teacher-forced logits (`--quant`): a random Qwen2 (hidden 1024, 4 layers, 16 heads of 64, 4 KV
heads, intermediate 2816, a 32000-token tied embedding), written as F32 GGUF by llama.cpp's
converter and quantized by llama.cpp's own quantizer to Q8_0, Q6_K and Q4_K_M
(bench/make_checkpoint.py), its token_embd (the output too: tied) in the type the quantizer chose,
and kept F32 (`--embd-output file f32`, the default both; F32 is how --isq keeps them). All three
engines are teacher-forced on one token sequence (a random prompt, then the reference's greedy
continuation), so every step sees the same inputs: Taper and llama.cpp take the prompt in one
batch, then one token per step (the decode path), with an f32 KV cache on both. Distances per step
between each engine's logits and the reference's: max |diff| and RMS, and whether the argmax
agrees; the table shows their mean and worst over the steps.

Free-running greedy agreement (`--agreement-quant`): the tests' tiny Llama
(tests/data/gguf/llama-f32.gguf: hidden 256, 2 layers, 4 heads of 64, 2 KV heads, a 512-token tied
embedding, llama3 RoPE, Q/K rows permuted by the converter, weights scaled x8 so that one 8-bit
rounding moves the logits by tenths) through llama.cpp's quantizer, its token_embd/output as the
quantizer chose (Q8_0 in a Q8_0 file, Q6_K in the others) and kept F32, for every ftype of
bench.make_checkpoint.QUANT_FTYPES named (`--agreement-quant`; `--file` takes any Llama-family GGUF
with a tokenizer instead). For each of 64 prompts (32 long ones; `--prompts`: `chat`, the GGUF
fixtures' texts as a user turn of 12-60 tokens; `short`, BOS and 1-3 tokens, where Taper's prefill
rounds activations too; `long`, 600 characters of them in a user turn, past the 64-token original
context of the llama3 RoPE) the reference runs 24 greedy steps; its first near-tie (top-two margin
under 0.05) ends the steps that count. Each engine is teacher-forced on the reference's tokens;
since each is deterministic, the leading run of its argmax equal to the reference's is the number
of tokens its own free-running greedy decode agrees with the file's weights. `--per-op` adds Taper
with exact activations in one kind of matmul only, and in all but one (OpMixBackend), to say which
op's rounding moves them.

Taper runs three ways: by default (act_split=qkv: the decode matmuls round each activation row
to 8 bits once, in llama.cpp's blocks, except the attention's qkv projection, which writes it as
two 8-bit rows), with act_split=off (every matmul rounded, exactly llama.cpp's arithmetic) and
with act_split=on (every one as two rows, pyx/quant_kernels.c). `--per-layer` adds Taper's
residual stream against the reference's after each layer's attention and MLP.

Two checks beside the tables: `--matmul` runs one decode matmul per weight type through Taper and
through llama.cpp's own kernels (its libggml-cpu.so, via ctypes) and compares their activation
blocks byte for byte and their outputs with float64; `--step-time FILE...` times Taper's decode
step in each act_split mode (CPU time of the process, so that a shared machine's other load does
not count).

llama.cpp (llama-cpp-python) and torch are bench-only dependencies; nothing in the test suite
imports this file (tests/data/make_fidelity_fixtures.py does, to record what
tests/test_gguf_fidelity.py checks).
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.make_checkpoint import CACHE, QUANT_FTYPES, make_quant_gguf, tensor_shapes

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
SPLIT = "act_split=on"        # every decode matmul's activations as two 8-bit rows
ROUNDED = "act_split=off"     # every one rounded to 8 bits once, as llama.cpp does
MODES = {"taper": None, f"taper, {ROUNDED}": ROUNDED, f"taper, {SPLIT}": SPLIT}  # label: kernels


# ---- the three engines, teacher-forced on `tokens`; rows = logits predicting tokens[p+1:]

def reference_model(config: dict, weights: dict):
    """transformers' model of `config` (a Qwen2, a Llama) in float64 on the file's dequantized
    weights."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items()
                                 if k not in ("architectures", "model_type", "dtype",
                                              "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval()
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


def taper_model(config: dict, weights: dict, kernels: str | None = None, backend=None):
    """Taper's model of `config` on its CPU backend built with `kernels` (or on `backend`)."""
    from engine.models.model_config import ModelConfig
    from engine.models.registry import get_model_class
    from pyx.cpu_backend import CpuBackend

    mc = ModelConfig.from_dict(config)
    return get_model_class(mc.architecture)(mc, dict(weights),   # it takes the dict
                                            backend or CpuBackend(kernels=kernels))


def taper_logits(config: dict, weights: dict, tokens: list[int], prompt_len: int,
                 step_ms: list | None = None, kernels: str | None = None,
                 backend=None, model=None) -> np.ndarray:
    """Taper's CPU backend built with `kernels` (or `backend`, or a taper_model to reuse): the
    prompt in one forward, then one token per forward (each decode forward's wall time appended
    to step_ms)."""
    from engine.runner.forward_batch import ForwardBatch

    model = model or taper_model(config, weights, kernels, backend)
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


def llama_cpp_model(path: Path, n_ctx: int, threads: int):
    """llama.cpp on the file with an f32 KV cache, every position's logits kept."""
    from llama_cpp import Llama
    n_ctx = 64 * ((n_ctx + 63) // 64)
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                 logits_all=True, n_threads=threads, n_threads_batch=threads, seed=0,
                 verbose=False, type_k=0, type_v=0)     # GGML_TYPE_F32 KV cache


def llama_cpp_logits(path: Path, tokens: list[int], prompt_len: int, threads: int,
                     llm=None) -> np.ndarray:
    """llama.cpp on the same file: the prompt in one eval, then one token per eval; f32 KV.
    `llm`: a llama_cpp_model of the file to reuse (reset first)."""
    own = llm is None
    if own:
        llm = llama_cpp_model(path, len(tokens), threads)
    llm.reset()
    llm.eval(tokens[:prompt_len])
    rows = [np.array(llm.scores[prompt_len - 1], np.float64)]
    for t in tokens[prompt_len:-1]:
        llm.eval([t])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], np.float64))
    if own:
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


# ---- free-running greedy agreement: the tiny Llama, many prompts

TINY_LLAMA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf" / "llama-f32.gguf"
FIXTURE_MAKER = TINY_LLAMA.parent.parent / "make_gguf_fixtures.py"
AGREEMENT_QUANTS = ["q8_0", "q6_k", "q4_k_m"]
PROMPT_KINDS = ["chat", "short", "long"]
AGREEMENT_STEPS = 24
TIE = 0.05          # a reference step whose top two logits are closer than this is a near-tie
OPS = ["qkv", "o", "gate_up", "down", "lm_head"]


def tiny_llama(qtype: str, float_embd_output: bool = False, cache: Path = CACHE) -> Path:
    """The tiny Llama quantized by llama.cpp's quantizer (made once, under `cache`)."""
    tag = "-f32eo" if float_embd_output else ""
    return make_quant_gguf(qtype, src=TINY_LLAMA, out=cache / f"tiny-llama-{qtype}{tag}.gguf",
                           float_embd_output=float_embd_output, threads=2)


def prompt_texts() -> list[str]:
    """32 texts: the GGUF fixtures' corpus and the first 14 non-blank tokenizer test texts
    (tests/data/make_gguf_fixtures.py, loaded by its path: tests/data is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_gguf_fixtures", FIXTURE_MAKER)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker.CORPUS + [t for t in maker.TOKENIZER_TEXTS if t.strip()][:14]


def agreement_prompts(tokenizer, kind: str) -> list[list[int]]:
    """64 prompts (32 for `long`) of one kind (module docstring), as token ids."""
    texts = prompt_texts()

    def chat(text):
        return tokenizer.encode_chat([{"role": "user", "content": text}])
    if kind == "chat":
        return [chat(q) for t in texts for q in (t[:40], t)]
    if kind == "short":
        return [tokenizer.encode(t)[:2 + i % 3] for i, t in enumerate(texts * 2)]
    if kind == "long":
        return [chat(" ".join(texts[i:] + texts[:i])[:600]) for i in range(len(texts))]
    raise ValueError(f"prompt kind {kind!r}: expected one of {PROMPT_KINDS}")


def reference_greedy_logits(model, prompt: list[int], n: int) -> np.ndarray:
    """transformers' own greedy decode (KV cache) of n steps: each step's logits (n, vocab)."""
    import torch
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows = [out.logits[0, -1].numpy()]
        for _ in range(n - 1):
            out = model(torch.tensor([[int(np.argmax(rows[-1]))]]),
                        past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1].numpy())
    return np.array(rows, np.float64)


def trusted_steps(ref: np.ndarray, tie: float = TIE) -> int:
    """Leading steps of `ref` (n, vocab) before its first near-tie."""
    margins = top2_margins(ref)
    return next((i for i, m in enumerate(margins) if m < tie), len(margins))


def leading_agreement(rows: np.ndarray, ref_tokens: list[int], n: int) -> int:
    """How many of the first n steps' argmaxes equal ref_tokens before the first that does not:
    the tokens a free-running greedy decode shares with the reference (it is deterministic, so
    up to its first other token it sees the reference's inputs)."""
    same = np.argmax(rows[:n], -1) == np.asarray(ref_tokens[:n])
    return int(n if same.all() else np.argmin(same))


class OpMixBackend:
    """A CpuBackend for `taper_logits` whose quantized matmuls round activations to 8 bits except
    in the ops named in `exact` (act_split=on there). A Llama forward calls `linear` in a fixed
    order, qkv, o, gate_up, down for each layer, then lm_head: the call's place names its op."""

    def __init__(self, num_layers: int, exact):
        from pyx.cpu_backend import CpuBackend
        self.rounded, self.exact_backend = CpuBackend(kernels=ROUNDED), CpuBackend(kernels=SPLIT)
        self.order = OPS[:4] * num_layers + ["lm_head"]
        self.exact, self.calls = set(exact), 0
        unknown = self.exact - set(OPS)
        if unknown:
            raise ValueError(f"OpMixBackend: unknown ops {sorted(unknown)}; the ops are {OPS}")

    def __getattr__(self, name):
        return getattr(self.rounded, name)

    def linear(self, x, weight, bias, out):
        op = self.order[self.calls % len(self.order)]
        self.calls += 1
        backend = self.exact_backend if op in self.exact else self.rounded
        return backend.linear(x, weight, bias, out)


class ResidualProbe:
    """A backend proxy keeping, at each forward, the residual stream of the last token after
    each fused_add_rms_norm: in a Llama forward, after layer i's attention (its post-attention
    norm) and after its MLP (the next layer's input norm, or the final norm), 2 per layer."""

    def __init__(self, backend):
        self.inner, self.snapshots = backend, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        self.inner.fused_add_rms_norm(x, residual, weight, eps)
        self.snapshots.append(np.array(residual[-1], np.float64))


def reference_residuals(model, tokens: list[int]) -> np.ndarray:
    """transformers' residual stream after each layer's attention and MLP, every position:
    (2 * layers, positions, hidden), from hooks on the embedding, attention and layers."""
    import torch
    inner = model.model
    seen = {}
    hooks = [inner.embed_tokens.register_forward_hook(
        lambda m, a, out: seen.__setitem__("embed", out[0]))]
    for i, layer in enumerate(inner.layers):
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(("attn", i), out[0][0])))
        hooks.append(layer.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(
                ("layer", i), (out[0] if isinstance(out, tuple) else out)[0])))
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    out, before = [], seen["embed"]
    for i in range(len(inner.layers)):
        out += [before + seen[("attn", i)], seen[("layer", i)]]
        before = seen[("layer", i)]
    return np.stack([o.numpy() for o in out])


def residual_errors(path: Path, kind: str, steps: int = AGREEMENT_STEPS) -> dict:
    """Per engine (Taper, Taper act_split=on), the relative distance ||taper - ref|| / ||ref|| of
    the residual stream after each layer's attention and MLP, averaged over every decode step of
    every prompt (teacher-forced on the reference's greedy tokens)."""
    from pyx.cpu_backend import CpuBackend
    config, weights, deq = dequantized_weights(path)
    model = reference_model(config, deq)
    from engine.loader.gguf import read_gguf
    prompts = agreement_prompts(read_gguf(str(path), progress=False).tokenizer, kind)
    errors = {label: [] for label in MODES}
    probes = {label: ResidualProbe(CpuBackend(kernels=k)) for label, k in MODES.items()}
    models = {label: taper_model(config, weights, backend=probe)
              for label, probe in probes.items()}
    for prompt in prompts:
        tokens = prompt + [int(t) for t in np.argmax(
            reference_greedy_logits(model, prompt, steps), -1)]
        ref = reference_residuals(model, tokens[:-1])       # the positions the steps compute
        for label in errors:
            probe = probes[label]
            probe.snapshots = []
            taper_logits(config, weights, tokens, len(prompt), model=models[label])
            snaps = np.array(probe.snapshots).reshape(steps, ref.shape[0], -1)[1:]  # decodes
            want = ref[:, len(prompt):].transpose(1, 0, 2)
            errors[label].append(np.linalg.norm(snaps - want, axis=-1)
                                 / np.linalg.norm(want, axis=-1))
    return {k: np.concatenate(v).mean(0) for k, v in errors.items()}


def agreement_engines(path: Path, config: dict, weights: dict, per_op: bool, llama: bool,
                      threads: int, kernels: dict | None = None) -> dict:
    """{label: fn(tokens, prompt_len) -> logits rows} for every engine of the agreement table;
    `kernels` {label: KernelConfig string} adds Taper engines."""
    models = {}     # one Taper model per engine, built on first use

    def taper(label, **how):
        def run(toks, p):
            if label not in models:
                models[label] = taper_model(config, weights, **how)
            return taper_logits(config, weights, toks, p, model=models[label])
        return run
    kernels = {**MODES, **(kernels or {})}
    engines = {label: taper(label, kernels=k) for label, k in kernels.items()}
    if per_op:
        layers = config["num_hidden_layers"]
        for op in OPS:
            for label, exact in ((f"taper, exact {op} only", [op]),
                                 (f"taper, exact all but {op}", [o for o in OPS if o != op])):
                engines[label] = taper(label, backend=OpMixBackend(layers, exact))
    if llama:
        llm = llama_cpp_model(path, 512, threads)
        engines["llama.cpp"] = lambda toks, p: llama_cpp_logits(path, toks, p, threads, llm)
    return engines


def greedy_agreement(path: Path, kind: str, per_op: bool = False, llama: bool = True,
                     threads: int = 2, steps: int = AGREEMENT_STEPS,
                     kernels: dict | None = None, every: int = 1) -> dict:
    """One file, one prompt kind (every `every`-th prompt of it): the reference's tokens and
    trusted steps per prompt, and per engine the leading agreement (free-running tokens = ref),
    argmax agreement over the trusted steps and the max-abs logit distance of each of them."""
    config, weights, deq = dequantized_weights(path)
    model = reference_model(config, deq)
    from engine.loader.gguf import read_gguf
    prompts = agreement_prompts(read_gguf(str(path), progress=False).tokenizer, kind)[::every]
    engines = agreement_engines(path, config, weights, per_op, llama, threads, kernels)
    out = {"prompts": prompts, "ref_tokens": [], "trusted": [],
           "engines": {k: {"lead": [], "agree": 0, "maxabs": []} for k in engines}}
    for prompt in prompts:
        ref = reference_greedy_logits(model, prompt, steps)
        tokens = [int(t) for t in np.argmax(ref, -1)]
        n = trusted_steps(ref)
        out["ref_tokens"].append(tokens)
        out["trusted"].append(n)
        for label, fn in engines.items():       # the trusted steps only
            rows = fn(prompt + tokens[:n], len(prompt)) if n else np.zeros((0, ref.shape[1]))
            e = out["engines"][label]
            e["lead"].append(leading_agreement(rows, tokens, n))
            e["agree"] += int((np.argmax(rows, -1) == np.array(tokens[:n])).sum())
            e["maxabs"].append(np.abs(rows - ref[:n]).max(-1))
    return out


def embd_output_types(path: Path) -> str:
    """The ggml types of a file's token_embd and output tensors ("Q6_K", "Q8_0 / F32", ...)."""
    from gguf import GGUFReader
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    embd, output = types["token_embd.weight"], types.get("output.weight")
    return embd if output is None else f"{embd} / {output}"


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
            try:        # llama_cpp put on PYTHONPATH without its dist-info
                import llama_cpp
                out.append(f"{pkg} {llama_cpp.__version__}" if pkg == "llama_cpp_python"
                           else f"{pkg} (not installed)")
            except ImportError:
                out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def teacher_forced_table(args) -> None:
    """The first table: the random Qwen2, teacher-forced (module docstring)."""
    rng = np.random.default_rng(SEED)
    prompt = [int(t) for t in rng.integers(3, CONFIG["vocab_size"], args.prompt_len)]
    print(f"model: {NAME} ({sum(int(np.prod(s)) for _, s in tensor_shapes(CONFIG)) / 1e6:.0f}M "
          f"parameters); prompt {args.prompt_len} random tokens, {args.steps} teacher-forced steps")
    rows, speed = [], []
    for q, float_eo in [(q, eo == "f32") for q in args.quant for eo in args.embd_output]:
        path = make_quant_gguf(q, name=NAME, config=CONFIG, float_embd_output=float_eo)
        t0 = time.time()
        config, weights, deq = dequantized_weights(path)
        model = reference_model(config, deq)
        tokens = reference_greedy(model, prompt, args.steps)
        ref = reference_logits(model, tokens, args.prompt_len)[:-1]
        del model
        margins = top2_margins(ref)
        times = {label: [] for label in MODES}

        def mode(label):
            return lambda: taper_logits(config, weights, tokens, args.prompt_len, times[label],
                                        kernels=MODES[label])
        engines = {label: mode(label) for label in MODES}
        if not args.no_llama:
            for th in args.llama_threads:
                engines[f"llama.cpp {th} thr"] = (
                    lambda th=th: llama_cpp_logits(path, tokens, args.prompt_len, th))
        file = f"{q} ({embd_output_types(path)})"
        for label, fn in engines.items():
            d = distances(fn(), ref)
            rows.append((file, label, d, float(np.median(margins))))
        for _ in range(args.speed_reps):    # more decode steps, the modes interleaved
            for label in MODES:
                engines[label]()
        speed.append((file, {k: float(np.percentile(v, 25)) for k, v in times.items()}))
        print(f"  {file}: done in {time.time() - t0:.0f}s", flush=True)
    print()
    print("| file (token_embd = output) | engine | max-abs mean / worst | RMS mean / worst | "
          "argmax = ref | ref top-2 margin (median) |")
    print("|---|---|---:|---:|---:|---:|")
    for q, label, d, m in rows:
        print(f"| {q} | {label} | {d['max_mean']:.4f} / {d['max_worst']:.4f} | "
              f"{d['rms_mean']:.5f} / {d['rms_worst']:.5f} | {d['agree']}/{d['steps']} | {m:.3f} |")
    print()
    print(f"Taper decode step, batch 1, {os.environ.get('OMP_NUM_THREADS', 'all')} threads "
          "(ms, 25th percentile of all steps; the machine is shared):")
    for q, t in speed:
        print(f"  {q}: " + ", ".join(f"{k} {v:.2f} (x{v / t[f'taper, {ROUNDED}']:.2f})"
                                     for k, v in t.items()))


def agreement_files(args) -> list[Path]:
    """The tiny Llama's files of --agreement-quant x --embd-output, or the --file GGUFs."""
    if args.file:
        return [Path(f) for f in args.file]
    return [tiny_llama(q, eo == "f32") for q in args.agreement_quant for eo in args.embd_output]


def agreement_table(args, files) -> None:
    """The second table: free-running greedy agreement (module docstring)."""
    print(f"\n{AGREEMENT_STEPS} greedy steps per prompt, counted up to the reference's first "
          f"top-two margin under {TIE}")
    print("\n| file | token_embd / output | prompts | engine | free-running tokens = ref | "
          "argmax = ref (teacher-forced) | max-abs mean |")
    print("|---|---|---|---|---:|---:|---:|", flush=True)
    for path in files:
        q = path.name.removesuffix(".gguf")
        types = embd_output_types(path)
        for kind in args.prompts:
            r = greedy_agreement(path, kind, args.per_op, not args.no_llama,
                                 args.llama_threads[-1])
            total = sum(r["trusted"])
            lengths = [len(p) for p in r["prompts"]]
            for label, e in r["engines"].items():
                maxabs = np.concatenate(e["maxabs"]) if total else np.zeros(1)
                print(f"| {q} | {types} | {kind}: {len(lengths)}, {min(lengths)}-"
                      f"{max(lengths)} tokens | {label} | {sum(e['lead'])}/{total} | "
                      f"{e['agree']}/{total} | {maxabs.mean():.4f} |", flush=True)


def per_layer_table(args, files) -> None:
    """Taper's residual stream against the reference's, layer by layer (ResidualProbe)."""
    for path in files:
        for kind in args.prompts:
            errors = residual_errors(path, kind)
            n = len(next(iter(errors.values()))) // 2
            print(f"\nresidual stream of {path.name} ({embd_output_types(path)}), {kind} prompts, "
                  "decode steps: mean ||taper - ref|| / ||ref|| after each layer's attention "
                  "and MLP")
            print("| engine | " + " | ".join(f"{i} attn | {i} mlp" for i in range(n)) + " |")
            print("|---|" + "---:|" * (2 * n))
            for label, e in errors.items():
                print(f"| {label} | " + " | ".join(f"{x:.2e}" for x in e) + " |", flush=True)


# ---- one decode matmul against llama.cpp's own CPU kernels

# weight type: (llama.cpp's activation type, its block bytes, elements per block)
ACTIVATION_BLOCKS = {"Q4_0": ("q8_0", 34, 32), "Q4_1": ("q8_1", 36, 32), "Q5_0": ("q8_0", 34, 32),
                     "Q5_1": ("q8_1", 36, 32), "Q8_0": ("q8_0", 34, 32),
                     "Q2_K": ("q8_K", 292, 256), "Q3_K": ("q8_K", 292, 256),
                     "Q4_K": ("q8_K", 292, 256), "Q5_K": ("q8_K", 292, 256),
                     "Q6_K": ("q8_K", 292, 256)}


def ggml_cpu():
    """llama-cpp-python's libggml-cpu (the kernels its decode runs), initialised."""
    import ctypes
    import llama_cpp
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init()
    return lib


def matmul_table(reps: int = 20, k: int = 768, n: int = 512) -> None:
    """Per weight type, one T = 1 matmul of random activations (log-normal magnitudes) with a
    random (n, k) matrix in the type's blocks: Taper's act_split=off and llama.cpp's own kernels
    (quantize_row_q8_*, then ggml_vec_dot_*_q8_* per weight row, from the libggml-cpu that
    llama-cpp-python ships), each against float64 x @ dequant(W).T, and against each other."""
    import ctypes
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    from pyx.cpu_backend import CpuBackend, quantize
    from pyx.weights.ggml import QuantizedWeight
    lib, rng = ggml_cpu(), np.random.default_rng(0)
    modes = {m: CpuBackend(kernels=f"act_split={m}") for m in ("off", "on")}
    ptr = ctypes.c_void_p
    print(f"\none decode matmul (T = 1, K {k}, N {n}, {reps} activation rows): Taper against "
          "llama.cpp's CPU kernels and float64")
    print("| weight type | activation blocks | bytes that differ from llama.cpp's | "
          "max \\|Taper off - llama.cpp\\| | mean \\|err\\| llama.cpp | Taper off | Taper on |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (act, block_bytes, block) in ACTIVATION_BLOCKS.items():
        qt = QT[name]
        blocks = quantize(int(qt), rng.standard_normal((n, k)).astype(np.float32), 1)
        w = QuantizedWeight.of(int(qt), blocks, k)
        deq = quants.dequantize(blocks, qt).reshape(n, k).astype(np.float64)
        vec_dot = getattr(lib, f"ggml_vec_dot_{name.lower().replace('_k', '_K')}_{act}")
        differ, gap, err = 0.0, 0.0, {"llama.cpp": [], "off": [], "on": []}
        for _ in range(reps):
            x = (rng.standard_normal((1, k)) * np.exp(0.7 * rng.standard_normal(k))
                 ).astype(np.float32)
            exact = (x.astype(np.float64) @ deq.T)[0]
            xq = np.zeros(k // block * block_bytes, np.uint8)
            getattr(lib, f"quantize_row_{act}")(x.ctypes.data_as(ptr), xq.ctypes.data_as(ptr),
                                                ctypes.c_int64(k))
            differ += np.mean(quantize(int(QT[act.upper()]), x, 1).reshape(-1) != xq) / reps
            s, llama = ctypes.c_float(), np.empty(n, np.float32)
            for r in range(n):
                vec_dot(ctypes.c_int(k), ctypes.byref(s), ctypes.c_size_t(0),
                        blocks[r].ctypes.data_as(ptr), ctypes.c_size_t(0),
                        xq.ctypes.data_as(ptr), ctypes.c_size_t(0), ctypes.c_int(1))
                llama[r] = s.value
            err["llama.cpp"].append(np.abs(llama - exact).mean())
            for mode, backend in modes.items():
                out = np.empty((1, n), np.float32)
                backend.linear(x, w, None, out)
                err[mode].append(np.abs(out[0] - exact).mean())
                if mode == "off":
                    gap = max(gap, float(np.abs(out[0] - llama).max()))
        print(f"| {name} | {act.upper()} | {differ:.5f} | {gap:.1e} | "
              + " | ".join(f"{np.mean(v):.4f}" for v in err.values()) + " |", flush=True)


def step_time_table(files: list[str], reps: int = 3, steps: int = 64, prompt: int = 16) -> None:
    """Taper's decode step in each act_split mode on each file: CPU seconds of the process (so
    other processes on the machine do not count) over a `prompt`-token prefill and `steps`
    decode steps, best of `reps` runs, the modes interleaved. One thread unless
    OMP_NUM_THREADS says otherwise (with more, spinning threads count too)."""
    from engine.loader.gguf import read_gguf
    modes = ["off", "qkv", "on"]
    print(f"\ndecode step CPU time (ms, {prompt}-token prefill + {steps} steps, per step, best of "
          f"{reps}; {os.environ.get('OMP_NUM_THREADS', 'all')} threads)")
    print("| file | " + " | ".join(f"act_split={m}" for m in modes) + " |")
    print("|---|" + "---:|" * len(modes))
    for path in files:
        ck = read_gguf(path, progress=False)
        models = {m: taper_model(ck.config, ck.weights, kernels=f"act_split={m}") for m in modes}
        tokens = [10 + i % 64 for i in range(prompt + steps)]
        best = {m: float("inf") for m in modes}
        for _ in range(reps):
            for m in modes:
                t0 = time.process_time()
                taper_logits(ck.config, ck.weights, tokens, prompt, model=models[m])
                best[m] = min(best[m], (time.process_time() - t0) * 1e3 / steps)
        print(f"| {Path(path).name} | " + " | ".join(
            f"{best[m]:.2f} (x{best[m] / best['off']:.3f})" for m in modes) + " |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", nargs="*", default=QUANTS, choices=QUANTS,
                    help="the teacher-forced table's files (none: skip it)")
    ap.add_argument("--agreement-quant", nargs="*", default=AGREEMENT_QUANTS,
                    choices=list(QUANT_FTYPES),
                    help="the greedy agreement table's tiny-Llama files (none: skip it)")
    ap.add_argument("--embd-output", nargs="+", default=["file", "f32"], choices=["file", "f32"],
                    help="token_embd/output as the quantizer chose them, and/or kept F32")
    ap.add_argument("--prompts", nargs="+", default=PROMPT_KINDS, choices=PROMPT_KINDS)
    ap.add_argument("--per-op", action="store_true",
                    help="agreement table: Taper with exact activations per kind of matmul")
    ap.add_argument("--per-layer", action="store_true",
                    help="Taper's residual stream against the reference's after each layer")
    ap.add_argument("--file", nargs="+",
                    help="the agreement (and per-layer) tables on these GGUF files (a Llama-"
                         "family model with a tokenizer) instead of the tiny Llama's")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--llama-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-llama", action="store_true", help="Taper and the reference only")
    ap.add_argument("--speed-reps", type=int, default=2,
                    help="extra teacher-forced runs of each Taper mode for the step times")
    ap.add_argument("--matmul", action="store_true",
                    help="one decode matmul per weight type against llama.cpp's own kernels")
    ap.add_argument("--step-time", nargs="+", metavar="FILE",
                    help="Taper's decode step CPU time per act_split mode on these GGUF files")
    args = ap.parse_args(argv)
    from pyx.cpu_backend import CpuBackend
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, "
          f"Taper ISA {CpuBackend().isa}; {versions()}")
    if args.matmul:
        matmul_table()
    if args.step_time:
        step_time_table(args.step_time)
    if args.quant:
        teacher_forced_table(args)
    if args.agreement_quant or args.file:
        files = agreement_files(args)
        agreement_table(args, files)
        if args.per_layer:
            per_layer_table(args, files)


if __name__ == "__main__":
    main()

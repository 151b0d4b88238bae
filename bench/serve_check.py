"""Serving checked end to end, as a user runs it (issue 11, item 5; `GPU_SUITE=serve` of
bench/gpu_check.sh):

    python -m bench.serve_check --out DIR                 # GPU: makes the 1B checkpoint itself
                                                          # (once: later runs reuse it)
    python -m bench.serve_check --model DIR --server-arg=--cpu --concurrency 1 2 ...

1. the checkpoint: unless --model is given, a Llama-3.2-1B-shaped random bf16 checkpoint (16
   layers, hidden 2048, 32 query heads over 8 KV heads of 64, MLP 8192, tied embeddings) with a
   byte-level BPE tokenizer of 8192 ids trained on the Python standard library, written by
   transformers and torch on the GPU (the GPU machine has both; 1.98 GB of weights);
2. the device-to-device copy bandwidth, measured with CuPy before the server takes the memory, so
   the table can show the TPOT bound: weight bytes / bandwidth, the time one decode step needs
   to read every weight once;
3. `python -m server --w DIR` started in its own process exactly as a user starts it, until
   /health answers 200;
4. one streamed chat completion through the official `openai` client: text arrives in several
   chunks and the stream ends with a finish reason and usage;
5. `bench.serve` at each concurrency (512 prompt tokens, 128 out, ignore_eos; 4 prompts per client,
   8 at concurrency 1): every request must succeed;
6. /metrics afterwards: no request running or waiting, and the KV cache empty;
7. the table: output tok/s, median TTFT, median TPOT, the TPOT bound and the ratio.

Exit status 0 only when every check held; the server's log is written beside the table.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from bench import serve

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|start|>' + m['role'] + '\\n' + "
                 "m['content'] + '<|eot_id|>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}")


def make_llama_1b(out: str, vocab: int = 8192) -> str:
    """The checkpoint of step 1, made on the GPU with torch (the GPU machine's own install)."""
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    def texts():
        for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:300]:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab, show_progress=False, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(**LLAMA_1B, vocab_size=tok.get_vocab_size(), bos_token_id=0,
                         eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def weight_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")))


def copy_bandwidth_gbps(nbytes: int = 1 << 30, runs: int = 10) -> float | None:
    """Device-to-device copy GB/s (bytes read + written), or None without a usable GPU."""
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        return None
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    dst[...] = src                                  # warm-up
    start.record()
    for _ in range(runs):
        dst[...] = src
    stop.record()
    stop.synchronize()
    ms = cp.cuda.get_elapsed_time(start, stop) / runs
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def start_server(model_dir: str, port: int, extra: list[str], log_path: str,
                 timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--w", model_dir, "--p", str(port), *extra]
    return start_process(cmd, f"http://127.0.0.1:{port}/health", log_path, timeout)


def start_process(cmd: list[str], ready_url: str, log_path: str, timeout: float,
                  env: dict | None = None) -> subprocess.Popen:
    """Start a server process, its output in log_path, and wait until ready_url answers 200."""
    print("$ " + " ".join(cmd), flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before "
                             f"{ready_url} answered; its log:\n{open(log_path).read()[-4000:]}")
        if get(ready_url)[0] == 200:
            return proc
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{ready_url} did not answer 200 within {timeout:.0f} s; the server's log:\n"
                     f"{open(log_path).read()[-4000:]}")


def stream_one_chat(base_url: str) -> str:
    """One streamed chat completion through the official client; returns a one-line report."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chunks, text, finish, usage = 0, "", None, None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Write a haiku about GPUs."}],
            max_tokens=16, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                chunks += 1
                text += choice.delta.content
            finish = choice.finish_reason or finish
    problems = [p for p, bad in (("no text", not text), ("one chunk only", chunks < 2),
                                 ("no finish_reason", finish is None), ("no usage", usage is None))
                if bad]
    if problems:
        raise SystemExit(f"streamed chat completion: {', '.join(problems)}")
    return (f"streamed chat: {chunks} content chunks, finish_reason {finish}, "
            f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")


def run_bench(base_url: str, tokenizer: str, concurrency: int, num_prompts: int,
              input_len: int, output_len: int) -> dict:
    args = serve.build_parser().parse_args([
        "--base-url", base_url, "--tokenizer", tokenizer, "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos", "--num-prompts",
        str(num_prompts), "--max-concurrency", str(concurrency), "--disable-tqdm"])
    return asyncio.run(serve.main_async(args))[0]


def metric_values(text: str, name: str) -> list[float]:
    """Every sample of a Prometheus metric (any labels)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", re.M)
    return [float(v) for v in pattern.findall(text)]


def check_idle(base_url: str, timeout: float = 10.0) -> str:
    """/metrics once the last request ended: nothing running or waiting, no KV block held."""
    names = ("taper:num_requests_running", "taper:num_requests_waiting",
             "taper:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        status, text = get(base_url + "/metrics")
        values = {n: metric_values(text, n) for n in names} if status == 200 else {}
        if values and all(values[n] and not any(values[n]) for n in names):
            return "after the runs: " + ", ".join(f"{n} {values[n][0]:g}" for n in names)
        if time.monotonic() > deadline:
            raise SystemExit(f"/metrics after the runs (status {status}): {values or text[:500]}")
        time.sleep(0.5)


def table(rows: list[dict], bound_ms: float | None) -> str:
    head = ("| concurrency | prompts | output tok/s | median TTFT ms | median TPOT ms "
            "| TPOT bound ms | bound / TPOT |")
    lines = [head, "|" + "---:|" * 7]
    for r in rows:
        ratio = f"{bound_ms / r['median_tpot_ms']:.2f}" if bound_ms else "-"
        lines.append(f"| {r['max_concurrency']} | {r['num_prompts']} | "
                     f"{r['output_throughput']:.0f} | {r['median_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.2f} | "
                     f"{f'{bound_ms:.2f}' if bound_ms else '-'} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory with a tokenizer; where it holds no "
                   "config.json, the Llama-3.2-1B-shaped one is made there on the GPU (default "
                   "/tmp/taper-llama-1b-random)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"),
                   help="where the server log and the table go (default $OUT)")
    p.add_argument("--port", type=int, default=2000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompts-per-client", type=int, default=4)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for `python -m server` (repeat; e.g. --server-arg=--cpu)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    model = args.model or "/tmp/taper-llama-1b-random"
    if not os.path.exists(os.path.join(model, "config.json")):
        t0 = time.monotonic()
        make_llama_1b(model)
        print(f"checkpoint {model}: made in {time.monotonic() - t0:.0f} s", flush=True)
    else:
        print(f"checkpoint {model}: reused", flush=True)
    wbytes = weight_bytes(model)
    bw = copy_bandwidth_gbps()
    bound_ms = wbytes / (bw * 1e9) * 1e3 if bw else None
    print(f"weights {wbytes / 1e9:.2f} GB; copy bandwidth "
          + (f"{bw:.0f} GB/s: TPOT bound {bound_ms:.2f} ms" if bw else "not measured (no GPU)"),
          flush=True)

    base_url = f"http://127.0.0.1:{args.port}"
    log_path = os.path.join(args.out, "server.log")
    t0 = time.monotonic()
    proc = start_server(model, args.port, args.server_arg, log_path, args.start_timeout)
    print(f"server up in {time.monotonic() - t0:.0f} s", flush=True)
    rows, failures = [], []
    try:
        print(stream_one_chat(base_url), flush=True)
        for c in args.concurrency:
            n = 8 if c == 1 else c * args.prompts_per_client
            print(f"== concurrency {c}: {n} prompts, {args.input_len} in / {args.output_len} out",
                  flush=True)
            res = run_bench(base_url, model, c, n, args.input_len, args.output_len)
            rows.append(res)
            if res["failed"] or res["completed"] != n:
                errors = sorted({e for e in res["errors"] if e})[:3]
                failures.append(f"concurrency {c}: {res['failed']} of {n} requests failed "
                                f"({'; '.join(errors)})")
        print(check_idle(base_url), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    report = table(rows, bound_ms)
    with open(os.path.join(args.out, "serve_table.md"), "w") as f:
        f.write(report + "\n")
    print(report)
    for failure in failures:
        print("FAILED: " + failure)
    print(f"server exit status {proc.returncode}")
    return 1 if failures or proc.returncode not in (0, -15) else 0


if __name__ == "__main__":
    sys.exit(main())

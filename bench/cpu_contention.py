"""The CPU backend with its cores shared: one request's latency beside a competing CPU load,
against the same request on an idle machine, and against llama.cpp under the same load (issue 27,
item 7; a bench, not a test).

    python -m bench.cpu_contention                       # demo + 0.5B-shaped, 5 rounds
    python -m bench.cpu_contention --models demo --rounds 9 --no-llama
    python -m bench.cpu_contention --variant spin10k:GOMP_SPINCOUNT=10000   # try a setting

Each engine setting is a worker process that loads the model once and warms up; the parent then
times one request at a time in it: --prompt-len random token ids in, --gen-len tokens out
(greedy, ignore_eos, batch 1, prefix caching off), wall time from submitting to the last token.
Every round runs, for each worker in turn, one request on the idle machine and one beside
--busy busy-loop processes (default: one per CPU this process may use), alternating which comes
first; the busy processes start SETTLE_S (1 s) before the request, and the next request waits as
long after they are killed. They run in a
session of their own, as independent programs do (with the kernel's autogroup scheduling, as
here, a session's threads share one slot of the CPU: the load then takes about half the
machine, whatever N; without autogroup, N busy loops beside T threads take N / (N + T)).

Settings run (each a process of its own: libgomp reads its variables when it loads; the workers
get no OMP_* / GOMP_* variables but these):
  taper          the shipped defaults (pyx/cpu_threads.py: the CPUs this process may use, fewer
                 while other processes occupy some of them; libgomp's spin-wait)
  taper-fixed    OMP_NUM_THREADS = that count: a fixed team, as before the change
  taper-passive  the defaults with OMP_WAIT_POLICY=passive (threads sleep at once between regions)
  taper-1thread  OMP_NUM_THREADS=1
  llama.cpp      llama-cpp-python on a GGUF of the same weights made by llama.cpp's converter,
                 n_threads = the same count, run by --llama-python (a venv with llama_cpp);
                 its CPU backend is built with OpenMP too (ggml's barriers are OpenMP's)
  llama.cpp-passive   the same with OMP_WAIT_POLICY=passive (--llama-settings)
--variant NAME:VAR=VALUE[,VAR=VALUE] adds a Taper setting. --wait-quiet S waits (up to S
seconds) before each idle request for a second in which other processes use < 10 % of the CPUs.

Models: `demo` (server/demo_model.py: 4 layers, hidden 256, f32; the GGUF is f32) and `0.5b`
(bench/make_checkpoint.py's Qwen2.5-0.5B-shaped random weights, bf16; the GGUF is bf16). The
GGUFs are cached in bench/.cache/. LLAMACPP_SRC: llama.cpp's source (its converter).

Reported per model and setting: idle and loaded seconds per request (min / median over rounds),
the slowdown (loaded median / idle median; goal: no worse than the share of the cores the load
takes), each llama.cpp setting's median time over this one's, idle and loaded (above 1: this
setting is faster), the other processes' share of the CPUs
during the idle requests (a figure taken while others were busy is not an idle one), and the
machine. Another program's load on a shared host is not ours to stop: run it where the machine
is otherwise quiet, or read the "others" column.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"
LLAMACPP_SRC = Path(os.environ.get("LLAMACPP_SRC",
                                   "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp"))
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND",
               "OMP_PLACES", "OMP_DYNAMIC", "GOMP_CPU_AFFINITY")
TAPER_VARIANTS = {"taper": {}, "taper-fixed": {"OMP_NUM_THREADS": "{threads}"},
                  "taper-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
                  "taper-1thread": {"OMP_NUM_THREADS": "1"}}
LLAMA_VARIANTS = {"llama.cpp": {}, "llama.cpp-passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
MARK = "@@"     # protocol lines between parent and worker start with this
# Taper's thread governor measures other processes' load every half second (pyx/cpu_threads.py):
# the load starts this long before a loaded request and ends this long before the next request,
# so each is timed in a steady state; the reaction itself takes up to about a second.
SETTLE_S = 1.0

CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
sys.path.insert(0, {src!r})
import convert_hf_to_gguf as convert
from conversion.base import TextModel
# A toy vocabulary cannot match the converter's hash table of known pre-tokenizers; the demo's
# tokenizer splits with the GPT-2 regex (byte-level BPE).
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert.main()
"""


# ---- models

def demo_model(with_gguf: bool) -> tuple[Path, Path | None]:
    sys.path.insert(0, str(ROOT))
    from server.demo_model import DEMO_VERSION, ensure_demo_checkpoint
    d = Path(ensure_demo_checkpoint())
    gguf = CACHE / f"demo-v{DEMO_VERSION}-f32.gguf"
    if with_gguf and not gguf.is_file() and LLAMACPP_SRC.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = gguf.with_suffix(".tmp.gguf")
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        res = subprocess.run([sys.executable, "-c", CONVERT.format(src=str(LLAMACPP_SRC)),
                              "--outtype", "f32", "--outfile", str(tmp), str(d)],
                             env=env, cwd=LLAMACPP_SRC, capture_output=True, text=True)
        if res.returncode != 0:
            sys.stderr.write(res.stdout[-3000:] + res.stderr[-3000:])
            raise SystemExit("llama.cpp's converter failed on the demo checkpoint")
        tmp.rename(gguf)
    return d, (gguf if gguf.is_file() else None)


def half_b_model(with_gguf: bool) -> tuple[Path, Path | None]:
    from bench import make_checkpoint
    d = make_checkpoint.make_checkpoints()["bf16"]
    gguf = None
    if with_gguf and LLAMACPP_SRC.is_dir():
        make_checkpoint.LLAMACPP_SRC = LLAMACPP_SRC
        gguf = make_checkpoint.make_gguf("bf16")
    return d, gguf


MODELS = {"demo": demo_model, "0.5b": half_b_model}


# ---- workers (run in their own processes; the llama.cpp one under another venv's python)

def emit(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, length)]


def taper_worker(args) -> None:
    sys.path.insert(0, str(ROOT))
    from engine import LLM, SamplingParams
    llm = LLM(args.model, kv_cache_memory_mb=256, enable_prefix_caching=False)
    backend = llm.engine.backend
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)

    def run(seed: int) -> int:
        [out] = llm.generate([prompt_ids(seed, args.prompt_len, vocab)], params)
        return len(out.token_ids)

    serve(run, {"threads": backend.num_threads, "isa": backend.isa,
                "adaptive": backend.governor is not None,
                "wait": os.environ.get("OMP_WAIT_POLICY", "libgomp's spin")})


def llama_worker(args) -> None:
    import numpy as np
    import llama_cpp
    n_ctx = 64 * ((args.prompt_len + args.gen_len + 16 + 63) // 64)
    llm = llama_cpp.Llama(args.model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(vocab,))))

    def run(seed: int) -> int:
        llm.reset()
        llm.eval(prompt_ids(seed, args.prompt_len, vocab))
        tokens = [greedy()]
        while len(tokens) < args.gen_len:
            llm.eval([tokens[-1]])
            tokens.append(greedy())
        return len(tokens)

    serve(run, {"threads": args.threads, "llama_cpp": llama_cpp.__version__,
                "system": llama_cpp.llama_print_system_info().decode().strip()})


def serve(run, info: dict) -> None:
    """Warm up, say ready, then time one request per "run SEED" line on stdin."""
    run(1)
    run(2)
    emit(dict(info, ready=True))
    for line in sys.stdin:
        seed = int(line.split()[1])
        cpu0, t0 = sum(os.times()[:2]), time.perf_counter()
        n = run(seed)
        emit({"s": time.perf_counter() - t0, "cpu_s": sum(os.times()[:2]) - cpu0, "tokens": n})


# ---- the parent

def busy_jiffies() -> float:
    """Seconds of CPU time the whole machine has spent busy (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_s: float, threshold: float = 0.1, window_s: float = 1.0) -> None:
    """Wait (at most max_s) for a window in which other processes use under `threshold` of the
    CPUs: the idle requests are then timed on a machine that is idle."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        b0 = busy_jiffies()
        time.sleep(window_s)
        if (busy_jiffies() - b0) / (window_s * (os.cpu_count() or 1)) < threshold:
            return


class Worker:
    def __init__(self, name: str, cmd: list[str], env: dict):
        self.name, self.idle, self.loaded, self.others = name, [], [], []
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise SystemExit(f"{self.name}: worker exited ({self.proc.wait()}) before answering")

    def request(self, seed: int) -> dict:
        self.proc.stdin.write(f"run {seed}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class BusyLoad:
    """N busy-loop processes, each in its own session, for the length of a `with` block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                       start_new_session=True) for _ in range(self.n)]
        time.sleep(SETTLE_S)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        time.sleep(SETTLE_S)


def worker_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(extra)
    return env


def start_workers(model: str, args, threads: int) -> list[Worker]:
    model_dir, gguf = MODELS[model](with_gguf=args.llama_python is not None)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    workers = []
    for name, extra in args.variants.items():
        extra = {k: v.format(threads=threads) for k, v in extra.items()}
        workers.append(Worker(name, me + ["--worker", "taper", "--model", str(model_dir)]
                              + common, worker_env(extra)))
    if args.llama_python and gguf is not None:
        for name in args.llama_settings:
            workers.append(Worker(name, [args.llama_python, me[1], "--worker", "llama",
                                         "--model", str(gguf), "--threads", str(threads)]
                                  + common, worker_env(LLAMA_VARIANTS[name])))
    elif args.llama_python:
        print(f"(no GGUF of {model}: LLAMACPP_SRC {LLAMACPP_SRC} is not llama.cpp's source)")
    return workers


def measure(workers: list[Worker], args, seed0: int) -> None:
    for r in range(args.rounds):
        order = workers[r % len(workers):] + workers[:r % len(workers)]
        for w in order:
            for loaded in ((False, True) if r % 2 == 0 else (True, False)):
                seed = seed0 + r
                if loaded:
                    with BusyLoad(args.busy):
                        w.loaded.append(w.request(seed)["s"])
                else:
                    time.sleep(SETTLE_S)        # no other worker's request in the last second
                    if args.wait_quiet:
                        wait_quiet(args.wait_quiet)
                    b0, t0 = busy_jiffies(), time.perf_counter()
                    res = w.request(seed)
                    wall = time.perf_counter() - t0
                    other = max(0.0, busy_jiffies() - b0 - res["cpu_s"])
                    w.idle.append(res["s"])
                    w.others.append(other / (wall * (os.cpu_count() or 1)))
            print(f"  round {r + 1}: {w.name:<16} idle {w.idle[-1]:7.3f} s   "
                  f"loaded {w.loaded[-1]:7.3f} s", flush=True)


def fmt_s(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f}"


def table(model: str, workers: list[Worker]) -> list[str]:
    llamas = [w for w in workers if w.name in LLAMA_VARIANTS]
    med = statistics.median
    head = "".join(f" {w.name}'s time / this one's, idle / loaded |" for w in llamas)
    lines = [f"{model}:", "| setting | threads | idle s (min / median) | loaded s (min / median) "
             "| slowdown (median) |" + head + " others, idle runs |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(llamas) + "---:|"]
    for w in workers:
        slow = med(w.loaded) / med(w.idle)
        vs = "".join(f" {med(ll.idle) / med(w.idle):.2f}x / {med(ll.loaded) / med(w.loaded):.2f}x |"
                     if ll is not w else " |" for ll in llamas)
        lines.append(f"| {w.name} | {w.info['threads']} | {fmt_s(w.idle)} | {fmt_s(w.loaded)} "
                     f"| **{slow:.2f}x** |{vs} {100 * med(w.others):.0f} % |")
    return lines


def machine(threads: int, why: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = "on" if f.read().strip() == "1" else "off"
    except OSError:
        autogroup = "?"
    return (f"{cpu}, {os.cpu_count()} CPUs, {threads} threads ({why}); autogroup {autogroup}; "
            f"commit {commit}; load average {os.getloadavg()[0]:.1f}")


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, assigns = text.partition(":")
    env = {}
    for a in filter(None, assigns.split(",")):
        k, sep, v = a.partition("=")
        if not sep or k not in THREAD_VARS:
            raise SystemExit(f"--variant {text!r}: expected NAME:VAR=VALUE with VAR one of "
                             f"{', '.join(THREAD_VARS)}")
        env[k] = v
    return name, env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["demo", "0.5b"], choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", type=int, default=None,
                    help="busy-loop processes beside the engine (default: usable CPUs)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each idle request, wait up to S seconds for a quiet second")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--settings", nargs="+", default=list(TAPER_VARIANTS),
                    choices=list(TAPER_VARIANTS), help="Taper settings to run")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE,...",
                    help="an extra Taper setting (repeatable)")
    ap.add_argument("--llama-python", default="/tmp/lcpvenv/bin/python",
                    help="python with llama_cpp installed (runs the llama.cpp worker)")
    ap.add_argument("--llama-settings", nargs="+", default=["llama.cpp"],
                    choices=list(LLAMA_VARIANTS), help="llama.cpp settings to run")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    ap.add_argument("--worker", choices=["taper", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        (taper_worker if args.worker == "taper" else llama_worker)(args)
        return 0

    sys.path.insert(0, str(ROOT))
    from pyx.cpu_threads import usable_cpus
    threads, why = usable_cpus()
    args.busy = args.busy or threads
    args.variants = {name: TAPER_VARIANTS[name] for name in args.settings}
    args.variants.update(parse_variant(v) for v in args.variant)
    if args.no_llama or not Path(args.llama_python).is_file():
        args.llama_python = None
    report = [f"{args.prompt_len} tokens in, {args.gen_len} out, batch 1; loaded = beside "
              f"{args.busy} busy-loop processes; {args.rounds} rounds",
              machine(threads, why), ""]
    for i, model in enumerate(args.models):
        workers = start_workers(model, args, threads)
        try:
            for w in workers:
                print(f"{model} {w.name}: {w.info}", flush=True)
            measure(workers, args, seed0=1000 * (i + 1))
        finally:
            for w in workers:
                w.close()
        report += table(model, workers) + [""]
    report.append(f"load average at the end {os.getloadavg()[0]:.1f}")
    print("\n".join(report))
    if args.out:
        Path(args.out).write_text("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel serving on the CPU: output tok/s of 2 replicas behind one API server against 1,
the cores split between the replicas, 16 concurrent clients, in the same run.

    python -m bench.data_parallel [--replicas 1 2] [--clients 16] [--requests 3]

The checkpoint is bench/tensor_parallel.py's (75 M, hidden 768, 8 layers, f32; no tokenizer,
so the prompts are token ids through /v1/completions). For each replica count a server starts
(`python -m server --w CKPT --cpu --data-parallel-size N`: one replica takes every core, two
take one each), one untimed request warms it, then --clients threads each send --requests
non-streamed requests one after another: a --prompt-token random prompt, --output tokens out,
greedy, ignore_eos. Output tok/s = the completion tokens of every request / the wall time from
the first send to the last reply; the ratio is N replicas' over 1 replica's. The load average is
printed before and after each: on a shared machine, other processes take cores from the
replicas, so compare the ratio within one run only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench.allreduce import load, machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict, timeout: float = 600) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        payload = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {payload[:300]!r}")
        return json.loads(payload)
    finally:
        conn.close()


def wait_healthy(port: int, proc, log_path: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            break
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    with open(log_path) as f:
        raise RuntimeError(f"the server did not start:\n{f.read()[-3000:]}")


def serve_load(model: str, replicas: int, clients: int, requests: int, prompt: int,
               output: int) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--w", model, "--p", str(port), "--h", "127.0.0.1",
         "--cpu", "--data-parallel-size", str(replicas), "--mem", "256",
         "--served-model-name", "bench"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, proc, log.name)
        rng = np.random.default_rng(0)
        prompts = [[rng.integers(3, 32000, prompt).tolist() for _ in range(requests)]
                   for _ in range(clients)]
        body = dict(model="bench", max_tokens=output, temperature=0, ignore_eos=True)
        post(port, {**body, "prompt": prompts[0][0]})                  # warm-up
        tokens, errors = [0] * clients, []

        def client(k):
            try:
                for p in prompts[k]:
                    tokens[k] += post(port, {**body, "prompt": p})["usage"]["completion_tokens"]
            except Exception as e:          # reported below: a failed run has no figure
                errors.append(e)

        before = os.getloadavg()[0]
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if errors:
            raise RuntimeError(f"{len(errors)} clients failed: {errors[0]}")
        return {"tok_s": sum(tokens) / wall, "tokens": sum(tokens), "wall": wall,
                "load_before": before, "load_after": os.getloadavg()[0]}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3, help="per client, one after another")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    args = ap.parse_args()
    from bench.tensor_parallel import make_checkpoint
    model = make_checkpoint()
    print(f"machine: {machine()}; {load()} (a shared machine: ratios within this run only)")
    print(f"{args.clients} clients x {args.requests} requests, {args.prompt} prompt tokens, "
          f"{args.output} out")
    print("| replicas | output tok/s | tokens | wall (s) | vs 1 replica | load avg before, "
          "after |")
    print("|---:|---:|---:|---:|---:|---|")
    first = None
    for n in args.replicas:
        r = serve_load(model, n, args.clients, args.requests, args.prompt, args.output)
        first = first or r["tok_s"]
        print(f"| {n} | {r['tok_s']:.1f} | {r['tokens']} | {r['wall']:.1f} | "
              f"{r['tok_s'] / first:.2f} | {r['load_before']:.1f}, {r['load_after']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()

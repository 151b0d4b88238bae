"""Pipeline parallel 2 on the CPU: each stage's busy time over the wall time (its bubble), during
steady decode and during a prefill cut into micro-batches, against one process's step time in
the same run.

    python -m bench.pipeline_bubble [--micro-batches 1 4] [--batch 8] [--tokens 32]

The checkpoint is bench/tensor_parallel.py's (75 M, hidden 768, 8 layers: 4 per stage), each
stage one process with one core (the engine splits the cores). Every rank records each step
(engine/parallel/pipeline_profile.py, switched on here by TAPER_PIPELINE_PROFILE): the span of
its part of the step and the time in it spent waiting on the other stage (the residual stream's
receive, the logits' receive on rank 0, the flush of its sends). Busy = span - waited.

- decode: --batch sequences of 32-token prompts, --tokens generated; the decode steps only.
- prefill: --batch prompts of --prompt tokens in one step (max_num_batched_tokens large enough),
  generating 1 token; cut into the --micro-batches count (a rank runs them in order, stage 1
  taking micro-batch k while stage 0 computes k + 1).

Per stage: busy / wall, wall the phase's time from its first step's start to its last step's end
on any rank (rank 0's scheduling and sampling between steps count as wall: stage 1 idles then),
and busy / span (the bubble within the steps alone, which the micro-batches bound: the ideal is
(stages - 1) / (micro-batches + stages - 1) of a step when the stages are equal). The reference
is the same phase in one process (pipeline parallel 1, both cores): time per decode step and the
prefill step's time, and the ratio of pipeline parallel's to it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from bench.allreduce import load, machine


def run(model: str, pp: int, micro: int, batch: int, tokens: int, prompt: int, runs: int):
    """[(phase, start, end)]: the timed generations' windows on the machine's monotonic clock,
    which the ranks' records are matched to."""
    from engine import LLM, SamplingParams
    llm = LLM(model, pipeline_parallel_size=pp, pipeline_micro_batches=micro,
              num_kv_blocks=1024, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, batch * prompt), max_num_seqs=max(batch, 16))
    rng = np.random.default_rng(1)
    vocab = 32000
    short = [rng.integers(3, vocab, 32).tolist() for _ in range(batch)]
    long = [rng.integers(3, vocab, prompt).tolist() for _ in range(batch)]

    def timed(prompts, n):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return start, time.perf_counter()

    windows = []
    try:
        timed(short, 4)                         # warm-up
        timed(long[:2], 1)
        for _ in range(runs):
            windows.append(("decode", *timed(short, tokens)))
            windows.append(("prefill", *timed(long, 1)))
        # a last step, so that every rank has written the line of the one before (rank 0 can
        # finish a step before the last stage has written its line)
        timed(short[:1], 1)
    finally:
        llm.engine.shutdown()
    return windows


def stage_figures(profile: str, windows, batch: int) -> dict:
    """{(phase, stage): (busy/wall, busy/span, step ms)}, medians over the runs."""
    records = []
    for path in glob.glob(profile + ".stage*.jsonl"):
        with open(path) as f:
            records.extend(json.loads(line) for line in f)
    figures = {}
    for phase in ("decode", "prefill"):
        per_stage: dict[int, list] = {}
        for name, w0, w1 in windows:
            if name != phase:
                continue
            # decode: the steps of `batch` tokens (the prompts' step is prefill); prefill: the
            # long prompts' step
            steps = [r for r in records if w0 <= r["start"] <= w1 and
                     ((r["tokens"] <= batch) if phase == "decode" else (r["tokens"] > batch))]
            if not steps:
                continue
            wall = max(r["end"] for r in steps) - min(r["start"] for r in steps)
            for s in sorted({r["stage"] for r in steps}):
                mine = [r for r in steps if r["stage"] == s]
                span = sum(r["end"] - r["start"] for r in mine)
                busy = span - sum(r["waited"] for r in mine)
                per_stage.setdefault(s, []).append(
                    (busy / wall, busy / span, span / len(mine) * 1e3,
                     statistics.median(r["micro_batches"] for r in mine)))
        for s, rows in per_stage.items():
            figures[(phase, s)] = tuple(statistics.median(r[i] for r in rows) for i in range(4))
    return figures


def reference(windows, batch: int, tokens: int) -> dict:
    """One process: ms per decode step (the whole generation less its prompts' step: the
    decode window's prefill takes a step of its own, of 32-token prompts) and the prefill
    generation's time."""
    decode = [(w1 - w0) / tokens for name, w0, w1 in windows if name == "decode"]
    prefill = [w1 - w0 for name, w0, w1 in windows if name == "prefill"]
    return {"decode": statistics.median(decode) * 1e3, "prefill": statistics.median(prefill) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from bench.tensor_parallel import make_checkpoint
    model = make_checkpoint()
    print(f"machine: {machine()}; {load()} (a shared machine: ratios within this run only)")
    # One profile for the whole run, set before any worker exists (MPI fixes the workers'
    # environment at its first spawn); each configuration's records are its time windows'.
    tmp = tempfile.mkdtemp(prefix="pp-bubble-")
    profile = os.environ["TAPER_PIPELINE_PROFILE"] = os.path.join(tmp, "pp")
    one = reference(run(model, 1, 0, args.batch, args.tokens, args.prompt, args.runs),
                    args.batch, args.tokens)
    print(f"pipeline parallel 1 (one process, every core): {one['decode']:.1f} ms per decode "
          f"step (batch {args.batch}), prefill of {args.batch} x {args.prompt} tokens "
          f"{one['prefill']:.0f} ms; {load()}")
    print("| phase | micro-batches | stage | busy / wall | busy / step span | ideal busy / span |"
          " stage step (ms) | PP 2 / PP 1 time | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for micro in args.micro_batches:
        windows = run(model, 2, micro, args.batch, args.tokens, args.prompt, args.runs)
        figures = stage_figures(profile, windows, args.batch)
        two = reference(windows, args.batch, args.tokens)
        for (phase, stage), (of_wall, of_span, step_ms, used) in sorted(figures.items()):
            ideal = used / (used + 1)                     # 2 stages: M / (M + 1)
            print(f"| {phase} | {used:g} | {stage} | {100 * of_wall:.0f} % | "
                  f"{100 * of_span:.0f} % | {100 * ideal:.0f} % | {step_ms:.1f} | "
                  f"{two[phase] / one[phase]:.2f} | {os.getloadavg()[0]:.1f} |", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Where an engine step's time goes at each concurrency: host work against device work.

    python -m bench.step_profile                       # demo checkpoint, CPU, 1/16/64/256
    python -m bench.step_profile --model DIR --backend cuda --concurrency 1 64 256

Runs the engine itself (no HTTP) with C requests added at once (random prompt ids, ignore_eos,
greedy), `max_num_seqs` = C so all of them run together, prefix caching off, and prints for each
C the mean milliseconds per step of each phase (engine/core/step_profile.py): schedule, prepare,
forward (device), sample, outputs (append, detokenize, stop checks), other; separately for the
decode-only steps (every sequence computes its next token) and for all steps. The host share is
(schedule + prepare + outputs + other) / step: what an engine that overlaps host and device
work (the next step prepared while this one runs) could hide.

The default checkpoint is the server's demo model (4 layers, hidden 256, a real tokenizer, so
detokenization is part of the outputs phase): a small model makes the host's share large, as
a 1B model's is on a GPU.

The profile runs the engine synchronously (it must separate the phases). A second table then
times the same runs without it, in three settings: async scheduling (LLMEngine.step) off; on, with
each step scheduled after the previous one's commit (`schedule_ahead` off: the overlap before
output placeholders); and on, scheduled ahead with placeholders (the default). Per setting: the
median wall time of a decode step, the output tokens per second, and from the forward thread's
timeline (engine/core/step_profile.py ForwardTimeline, decode steps) the median idle gap between one
step's sampling and the next step's forward, and the median time a step's sampling waited for the
previous step's commit (medians over --repeat runs, the settings alternated in each).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.throughput import machine_info
from engine.core.step_profile import PHASES, ForwardTimeline, StepProfile

# (label, async_scheduling, schedule_ahead) of the timed settings
SETTINGS = (("off", False, False), ("on, after commit", True, False), ("on, ahead", True, True))


def profile_run(engine, concurrency: int, prompt_len: int, gen_len: int, seed: int) -> tuple:
    from engine.sampling.sampling_params import SamplingParams
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    profile = StepProfile.attach(engine)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"profile-{seed}-{i}", rng.integers(0, vocab, prompt_len).tolist(),
                           params)
    start = time.perf_counter()
    done = 0
    while engine.has_unfinished():
        done += sum(o.finished for o in engine.step())
    wall = time.perf_counter() - start
    assert done == concurrency, f"{done} of {concurrency} requests finished"
    return profile, wall


def timed_run(engine, concurrency: int, prompt_len: int, gen_len: int, seed: int,
              async_scheduling: bool, schedule_ahead: bool = True) -> tuple:
    """(median ms of a step() call that scheduled decodes only, output tok/s, median forward
    gap ms, median commit wait ms) without the profile. With async scheduling a step() call
    commits the previous step and launches this one, so in steady state it lasts one forward
    period, as a synchronous step does. The gap and wait are NaN without async scheduling."""
    from engine.sampling.sampling_params import SamplingParams
    engine.async_scheduling = async_scheduling
    engine.schedule_ahead = schedule_ahead
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"timed-{seed}-{async_scheduling}-{schedule_ahead}-{i}",
                           rng.integers(0, vocab, prompt_len).tolist(), params)
    schedule = engine.scheduler.schedule
    decode_only = []

    def recording_schedule():
        out = schedule()
        decode_only.append(out.num_seqs > 0 and out.num_decodes == out.num_seqs)
        return out
    engine.scheduler.schedule = recording_schedule
    timeline = ForwardTimeline.attach(engine)
    step_ms, done = [], 0
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            t0, n = time.perf_counter(), len(decode_only)
            done += sum(o.finished for o in engine.step())
            if len(decode_only) > n and decode_only[-1]:
                step_ms.append(1e3 * (time.perf_counter() - t0))
    finally:
        del engine.scheduler.schedule
        timeline.detach()
        engine.schedule_ahead = True
    wall = time.perf_counter() - start
    assert done == concurrency, f"{done} of {concurrency} requests finished"
    gaps = timeline.decode_summary() if async_scheduling else {}
    return (float(np.median(step_ms)), concurrency * gen_len / wall,
            gaps.get("gap", float("nan")), gaps.get("commit_wait", float("nan")))


def table_row(label: str, s: dict) -> str:
    if not s.get("steps"):
        return f"| {label} | 0 | | | | | | | | | |"
    cells = " | ".join(f"{s[p]:.2f}" for p in (*PHASES, "other", "step"))
    return (f"| {label} | {s['steps']} | {s['seqs']:.0f} | {s['tokens']:.0f} | {cells} | "
            f"{100 * s['host_share']:.0f} % |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs per concurrency and setting (medians are printed)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the (synchronous) phase profile; print the timed table only")
    args = ap.parse_args(argv)

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    model = args.model
    if model is None:
        from server.demo_model import ensure_demo_checkpoint
        model = ensure_demo_checkpoint()
    max_c = max(args.concurrency)
    per_seq_blocks = -(-(args.prompt_len + args.gen_len) // 16)
    engine = LLMEngine(EngineConfig(
        model=model, backend=args.backend, max_num_seqs=max_c,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        num_kv_blocks=max_c * per_seq_blocks + 1))
    profile_run(engine, 2, 16, 4, seed=0)[0].detach()       # warm-up
    info = machine_info()
    print(f"# step profile: {model}, backend {args.backend}, {args.prompt_len} prompt + "
          f"{args.gen_len} output tokens per request\n# machine: {info['cpu']}, "
          f"{info['cores']} cores, load average at start {info['loadavg_start'][0]:.2f}")
    header = ("| concurrency | steps | seqs/step | tokens/step | " + " | ".join(PHASES)
              + " | other | step (ms) | host |\n|---|" + "---:|" * 11)
    rows = []
    for c in ([] if args.no_profile else args.concurrency):
        profile, wall = profile_run(engine, c, args.prompt_len, args.gen_len, seed=c)
        profile.detach()
        out_tok_s = c * args.gen_len / wall
        rows.append(table_row(f"{c}, decode", profile.decode_summary()))
        rows.append(table_row(f"{c}, all", profile.summary()))
        print(f"concurrency {c}: {out_tok_s:.0f} output tok/s over {wall:.1f} s", flush=True)
    if rows:
        print(header)
        print("\n".join(rows))
    print("\n| concurrency | async scheduling | decode step (ms, median) | output tok/s "
          "| forward gap (ms) | commit wait (ms) |\n|---:|---|---:|---:|---:|---:|")
    for c in args.concurrency:
        runs = {label: [] for label, _, _ in SETTINGS}
        for _ in range(args.repeat):       # alternated, so a change in load hits all alike
            for label, on, ahead in SETTINGS:
                runs[label].append(timed_run(engine, c, args.prompt_len, args.gen_len, seed=c,
                                             async_scheduling=on, schedule_ahead=ahead))
        for label, _, _ in SETTINGS:
            step_ms, tok_s, gap, wait = np.median(np.array(runs[label]), axis=0)
            print(f"| {c} | {label} | {step_ms:.2f} | {tok_s:.0f} | {gap:.3f} | {wait:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()

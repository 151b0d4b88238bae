"""The all-reduce's cost per layer on the CPU (MPI), through Taper's communicator against a plain
mpi4py loop on the same buffers in the same run, and the share of a tensor-parallel-2 decode
step that its all-reduces take.

    python -m bench.allreduce [--hidden 768 4096] [--iters 200] [--tokens 32]

1. Collectives alone: this script re-runs itself under the mpich wheel's mpiexec with 2 ranks.
   For each float32 buffer, rows x hidden, decode rows 1, 2, 4, 8 and prefill rows 512, 1024,
   2048: Taper's MpiCommunicator.all_reduce (in place, as the sharded layers call it) and the
   reference, the same `comm.Allreduce(MPI.IN_PLACE, x, op=SUM)` straight from mpi4py (the
   collective library's own figure: the wheel ships no MPI benchmark binary), so the ratio is
   Taper's wrapper; beside them the out-of-place `Allreduce(send, recv)` that MPI benchmarks such
   as OSU's time (a copy more). Timed in alternating blocks
   of --iters calls (a twentieth of them for prefill sizes) between barriers, --blocks blocks
   each; the time per call of the best block and of the median one, on rank 0's clock. On a
   shared machine the best block is the collective's cost, the median what the load made of it.
   A layer has two all-reduces (after attention's O projection and after the MLP's down
   projection), so per layer = 2 x per call.
2. In a decode step: the 75 M checkpoint of bench/tensor_parallel.py (hidden 768, 8 layers) at
   tensor parallel 2, greedy decode of batch 1 and 8, rank 0's all_reduce timed from inside
   (a wrapper on the communicator, this process only): time in all-reduces during decode over
   the decode time. Rank 0's time in a collective includes waiting for rank 1 to arrive, so it
   is the cost the step sees, not the wire time alone; part 1's figure x the calls per step is
   the wire time.

The machine, its load average and the cores are printed with the tables: on a shared machine a
descheduled rank stalls the other at every collective, so only ratios within one run compare.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

DECODE_ROWS = (1, 2, 4, 8)
PREFILL_ROWS = (512, 1024, 2048)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def load() -> str:
    return "load average %.1f %.1f %.1f" % os.getloadavg()


# ---- 1. the collectives alone (each MPI rank runs this)

def collectives(hidden_sizes: list[int], iters: int, blocks: int) -> None:
    from mpi4py import MPI
    from engine.parallel.mpi import MpiCommunicator
    comm = MPI.COMM_WORLD
    taper = MpiCommunicator(comm)
    rank = comm.Get_rank()

    def timed(call, n):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(n):
            call()
        # rank 0's clock, after every rank has finished its n calls
        comm.Barrier()
        return (time.perf_counter() - start) / n

    if rank == 0:
        print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}, mpi4py "
              f"{__import__('mpi4py').__version__}, {comm.Get_size()} ranks")
        print("best block / median block, per call:")
        print("| rows x hidden | MB | Taper all_reduce (us) | mpi4py Allreduce in place (us) | "
              "Taper / mpi4py (best) | mpi4py out of place (us) | per layer, Taper best (us) | "
              "GB/s (Taper best) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for hidden in hidden_sizes:
        for rows in DECODE_ROWS + PREFILL_ROWS:
            x = np.ones((rows, hidden), np.float32)
            send, recv = np.ones_like(x), np.empty_like(x)
            n = iters if rows <= 8 else max(5, iters // 20)
            calls = (lambda: taper.all_reduce(x),                                  # Taper
                     lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),          # its call
                     lambda: comm.Allreduce(send, recv, op=MPI.SUM))               # OSU's form
            for call in calls:
                timed(call, max(2, n // 10))
            times = [[], [], []]
            for _ in range(blocks):
                for call, out in zip(calls, times):
                    out.append(timed(call, n))
            if rank == 0:
                best = [min(t) * 1e6 for t in times]
                mid = [statistics.median(t) * 1e6 for t in times]
                print(f"| {rows} x {hidden} | {x.nbytes / 1e6:.3f} | {best[0]:.1f} / {mid[0]:.1f} "
                      f"| {best[1]:.1f} / {mid[1]:.1f} | {best[0] / best[1]:.2f} | "
                      f"{best[2]:.1f} / {mid[2]:.1f} | {2 * best[0]:.1f} | "
                      f"{x.nbytes / best[0] / 1e3:.2f} |", flush=True)


# ---- 2. in a decode step (rank 0: this process, its workers spawned by the engine)

def decode_share(batch: int, tokens: int, runs: int) -> dict:
    from bench.tensor_parallel import SHAPE, make_checkpoint
    from engine import LLM, SamplingParams
    from engine.parallel import mpi
    spent = {"s": 0.0, "calls": 0, "on": False}
    plain = mpi.MpiCommunicator.all_reduce

    def counted(self, x):
        if not spent["on"]:
            return plain(self, x)
        start = time.perf_counter()
        plain(self, x)
        spent["s"] += time.perf_counter() - start
        spent["calls"] += 1

    mpi.MpiCommunicator.all_reduce = counted
    llm = LLM(make_checkpoint(), tensor_parallel_size=2, num_kv_blocks=512,
              enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, SHAPE["vocab_size"], 32).tolist() for _ in range(batch)]

    def generate(n):
        spent.update(s=0.0, calls=0, on=True)
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        spent["on"] = False
        return time.perf_counter() - start, spent["s"], spent["calls"]

    try:
        generate(4)                                    # warm-up
        rows = []
        for _ in range(runs):
            first_wall, first_ar, first_calls = generate(1)
            wall, ar, calls = generate(tokens)
            steps = tokens - 1
            rows.append(((wall - first_wall) / steps, (ar - first_ar) / steps,
                         (calls - first_calls) / steps))
    finally:
        llm.engine.shutdown()
        mpi.MpiCommunicator.all_reduce = plain
    step, ar, calls = (statistics.median(r[i] for r in rows) for i in range(3))
    return {"step_ms": step * 1e3, "allreduce_ms": ar * 1e3, "calls": calls,
            "share": ar / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[768, 4096])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--collectives-only", action="store_true")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)   # under mpiexec
    args = ap.parse_args()
    if args.rank:
        collectives(args.hidden, args.iters, args.blocks)
        return
    print(f"machine: {machine()}; {load()} (a shared machine: ratios within this run only)")
    from engine.parallel.mpi import import_mpi
    import_mpi()                                # puts the wheel's mpiexec on PATH if needed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "OMP_NUM_THREADS": "1"}
    subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "bench.allreduce", "--rank",
                    "--iters", str(args.iters), "--blocks", str(args.blocks),
                    "--hidden", *map(str, args.hidden)],
                   check=True, env=env, cwd=root)
    print(f"after the collectives: {load()}")
    if args.collectives_only:
        return
    print("\nTensor parallel 2 decode, bench/tensor_parallel.py's checkpoint (hidden 768, "
          f"8 layers), {args.tokens} tokens, median of {args.runs}:")
    print("| batch | decode step (ms) | all-reduces per step | in all-reduce per step (ms) | "
          "share of the step | load avg |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        r = decode_share(batch, args.tokens, args.runs)
        print(f"| {batch} | {r['step_ms']:.2f} | {r['calls']:.0f} | {r['allreduce_ms']:.2f} | "
              f"{100 * r['share']:.0f} % | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()

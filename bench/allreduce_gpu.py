"""The all-reduce on one GPU through Taper's NCCL communicator against CuPy's own NCCL call in the
same run, at decode and prefill sizes (the GPU half of bench/allreduce.py; gpu_check.sh's
figures suite runs it).

    python -m bench.allreduce_gpu [--hidden 4096 8192] [--iters 200]

One device is a world of one rank: NCCL still launches its all-reduce kernel (a copy in place),
so the figures are each call's fixed cost, Taper's wrapper (engine/parallel/nccl.py: the dtype
lookup, the stream, the pointers) over the library's, not the wire between devices; a machine
with several GPUs is where the bandwidth gets measured (pending: Taper's ranks meet through MPI,
which the GPU image lacks). For each bf16 buffer, rows x hidden, decode rows 1, 2, 4, 8 and
prefill rows 512, 1024, 2048: Taper's NcclCommunicator.all_reduce, and the reference,
`cupy.cuda.nccl.NcclCommunicator.allReduce` called directly on the same buffer and stream, each
timed with CUDA events around --iters calls, in alternating blocks (--blocks of each); the best
block's and the median block's time per call. Also both replayed from a captured CUDA graph of
--iters calls (how decode runs them), which leaves the device's time alone.
"""
from __future__ import annotations

import argparse
import statistics

DECODE_ROWS = (1, 2, 4, 8)
PREFILL_ROWS = (512, 1024, 2048)


class OneRank:
    """The MPI group's part NcclCommunicator uses, for a world of one (no MPI on the GPU image)."""
    rank, size = 0, 1

    def send(self, message):
        pass

    def allgather(self, value):
        return [value]


def timed(backend, call, n: int) -> float:
    """Seconds per call of n calls, by CUDA events on the backend's stream."""
    cp = backend.xp
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(backend.stream)
    for _ in range(n):
        call()
    end.record(backend.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=5)
    args = ap.parse_args()
    import cupy as cp
    from cupy.cuda import nccl
    from engine.parallel.nccl import NcclCommunicator, nccl_dtype
    from pyx.cuda_backend import CudaBackend
    from pyx.kernel_config import KernelConfig
    backend = CudaBackend(dtype="bf16", device=0, kernels=KernelConfig.parse(""))
    backend.bind_thread()
    taper = NcclCommunicator(OneRank(), backend)
    theirs = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()}, NCCL {nccl.get_version()}, CuPy {cp.__version__}, "
          f"a world of one rank, bf16")
    print("best block / median block, per call (us):")
    print("| rows x hidden | MB | Taper all_reduce | CuPy nccl allReduce | Taper / CuPy (best) | "
          "graph replay: Taper | graph replay: CuPy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for hidden in args.hidden:
        for rows in DECODE_ROWS + PREFILL_ROWS:
            x = cp.ones((rows, hidden), dtype=cp.float32).astype(backend.act_dtype)
            kind = nccl_dtype(nccl, x.dtype)
            stream = backend.stream.ptr
            mine = lambda: taper.all_reduce(x)                                # noqa: E731
            ref = lambda: theirs.allReduce(x.data.ptr, x.data.ptr, x.size, kind,  # noqa: E731
                                           nccl.NCCL_SUM, stream)
            n = args.iters
            timed(backend, mine, 10)
            timed(backend, ref, 10)
            a, b = [], []
            for _ in range(args.blocks):
                a.append(timed(backend, mine, n))
                b.append(timed(backend, ref, n))
            replays = []
            for call in (mine, ref):
                graph = backend.capture_graph(lambda call=call: [call() for _ in range(n)])
                graph.launch()
                replays.append(min(timed(backend, graph.launch, 1) / n
                                   for _ in range(args.blocks)))
            ta, tb = min(a) * 1e6, min(b) * 1e6
            print(f"| {rows} x {hidden} | {x.nbytes / 1e6:.3f} | "
                  f"{ta:.1f} / {statistics.median(a) * 1e6:.1f} | "
                  f"{tb:.1f} / {statistics.median(b) * 1e6:.1f} | {ta / tb:.2f} | "
                  f"{replays[0] * 1e6:.2f} | {replays[1] * 1e6:.2f} |", flush=True)
    taper.close()
    theirs.destroy()


if __name__ == "__main__":
    main()

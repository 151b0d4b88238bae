"""The host side of a CUDA decode step's inputs, measured on the CPU: bytes copied host-to-device
per step and host time to prepare and pack a step, with the device-resident block tables
(engine/runner/device_block_tables.py) and, given --before REV, with the code of git revision REV
beside them (its engine/{forward_batch,input_buffers,cuda_graph,model_runner}.py, loaded under
another package name).

    python -m bench.decode_inputs                                # this code only
    python -m bench.decode_inputs --before da2751b               # before/after, alternating
    python -m bench.decode_inputs --seqs 16 64 256 --max-model-len 4096 131072 --steps 200

No GPU and no model: B sequences of --context tokens decode one token a step (each gains a block
every 16 tokens, staggered), through ModelRunner.prepare and the decode graph runner of each
version on a fake backend whose "graph" does nothing and whose host-to-device copy only counts
(a copy from pinned memory costs the host an enqueue, whatever its size). Timed per step, as
ModelRunner.execute does it for a decode step: prepare, the block-table update (after only; its
scatter is a NumPy op here, a CuPy launch on a GPU), CudaGraphRunner.run (pack the static
inputs, copy, launch). The two versions alternate in turns of --run steps; medians. Also
printed: the bytes the eager CUDA path copies per step (every batch array, plus the update).
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

MODULES = ("forward_batch", "input_buffers", "cuda_graph", "model_runner")
BLOCK_SIZE = 16


def load_version(rev: str):
    """The engine modules of git revision `rev` as a package of their own (imports among them
    rewritten; everything else comes from this checkout)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    name = "engine_at_" + rev.replace("-", "_").replace("~", "_").replace("^", "_")
    folder = tempfile.mkdtemp(prefix="decode_inputs_")
    os.makedirs(os.path.join(folder, name))
    open(os.path.join(folder, name, "__init__.py"), "w").close()
    for module in MODULES:
        text = subprocess.run(["git", "show", f"{rev}:engine/{module}.py"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
        for other in MODULES:
            text = text.replace(f"from engine.{other} import", f"from {name}.{other} import")
        with open(os.path.join(folder, name, f"{module}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, folder)
    return types.SimpleNamespace(**{m: importlib.import_module(f"{name}.{m}") for m in MODULES})


def this_version():
    return types.SimpleNamespace(**{m: importlib.import_module(f"engine.{m}") for m in MODULES})


class CountingBackend:
    """NumPy arrays stand for device arrays; copies are counted, not made; graphs do nothing."""

    def __init__(self):
        self.xp = types.SimpleNamespace(zeros=np.zeros, empty=np.zeros, copyto=np.copyto)
        self.copied = 0           # bytes

    def kv_cache_dtype(self, kind):
        return np.float32

    def asarray(self, a):
        return np.array(a)

    def pinned_empty(self, n, dtype):
        return np.zeros(n, dtype)

    def copy_to_device_async(self, dst, src):
        self.copied += src.nbytes

    def new_graph_pool(self):
        return types.SimpleNamespace(total_bytes=lambda: 0)

    def use_graph_pool(self, pool):
        import contextlib
        return contextlib.nullcontext()

    def capture_graph(self, fn):
        fn()
        return types.SimpleNamespace(launch=lambda: None)

    def synchronize(self):
        pass


class StubModel:
    def kv_cache_shape(self, num_blocks, block_size):
        return (1,)

    def new_kv_caches(self, num_blocks, block_size, dtype):
        return [(np.zeros(1, dtype), np.zeros(1, dtype))]

    def forward(self, batch, kv_caches):
        return np.zeros((len(batch.seq_lens), 8), np.float32)


class Setup:
    """One version's runner, graph runner and sequences."""

    def __init__(self, version, num_seqs: int, max_model_len: int, context: int):
        from engine.core.sequence import Sequence
        self.version = version
        self.backend = CountingBackend()
        config = types.SimpleNamespace(num_hidden_layers=1)
        runner = version.model_runner.ModelRunner(StubModel(), config, self.backend, BLOCK_SIZE,
                                                  num_blocks=1)
        self.runner = runner
        max_blocks = -(-max_model_len // BLOCK_SIZE)
        args = [StubModel(), self.backend, runner.kv_caches, num_seqs, max_blocks]
        self.device_tables = getattr(runner, "device_block_tables", None)
        if self.device_tables is not None:
            args.append(self.device_tables)
        self.graphs = version.cuda_graph.CudaGraphRunner(*args)
        self.graphs.capture()
        self.next_block = 1
        self.seqs = []
        for i in range(num_seqs):
            n = context + i              # staggered: they gain blocks on different steps
            seq = Sequence([i % 200] * n)
            seq.num_computed_tokens = n - 1
            seq.block_table = [self._block() for _ in range(-(-n // BLOCK_SIZE))]
            self.seqs.append(seq)

    def _block(self):
        self.next_block += 1
        return self.next_block

    def schedule(self):
        from engine.core.scheduler import SchedulerOutput
        out = SchedulerOutput()
        for seq in self.seqs:
            out._add(seq, 1)
        return out

    def step(self, sched) -> tuple[float, int, int]:
        """(seconds of host work, bytes the graph path copied, bytes the eager path would)."""
        copied = self.backend.copied
        start = time.perf_counter()
        batch = self.runner.prepare(sched)
        if self.device_tables is not None:
            self.device_tables.apply(batch.block_table_update)
        assert self.graphs.can_run(batch)
        self.graphs.run(batch)
        seconds = time.perf_counter() - start
        graph_bytes = self.backend.copied - copied
        eager = sum(getattr(batch, f).nbytes for f in
                    ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                     "block_tables", "block_table_rows", "logits_indices")
                    if isinstance(getattr(batch, f, None), np.ndarray))
        update = getattr(batch, "block_table_update", None)
        if update is not None:
            eager += update.packed.nbytes if update.table is None else update.table.nbytes
        for seq in self.seqs:             # the token computed; its successor appended
            seq.num_computed_tokens += 1
            seq.append_token(7)
            if seq.num_tokens > len(seq.block_table) * BLOCK_SIZE:
                seq.block_table.append(self._block())
        return seconds, graph_bytes, eager


def measure(versions: dict, num_seqs: int, max_model_len: int, context: int, steps: int,
            warmup: int, run: int) -> dict:
    """Each version runs `run` steps in turn (the first of each turn not timed: the other
    version's megabytes of packing leave it a cold cache), until each timed `steps`."""
    setups = {name: Setup(v, num_seqs, max_model_len, context) for name, v in versions.items()}
    results = {name: ([], [], []) for name in versions}
    for name, setup in setups.items():
        for _ in range(warmup):
            setup.step(setup.schedule())
    while len(results[next(iter(versions))][0]) < steps:
        for name, setup in setups.items():
            for k in range(run + 1):
                seconds, graph_bytes, eager_bytes = setup.step(setup.schedule())
                if k:
                    for column, value in zip(results[name], (seconds, graph_bytes,
                                                             eager_bytes)):
                        column.append(value)
    return {name: (float(np.median(t)) * 1e6, float(np.mean(g)), float(np.mean(e)))
            for name, (t, g, e) in results.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="REV", help="also measure git revision REV's code")
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 131072])
    parser.add_argument("--context", type=int, default=2000,
                        help="tokens of context per sequence (default 2000)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--run", type=int, default=10,
                        help="steps of one version before the other's turn (default 10)")
    args = parser.parse_args(argv)
    versions = {}
    if args.before:
        versions["before"] = load_version(args.before)
    versions["after"] = this_version()
    print(f"decode step inputs: {args.context}-token contexts, block size {BLOCK_SIZE}, "
          f"{args.steps} steps (median host time; mean bytes host-to-device per step)")
    head = "| seqs | max_model_len |"
    for name in versions:
        head += f" {name}: host us | {name}: graph H2D bytes | {name}: eager H2D bytes |"
    print(head)
    print("|" + "---|" * (2 + 3 * len(versions)))
    for max_model_len in args.max_model_len:
        for num_seqs in args.seqs:
            got = measure(versions, num_seqs, max_model_len, args.context, args.steps,
                          args.warmup, args.run)
            row = f"| {num_seqs} | {max_model_len} |"
            for name in versions:
                us, graph_bytes, eager_bytes = got[name]
                row += f" {us:.0f} | {graph_bytes:,.0f} | {eager_bytes:,.0f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()

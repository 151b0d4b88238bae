"""Where a pipeline stage's time goes (bench/pipeline_bubble.py reads it), off unless the
environment names a file prefix: TAPER_PIPELINE_PROFILE=/tmp/pp makes every rank of a
pipeline-parallel engine (the spawned workers inherit the variable: it must be set before the
process spawns its first workers, since MPI fixes the workers' environment then) append one line
per step to
/tmp/pp.stage<S>.tp<R>.jsonl (stage S, tensor-parallel rank R):

    {"stage": s, "start": t0, "end": t1, "waited": w, "micro_batches": m, "tokens": n}

t0 and t1 bound the rank's part of the step (time.perf_counter: CLOCK_MONOTONIC, one clock for
every process of the machine, so the ranks' lines line up), w the time in it spent waiting on
the neighbouring stages: receiving the residual stream or the logits, and the flush that waits
for the next stage to take what was sent. The rest of [t0, t1] is the stage computing. On CUDA
a receive is queued, not waited for, so the split is the CPU backend's.
"""
from __future__ import annotations

import json
import os
import time

VARIABLE = "TAPER_PIPELINE_PROFILE"


class WaitTimed:
    """A stage's communicator whose receives and flushes count the time they wait."""

    def __init__(self, comm):
        self.comm = comm
        self.waited = 0.0

    def recv(self, x, peer: int) -> None:
        start = time.perf_counter()
        self.comm.recv(x, peer)
        self.waited += time.perf_counter() - start

    def flush(self) -> None:
        start = time.perf_counter()
        self.comm.flush()
        self.waited += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.comm, name)


class StageProfile:
    """One rank's step records, written as they come (a line per step)."""

    def __init__(self, prefix: str, stage):
        self.stage = stage
        self.comm = WaitTimed(stage.comm)
        object.__setattr__(stage, "comm", self.comm)      # the stage's layers receive through it
        self.file = open(f"{prefix}.stage{stage.stage}.tp{stage.tp_rank}.jsonl", "a",
                         buffering=1)
        self.start = 0.0

    @classmethod
    def from_environment(cls, stage):
        prefix = os.environ.get(VARIABLE)
        return cls(prefix, stage) if prefix else None

    def begin(self) -> None:
        self.comm.waited = 0.0
        self.start = time.perf_counter()

    def end(self, micro_batches: int, tokens: int) -> None:
        self.file.write(json.dumps({
            "stage": self.stage.stage, "start": self.start, "end": time.perf_counter(),
            "waited": self.comm.waited, "micro_batches": micro_batches, "tokens": tokens}) + "\n")

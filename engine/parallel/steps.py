"""Rank 0 sends each step's inputs; the other ranks run the same forward on them.

A step's inputs (StepInputs) are the batch as ModelRunner.prepare made it on rank 0: host arrays
of token ids, positions, slots, offsets and lengths, each sequence's row of the block table, and
the table's changes since the previous step (a BlockTableUpdate: a few ids a step), never whole
tables; every rank keeps its own copy of the table and applies the changes in step order (the
DeviceBlockTables of engine/runner/device_block_tables.py, over host arrays on the CPU). Also:
the rows a step pools for embeddings and scores through the LM head (each collective rank 0 runs,
the others run too), KV block copies of beam forks made since the previous step, a hybrid
model's state rows copied after a verify step (each slot takes the state after its accepted
drafts), and the CUDA graph bucket rank 0 chose for each micro-batch (the others replay the same:
the graphs hold the collectives, engine/runner/cuda_graph.py). LoRA adapters
(engine/lora/manager.py): the step's rows grouped by slot with the adapters' ids, so every rank
writes the same slots at the same step, and the ids of adapters rank 0 has dropped since; an
adapter loaded on rank 0 is a message of its own (LoraLoad: its name, path and id), which every
rank answers once it has read its share, so a load returns only when every rank holds the adapter
and a rank that cannot read it is an error naming the rank, not a hang.

Sampling, scheduling and everything above stay on rank 0: the others see forward passes only
(and, with an MTP head, its drafting forwards: a DraftStep before each, engine/parallel/
draft_steps.py). A draft model or an EAGLE-3 head runs on rank 0 alone.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("taper.parallel")

STOP = "stop"


@dataclass(slots=True)
class StepInputs:
    batch: object                          # a ForwardBatch (engine/runner/forward_batch.py)
    hidden_rows: np.ndarray | None = None  # rows whose final hidden states are pooled
    score_rows: np.ndarray | None = None   # of those, the rows put through the LM head
    block_copies: list = field(default_factory=list)   # (src, dst) KV blocks, before the step
    # The CUDA graph bucket (size, query_len) each micro-batch replays (one for tensor parallel
    # alone), as rank 0 chose it, or None: the step runs eagerly on every rank
    # (CudaGraphRunner.choose: the graphs hold the collectives, so the ranks must agree).
    graphs: tuple | None = None
    # A hybrid model's verified state rows (src, dst) copied after the previous (verify) step
    # (ModelRunner.keep_verified_states), before this one.
    state_copies: list = field(default_factory=list)
    # ids of the LoRA adapters rank 0 no longer holds (engine/lora/manager.py), before this step
    lora_retired: list = field(default_factory=list)


@dataclass(slots=True)
class LoraLoad:
    """Rank 0 has loaded a LoRA adapter: every rank reads its share and answers."""
    name: str
    path: str
    id: int


class HostArrays:
    """The array calls DeviceBlockTables makes, on host arrays (a CPU rank's copy of the block
    table)."""
    xp = np

    @staticmethod
    def asarray(a):
        return np.asarray(a)

    @staticmethod
    def pinned_empty(n, dtype):
        return np.empty(n, dtype)

    @staticmethod
    def copy_to_device_async(dst, src):
        np.copyto(dst, src)


class StepSender:
    """Rank 0's end: each step's inputs to the other ranks, then their stop.

    A worker that dies leaves rank 0 waiting in its next collective for good (MPI has no
    timeout), so a watchdog thread checks the workers' processes twice a second and, when one is
    gone, says so, hands the message to `on_death` (the server's engine fails its open requests
    with it: engine/async_engine.py), gives their error responses `grace` seconds to go out, and
    ends rank 0's process with exit status 1: a clear error and an exit, never a hang."""

    def __init__(self, group, worker_pids: list[int] | None = None, check_every: float = 0.5,
                 kind: str = "tensor parallel", grace: float = 2.0, watch=None):
        """watch: (description, is alive) of each worker that is not a process of this machine
        (a Ray actor's); else each worker's pid is watched."""
        self.group = group
        self.stopped = False
        self.broken = None          # why the group cannot run another step (abandon)
        self._ending = threading.Lock()
        # the steps (engine thread) and LoRA loads (the server's threads) take turns on the
        # channel: its messages reach every rank in one order
        self._lock = threading.Lock()
        self.worker_pids = worker_pids or []
        self.kind, self.grace = kind, grace
        self.on_death = None        # called with the message, from the watchdog's thread
        self.watch = watch or [(f"pid {pid}", lambda pid=pid: _alive(pid))
                               for pid in self.worker_pids]
        if self.watch:
            threading.Thread(target=self._watch, args=(check_every,), daemon=True,
                             name="taper-tp-watchdog").start()

    def _watch(self, every: float) -> None:
        while not self.stopped:
            time.sleep(every)
            for rank, (what, alive) in enumerate(self.watch, start=1):
                if not self.stopped and not alive():
                    self._end(f"{self.kind} rank {rank} ({what}) has died; the model cannot run "
                              f"without it: exiting")

    @contextmanager
    def running(self):
        """Around rank 0's forwards of a step (the draft's, the target's, the head's mirror),
        which the other ranks run with it: one that raises abandons the group."""
        try:
            yield
        except Exception as e:
            self.abandon(f"{type(e).__name__}: {e}")
            raise

    def abandon(self, problem: str) -> None:
        """Rank 0's part of a step failed after the step went out: the other ranks wait in a
        receive or collective of it for good (MPI cannot cancel them), where the next step would
        meet them with the wrong data, and leaving the group (a collective) would wait on them.
        So the group ends as when a worker dies: the open requests fail with the problem, the
        workers are ended and rank 0 exits with status 1. No step is sent meanwhile."""
        self.broken = (f"{self.kind}: rank 0's forward failed ({problem}); the other ranks "
                       f"cannot finish the step: exiting")
        threading.Thread(target=self._end, args=(self.broken,), daemon=True,
                         name="taper-tp-abandon").start()

    def _end(self, message: str) -> None:
        with self._ending:      # the watchdog and a failed step may both get here: one ends
            log.critical("%s", message)
            if self.on_death is not None:
                try:
                    self.on_death(message)
                    time.sleep(self.grace)
                except Exception:       # the exit below matters more
                    log.exception("failing the open requests")
            for pid in self.worker_pids:    # a worker waiting in a collective never notices
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            logging.shutdown()
            os._exit(1)

    def send(self, inputs: StepInputs) -> None:
        with self._lock:
            if self.broken:
                raise RuntimeError(self.broken)
            self.group.send(inputs)

    def load_lora(self, name: str, path: str, adapter_id: int) -> None:
        """Every other rank reads its share of the adapter rank 0 has read; a LoraError naming
        the first rank that could not."""
        from engine.lora.adapter import LoraError
        with self._lock:
            if self.stopped or self.broken:
                raise LoraError(f"LoRA adapter {name!r}: the engine has stopped")
            self.group.send(LoraLoad(name, path, adapter_id))
            answers = self.group.allgather(None)
        for rank, problem in enumerate(answers):
            if problem is not None:
                raise LoraError(f"LoRA adapter {name!r} ({path}): {self.kind} rank {rank} "
                                f"could not read its share: {problem}")

    def stop(self) -> None:
        """The workers leave their loop and exit; the group is closed."""
        with self._lock:
            if not self.stopped and not self.broken:
                self.stopped = True
                self.group.send(STOP)
                self.group.close()


def serve_steps(runner, group, drafts=None) -> int:
    """A worker rank's loop: run each step rank 0 sends until its stop; returns the steps run.
    drafts: an MTP head's PeerDrafts (engine/parallel/draft_steps.py), which runs rank 0's
    drafting forwards and mirrors each step."""
    from engine.parallel.draft_steps import DraftStep
    steps = 0
    while True:
        message = group.receive()
        if isinstance(message, DraftStep):
            drafts.run(message)
            continue
        if message == STOP:
            log.info("tensor parallel rank %d: stopped by rank 0 after %d steps", group.rank,
                     steps)
            return steps
        if isinstance(message, LoraLoad):
            group.allgather(_load_lora(runner.lora, message))
            continue
        if message.lora_retired:
            runner.lora.drop(message.lora_retired)
        runner.copy_blocks(message.block_copies)
        for src, dst in message.state_copies:
            runner.model.copy_state_rows(runner.kv_caches, src, dst)
        runner.run(message)
        if drafts is not None:
            drafts.mirror(message.batch)
        steps += 1


def _load_lora(manager, message: LoraLoad) -> str | None:
    """This rank's share of the adapter read; what went wrong, or None."""
    try:
        manager.load_for_rank0(message.name, message.path, message.id)
    except Exception as e:      # answered to rank 0, which reports it
        log.error("LoRA adapter %s: %s", message.name, e)
        return f"{type(e).__name__}: {e}"
    return None


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a dead child of ours not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

"""Starting a tensor-parallel engine's ranks and keeping their start-up in step.

Rank 0 (engine/core/builder.py) checks what it can before any worker exists (the split of the
model's heads and sizes, the features not yet split), spawns the workers (engine/parallel/mpi.py)
and sends them its EngineConfig; then every rank builds its share of the engine the same way. A
stage that fails on any rank fails on all (`all_ranks`): rank 0 raises the failure, naming the
rank, and the workers exit, so a start-up error is one clear line and never a hang.
"""
from __future__ import annotations

import atexit
import logging
from contextlib import contextmanager

log = logging.getLogger("taper.parallel")


class WorkerStop(Exception):
    """A worker's start-up failed somewhere (rank 0 reports it): the worker exits."""


def check_supported(config) -> None:
    """What tensor parallel does not split yet, refused before any worker starts."""
    spec = config.speculative_config
    if spec is not None and spec.method in ("draft_model", "eagle3", "mtp"):
        what = {"draft_model": "a draft model", "eagle3": "an EAGLE-3 head",
                "mtp": "an MTP head"}[spec.method]
        raise ValueError(f"tensor parallel: speculative decoding with {what} is not yet "
                         f"supported (n-gram speculation is)")
    if config.backend not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallel: unknown backend {config.backend!r}")


def check_model(config) -> None:
    """The model's split (heads, sizes, format) checked from its config.json, before spawning;
    a GGUF's config is read with its tensors, so it is checked as the ranks load."""
    if config.weight_file:
        return
    from engine.loader.hub import resolve_model
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    ShardPlan(ModelConfig.from_pretrained(resolve_model(config.model)), 0,
              config.tensor_parallel_size)


def start_group(config):
    """Rank 0: the workers started and sent the config; their stop is registered at exit."""
    from engine.parallel.mpi import MpiGroup
    check_supported(config)
    check_model(config)
    log.info("tensor parallel %d: starting %d worker processes", config.tensor_parallel_size,
             config.tensor_parallel_size - 1)
    group = MpiGroup.spawn(config.tensor_parallel_size)
    group.send(config)
    return group


def communicator(group, backend):
    """The collectives' library for the backend: MPI's on the CPU, NCCL's on CUDA."""
    if getattr(backend, "xp", None) is not None and backend.xp.__name__ == "cupy":
        from engine.parallel.nccl import NcclCommunicator
        return NcclCommunicator(group, backend)
    return group.tensor_communicator()


@contextmanager
def all_ranks(group, stage: str):
    """Runs a start-up stage on every rank; if it failed anywhere, every rank stops."""
    error = None
    try:
        yield
    except Exception as e:          # reported to every rank below
        error = e
    messages = group.allgather(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    group.close()
    if group.rank != 0:
        raise WorkerStop(f"rank {failed[0][0]} failed while {stage}") from error
    if error is not None:
        raise error
    rank, message = failed[0]
    raise RuntimeError(f"tensor parallel rank {rank} failed while {stage}: {message}")


def stop_at_exit(sender) -> None:
    """Workers must not outlive rank 0's engine, however its process ends."""
    atexit.register(sender.stop)

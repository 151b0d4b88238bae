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


def kind(config) -> str:
    """How the model is split, for messages: tensor parallel, pipeline parallel, or both."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return "tensor parallel"
    return "pipeline parallel" if tp == 1 else "tensor and pipeline parallel"


def sizes(config) -> str:
    """"tensor parallel 2", "pipeline parallel 2", "tensor and pipeline parallel 2 x 2"."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    return f"{kind(config)} {tp if pp == 1 else pp if tp == 1 else f'{tp} x {pp}'}"


def check_supported(config) -> None:
    """What tensor and pipeline parallel do not split yet, refused before any worker starts."""
    spec = config.speculative_config
    method = spec.method if spec is not None else None
    if method in ("eagle3", "mtp") and config.pipeline_parallel_size > 1:
        what = {"eagle3": "an EAGLE-3 head", "mtp": "an MTP head"}[method]
        raise ValueError(f"{kind(config)}: speculative decoding with {what} is not yet "
                         f"supported (n-gram speculation and a draft model are; {what} under "
                         f"tensor parallel alone)")
    if config.backend not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallel: unknown backend {config.backend!r}")


def check_model(config) -> None:
    """The model's split (heads, sizes, format) checked from its config.json, before spawning;
    a GGUF's config is read with its tensors, so it is checked as the ranks load."""
    if config.weight_file:
        return
    from engine.loader.hub import resolve_model
    from engine.models.model_config import ModelConfig
    from engine.parallel.pipeline import check_model as check_stages, model_stage_layers
    from engine.parallel.sharding import ShardPlan
    model_config = ModelConfig.from_pretrained(resolve_model(config.model))
    if config.tensor_parallel_size > 1:
        ShardPlan(model_config, 0, config.tensor_parallel_size, config.enable_expert_parallel)
    if config.pipeline_parallel_size > 1:
        check_stages(model_config)
        model_stage_layers(model_config, config.pipeline_parallel_size)


def start_group(config):
    """Rank 0: the workers started and sent the config; their stop is registered at exit."""
    from engine.parallel.mpi import MpiGroup
    check_supported(config)
    check_model(config)
    log.info("%s: starting %d worker processes", sizes(config), config.world_size - 1)
    if config.distributed_executor == "ray":
        from engine.parallel import ray_executor
        group = ray_executor.start_group(config)
    else:
        group = MpiGroup.spawn(config.world_size)
    group.send(config)
    return group


def communicator(group, backend):
    """The collectives' library for the backend: MPI's on the CPU, NCCL's on CUDA."""
    if getattr(backend, "xp", None) is not None and backend.xp.__name__ == "cupy":
        from engine.parallel.nccl import NcclCommunicator
        return NcclCommunicator(group, backend)
    return group.tensor_communicator()


def communicators(group, backend, config):
    """The loader's (tensor_parallel, pipeline) of this rank: (rank, size, communicator) within
    its stage or None, and (stage, stages, tensor-parallel rank, communicator along its chain of
    stages) or None. Ranks are numbered stage by stage (engine/parallel/pipeline.py)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return (group.rank, group.size, communicator(group, backend)), None
    stage, tp_rank = divmod(group.rank, tp)
    # every rank makes both splits, in this order (each is a collective of the whole group)
    within_stage = group.split(stage, tp_rank)
    along_stages = group.split(tp_rank, stage)
    tensor_parallel = None
    if tp > 1:
        tensor_parallel = (tp_rank, tp, split_communicator(group, within_stage, backend))
    return tensor_parallel, (stage, pp, tp_rank, split_communicator(group, along_stages,
                                                                      backend))


def split_communicator(group, sub, backend):
    """A communicator over the ranks of `sub` (an mpi4py communicator split from the group)."""
    if getattr(backend, "xp", None) is not None and backend.xp.__name__ == "cupy":
        from engine.parallel.nccl import NcclCommunicator
        return NcclCommunicator(group, backend, sub)
    from engine.parallel.mpi import MpiCommunicator
    return MpiCommunicator(sub)


def check_same_buckets(group, graphs) -> None:
    """Every rank captured the same CUDA graph buckets (each replays the one rank 0 names, its
    collectives matching the other ranks'); else a ValueError naming the rank that differs."""
    mine = sorted(graphs.buckets)
    for rank, theirs in enumerate(group.allgather(mine)):
        if theirs != mine:
            raise ValueError(f"rank {group.rank} captured CUDA graphs for buckets {mine}, rank "
                             f"{rank} for {theirs}: the ranks must capture the same")


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
    raise RuntimeError(f"rank {rank} of {group.size} failed while {stage}: {message}")


def stop_at_exit(sender) -> None:
    """Workers must not outlive rank 0's engine, however its process ends."""
    atexit.register(sender.stop)

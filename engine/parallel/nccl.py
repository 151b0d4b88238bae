"""NCCL through CuPy (`cupy.cuda.nccl`): the CUDA backend's collectives, queued on the backend's
own stream, so they order with the kernels around them and a decode step's CUDA graph captures
them with the rest (NCCL supports stream capture).

The ranks are the MPI group's (engine/parallel/mpi.py): rank 0 makes NCCL's unique id and the
group's control channel carries it to the others; each rank then joins the NCCL communicator on
its own device (the backend's). Activations are bf16 or f16 (NCCL reduces both natively);
logits gathered for the LM head are float32.

Not yet run: this machine has no GPU. The first GPU window runs tests/gpu/ with it (a rank of
one) and the multi-GPU check where a machine has several.
"""
from __future__ import annotations

import numpy as np

from engine.parallel.communicator import Communicator

NCCL_MISSING = ("tensor parallel on CUDA needs NCCL through CuPy (cupy.cuda.nccl): install the "
                "nvidia-nccl-cu12 (or -cu13) wheel beside cupy")


def import_nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise ImportError(f"{NCCL_MISSING} ({e})") from None
    if not getattr(nccl, "available", True):
        raise ImportError(NCCL_MISSING)
    return nccl


def nccl_dtype(nccl, dtype) -> int:
    import ml_dtypes
    dtype = np.dtype(dtype)
    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
             np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64}
    if hasattr(nccl, "NCCL_BFLOAT16"):
        table[np.dtype(ml_dtypes.bfloat16)] = nccl.NCCL_BFLOAT16
    if dtype not in table:
        raise ValueError(f"NCCL collectives: no NCCL type for {dtype}")
    return table[dtype]


class NcclCommunicator(Communicator):
    """Over the whole group, or over `sub` (an mpi4py communicator split from it: a pipeline
    stage's tensor-parallel ranks, or one chain of stages), whose MPI ranks carry the unique
    id and the start-up's small agreements."""

    def __init__(self, group, backend, sub=None):
        nccl = self.nccl = import_nccl()
        self.backend = backend
        self.sub = sub
        if sub is None:
            self.rank, self.world_size = group.rank, group.size
            uid = nccl.get_unique_id() if group.rank == 0 else None
            if group.rank == 0:
                group.send(uid)
            else:
                uid = group.receive()
        else:
            self.rank, self.world_size = sub.Get_rank(), sub.Get_size()
            uid = sub.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        backend.bind_thread()               # NCCL binds the communicator to the current device
        self.comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)
        # the start-up's small agreements (a pool size) travel on the MPI group
        self.group = group

    @property
    def _stream(self) -> int:
        return self.backend.stream.ptr

    def all_reduce(self, x) -> None:
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl_dtype(self.nccl, x.dtype),
                            self.nccl.NCCL_SUM, self._stream)

    def all_gather(self, x):
        x = self.backend.xp.ascontiguousarray(x)
        out = self.backend.xp.empty((self.world_size, *x.shape), x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, nccl_dtype(self.nccl, x.dtype),
                            self._stream)
        return out

    def all_min(self, value: int) -> int:
        if self.sub is not None:
            return min(self.sub.allgather(int(value)))
        return min(self.group.allgather(int(value)))

    # Point to point, queued on the backend's stream: kernels after a send wait for it there,
    # so the caller's buffer may be reused at once, and flush has nothing to wait for.

    def send(self, x, peer: int) -> None:
        x = self.backend.xp.ascontiguousarray(x)
        self.comm.send(x.data.ptr, x.size, nccl_dtype(self.nccl, x.dtype), peer, self._stream)

    def recv(self, x, peer: int) -> None:
        self.comm.recv(x.data.ptr, x.size, nccl_dtype(self.nccl, x.dtype), peer, self._stream)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.comm.destroy()

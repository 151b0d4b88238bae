"""The one interface sharded layers and the step broadcast talk through (DESIGN.md section 8:
workers and collectives). Implementations wrap maintained libraries: MPI through mpi4py on the CPU
backend (engine/parallel/mpi.py), NCCL through CuPy on GPUs (engine/parallel/nccl.py); with one
rank, SingleProcess does nothing at all (it has no peer to send to), so the graph's code is the same at any size.

Array arguments are the backend's (NumPy or CuPy), C-contiguous; collectives are called by every
rank in the same order (the step broadcast guarantees it: every rank runs the same forward).
"""
from __future__ import annotations


class Communicator:
    """rank, world_size and the collectives. Subclasses implement all of them."""
    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x) -> None:
        """x = the sum of every rank's x, in place."""
        raise NotImplementedError

    def all_gather(self, x):
        """A new array (world_size, *x.shape): every rank's x, in rank order."""
        raise NotImplementedError

    def all_min(self, value: int) -> int:
        """The smallest of every rank's integer (the ranks agree on a KV pool size)."""
        raise NotImplementedError

    # Point to point (pipeline parallel: a stage's activations to the next stage). A send
    # returns at once, x free to be reused; `flush` waits until every send so far was received.
    # A recv returns with x filled (on CUDA: x is filled in stream order, like a kernel).

    def send(self, x, peer: int) -> None:
        raise NotImplementedError

    def recv(self, x, peer: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Frees the library's resources; the communicator is unusable after."""


class SingleProcess(Communicator):
    """World size 1: every collective is the identity."""

    def all_reduce(self, x) -> None:
        pass

    def all_gather(self, x):
        return x.reshape((1, *x.shape))

    def all_min(self, value: int) -> int:
        return value

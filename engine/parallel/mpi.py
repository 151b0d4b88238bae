"""MPI through mpi4py: how the ranks of a tensor-parallel engine find each other, the channel rank 0
sends each step's inputs on, and the CPU backend's collectives.

Rank 0 is the process that builds the engine (the server, or a script's `LLM`); it starts the
other ranks itself with MPI_Comm_spawn (`python -m engine.parallel.worker`), so no launcher wraps
the server: MPICH's singleton start runs the mpiexec beside it (the `mpich` wheel's) to place
them. Parent and workers merge into one intracommunicator, rank 0 first.

Waiting between steps: MPICH's blocking calls poll, which would keep an idle worker's core busy
(a third of a core here while rank 0 waited for requests). A worker waits for the next message's
header with a nonblocking broadcast that it tests, sleeping between tests once it has waited a
little, and checks on the way that rank 0 still exists (a rank 0 killed outright sends no stop).
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
import time

import numpy as np

from engine.parallel.communicator import Communicator

MPI_MISSING = ("tensor parallel needs mpi4py and an MPI library: pip install 'taper[mpi]' "
               "(mpi4py and the mpich wheel)")


def import_mpi():
    """mpi4py's MPI module, or an ImportError saying how to install it. The spawn needs an
    mpiexec on PATH: the mpich wheel installs one beside this Python, which is added if PATH
    lacks one (a server started by its full path, without its environment activated)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"{MPI_MISSING} ({e})") from None
    if shutil.which("mpiexec") is None:
        here = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(here, "mpiexec")):
            os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    return MPI


class MpiGroup:
    """The ranks of one engine: `comm` carries control messages (step inputs, agreement on start-up
    results); `tensors` (a duplicate, so the two never interleave) the collectives."""

    def __init__(self, comm, parent_pid: int | None = None):
        self.MPI = import_mpi()
        self.comm = comm
        self.tensors = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.parent_pid = parent_pid       # a worker's rank 0 process, watched while idle
        self._header = np.zeros(1, np.int64)
        self.closed = False
        self._splits = []           # communicators split from `tensors`, left with the group
        # Workers started elsewhere (Ray: engine/parallel/ray_executor.py): rank 0's
        # (description, is alive) of each, and what releases them once the group is closed.
        self.watch = None
        self.cleanup = []

    @classmethod
    def spawn(cls, world_size: int) -> "MpiGroup":
        """Rank 0: starts world_size - 1 workers and merges with them."""
        MPI = import_mpi()
        if shutil.which("mpiexec") is None:
            raise ImportError(f"{MPI_MISSING}: no mpiexec found on PATH")
        # The workers import this package as rank 0 does, from wherever it was found.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        # MPICH forks an mpiexec to place the workers, which kills its whole process group if
        # rank 0 dies: the group of the shell or supervisor that started rank 0. So it is
        # forked from a process group of its own, rank 0 returning to its group after.
        group_before = os.getpgid(0)
        try:
            os.setpgid(0, 0)
            moved = True
        except OSError:         # a session leader: its group is its own already
            moved = False
        try:
            inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-m", "engine.parallel.worker"],
                                        maxprocs=world_size - 1)
        finally:
            if moved:
                os.setpgid(0, group_before)
        comm = inter.Merge(high=False)
        inter.Disconnect()
        group = cls(comm)          # (the same collectives, in the same order, as from_parent)
        group.comm.bcast(os.getpid(), root=0)
        return group

    @classmethod
    def accept(cls, world_size: int, start_workers) -> "MpiGroup":
        """Rank 0 of workers started elsewhere (Ray actors: engine/parallel/ray_executor.py):
        opens an MPI port, calls start_workers(port) (each worker then connects with its rank:
        `connect`), and takes them in one at a time, the group so far accepting each."""
        MPI = import_mpi()
        port = MPI.Open_port()
        start_workers(port)
        comm = MPI.COMM_SELF.Dup()
        for _ in range(world_size - 1):
            comm = _take_one(MPI, comm, port)
        MPI.Close_port(port)
        return cls._ranked(comm, 0)

    @classmethod
    def connect(cls, port: str, rank: int, world_size: int, watch_pid: int) -> "MpiGroup":
        """A worker started elsewhere: joins rank 0's group through its port as `rank`, watching
        watch_pid (its actor's process) while idle as a spawned worker watches rank 0. (An
        mpiexec must have started this process: MPICH's connect from a singleton fails.)"""
        MPI = import_mpi()
        inter = MPI.COMM_SELF.Connect(port)
        comm = inter.Merge(high=True)
        inter.Disconnect()
        while comm.Get_size() < world_size:         # the group takes in the later workers
            comm = _take_one(MPI, comm, port)
        group = cls._ranked(comm, rank)
        group.parent_pid = watch_pid
        return group

    @classmethod
    def _ranked(cls, comm, rank: int) -> "MpiGroup":
        """The joined group with its ranks as the workers were told (they joined in any order);
        the same collectives as spawn's and from_parent's)."""
        ordered = comm.Split(0, rank)
        comm.Disconnect()
        group = cls(ordered)
        group.comm.bcast(os.getpid(), root=0)
        return group

    @classmethod
    def from_parent(cls) -> "MpiGroup":
        """A worker: joins the group its rank 0 spawned it into."""
        MPI = import_mpi()
        inter = MPI.Comm.Get_parent()
        if inter == MPI.COMM_NULL:
            raise RuntimeError("engine.parallel.worker is started by a tensor-parallel engine's "
                               "rank 0 (MPI spawn), not by hand")
        comm = inter.Merge(high=True)
        inter.Disconnect()
        group = cls(comm)
        group.parent_pid = group.comm.bcast(None, root=0)
        return group

    # ---- control messages: rank 0 sends, every other rank receives them in order

    def send(self, message) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._header[0] = len(payload)
        self.comm.Ibcast(self._header, root=0).Wait()
        self.comm.Bcast(payload, root=0)

    def receive(self):
        """The next message from rank 0; the process exits when rank 0 has gone without a
        word."""
        request = self.comm.Ibcast(self._header, root=0)
        start = last_check = time.monotonic()
        while not request.Test():
            now = time.monotonic()
            waited = now - start
            if waited > 2e-4:        # past a step's usual gap: sleep, longer as it goes on
                time.sleep(min(0.005, waited / 20))
            if now - last_check > 1.0:
                last_check = now
                if self.parent_pid is not None and not _alive(self.parent_pid):
                    # no MPI_Finalize: it would wait for the rank that is gone
                    sys.stderr.write(f"tensor parallel rank {self.rank}: rank 0 (pid "
                                     f"{self.parent_pid}) has exited; stopping\n")
                    os._exit(1)
        payload = bytearray(int(self._header[0]))
        self.comm.Bcast(payload, root=0)
        return pickle.loads(payload)

    def allgather(self, value) -> list:
        """Every rank's (picklable) value, in rank order, on every rank."""
        return self.comm.allgather(value)

    def tensor_communicator(self) -> "MpiCommunicator":
        return MpiCommunicator(self.tensors)

    def split(self, color: int, key: int):
        """An mpi4py communicator of the ranks that give the same color, ranked by key (every
        rank calls it: a tensor-parallel group within a pipeline stage, a stage's chain)."""
        sub = self.tensors.Split(color, key)
        self._splits.append(sub)
        return sub

    def close(self) -> None:
        """Leaves the group, every rank together (rank 0 sends the workers their stop first:
        engine/parallel/steps.py); connected processes would wait for each other at exit."""
        if not self.closed:
            self.closed = True
            for sub in self._splits:
                sub.Disconnect()
            self.tensors.Disconnect()
            self.comm.Disconnect()
            for release in self.cleanup:
                release()


def _take_one(MPI, comm, port: str):
    """The group (every member calling) accepts the next worker's connection and merges."""
    inter = comm.Accept(port, root=0)
    merged = inter.Merge(high=False)
    inter.Disconnect()
    comm.Disconnect()       # (not Free: connected processes stay so until disconnected)
    return merged


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MpiCommunicator(Communicator):
    """Collectives on NumPy arrays (the CPU backend's activations, float32)."""

    def __init__(self, comm):
        self.MPI = import_mpi()
        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()

    def all_reduce(self, x) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM)

    def all_gather(self, x):
        out = np.empty((self.world_size, *x.shape), x.dtype)
        self.comm.Allgather(np.ascontiguousarray(x), out)
        return out

    def all_min(self, value: int) -> int:
        return int(self.comm.allreduce(int(value), op=self.MPI.MIN))

    # Point to point. A send copies x (the caller's buffer is a reused workspace) and returns;
    # the copies are kept until flush. A recv polls, sleeping briefly between tests: MPICH's
    # blocking receive spins, which would take the core the stage before it computes on.

    _pending: list | None = None

    def send(self, x, peer: int) -> None:
        if self._pending is None:
            self._pending = []
        copy = np.array(x, order="C", copy=True)
        self._pending.append((self.comm.Isend(copy, dest=peer), copy))

    def recv(self, x, peer: int) -> None:
        _wait(self.comm.Irecv(x, source=peer))

    def flush(self) -> None:
        for request, _ in self._pending or ():
            _wait(request)
        self._pending = []


def _wait(request) -> None:
    start = time.monotonic()
    while not request.Test():
        waited = time.monotonic() - start
        if waited > 2e-4:
            time.sleep(min(0.002, waited / 20))

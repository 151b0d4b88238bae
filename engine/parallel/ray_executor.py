"""`--distributed-executor ray`: the worker ranks of a tensor/pipeline-parallel engine as Ray
actors, placed by a placement group over a Ray cluster (`ray start --head` on one node, `ray
start --address` on the others), instead of processes MPI spawns on this machine.

Rank 0 stays the process that builds the engine (the server). Each worker rank is an actor in one
bundle of a placement group (one CPU, or one GPU, per rank; PACK: a stage's ranks together where
the nodes allow, later stages on the next nodes); the actor starts the rank's process under an
mpiexec of its node (MPICH cannot connect a singleton process), which joins rank 0's MPI group
through a port rank 0 opened (engine/parallel/mpi.py: accept, connect). From there the ranks are
the same as spawned ones: the same step messages, collectives and point-to-point sends, over
MPICH's TCP between nodes.

Rank 0's watchdog (engine/parallel/steps.py) watches each actor's run: a worker process or actor
that ends early ends rank 0 as a dead spawned worker does. Start-up errors say what is wrong:
Ray not installed, no cluster to join, fewer CPUs/GPUs in the cluster than worker ranks.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("taper.parallel")

START_TIMEOUT_S = 300.0       # for every worker to start and join rank 0's group

RAY_MISSING = ("--distributed-executor ray needs Ray: pip install 'taper[ray]' (ray==2.52.0), "
               "then `ray start --head` on this node and `ray start --address HEAD:6379` on "
               "the others")


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{RAY_MISSING} ({e})") from None
    return ray


def join_cluster(ray) -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "auto")
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise RuntimeError(f"--distributed-executor ray: no Ray cluster at {address} ({e}); "
                           f"start one with `ray start --head` (or set RAY_ADDRESS)") from None


def start_group(config):
    """Rank 0: the worker actors placed and started, their ranks joined into one MpiGroup, which
    carries how to watch them (`watch`) and how to release them (`cleanup`)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from engine.parallel.mpi import MpiGroup
    join_cluster(ray)
    workers = config.world_size - 1
    kind = "GPU" if config.backend == "cuda" else "CPU"
    # A data-parallel replica's rank 0 is an actor in a group with a bundle for each of its
    # ranks (engine/parallel/ray_replicas.py): its workers take the bundles after its own.
    current = ray.util.get_current_placement_group()
    if current is not None and len(current.bundle_specs) == config.world_size:
        group_of_bundles, first_bundle, own_group = current, 1, False
    else:
        have = ray.cluster_resources().get(kind, 0)
        if have < workers:
            raise RuntimeError(f"--distributed-executor ray: {workers} worker ranks need "
                               f"{workers} {kind}s in the Ray cluster, which has {have:g} "
                               f"({len(ray.nodes())} nodes)")
        group_of_bundles = placement_group([{kind: 1}] * workers, strategy="PACK")
        first_bundle, own_group = 0, True
        ready, _ = ray.wait([group_of_bundles.ready()], timeout=120)
        if not ready:
            remove_placement_group(group_of_bundles)
            raise RuntimeError(f"--distributed-executor ray: the cluster could not place "
                               f"{workers} bundles of one {kind} within 120 s")

    def remove_group():
        if own_group:
            remove_placement_group(group_of_bundles)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(dict.fromkeys(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    actor_class = ray.remote(RankActor)
    # the actors import this package from where rank 0 did (the nodes share its path)
    actors = [actor_class.options(
        num_cpus=1 if kind == "CPU" else 0, num_gpus=1 if kind == "GPU" else 0,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
        scheduling_strategy=PlacementGroupSchedulingStrategy(group_of_bundles, first_bundle + i))
              .remote() for i in range(workers)]
    # (asked before the runs: an actor answers one call at a time, and a run lasts)
    nodes = ray.get([actor.node.remote() for actor in actors])
    runs = []

    def start(port):
        runs.extend(actor.run.remote(port, rank, config.world_size, pythonpath)
                    for rank, actor in enumerate(actors, start=1))

    joined = threading.Event()
    threading.Thread(target=_watch_start, args=(ray, runs, joined), daemon=True,
                     name="taper-ray-start").start()
    try:
        group = MpiGroup.accept(config.world_size, start)
        joined.set()
    except BaseException:
        joined.set()
        for actor in actors:
            ray.kill(actor)
        remove_group()
        raise
    for rank, node in enumerate(nodes, start=1):
        log.info("rank %d: a Ray actor on node %s (%s)", rank, node[0][:12], node[1])
    group.nodes = nodes
    # a run that has returned (the worker exited) or failed (the actor died) is a dead rank
    group.watch = [(f"Ray actor on node {node[0][:12]}",
                    lambda ref=ref: not ray.wait([ref], timeout=0)[0])
                   for node, ref in zip(nodes, runs)]

    def release():
        ray.wait(runs, num_returns=len(runs), timeout=10)
        for actor in actors:
            ray.kill(actor)
        remove_group()

    group.cleanup.append(release)
    return group


def _watch_start(ray, runs, joined, timeout: float = START_TIMEOUT_S) -> None:
    """MPI's accept has no timeout: a worker that ends (or never connects) before the group is
    whole would leave rank 0 waiting for good. Says which, and ends rank 0's process."""
    deadline = time.monotonic() + timeout
    while not joined.wait(0.5):
        ended, _ = ray.wait(list(runs), timeout=0) if runs else ([], None)
        late = time.monotonic() > deadline
        if ended or late:
            what = (f"worker rank {runs.index(ended[0]) + 1} ended before joining"
                    if ended else f"the workers did not join within {timeout:g} s")
            log.critical("--distributed-executor ray: %s (its node's Ray logs say why); "
                         "exiting", what)
            logging.shutdown()
            os._exit(1)


class RankActor:
    """One worker rank's actor (made a Ray actor class by start_group)."""

    def node(self):
        import ray
        return ray.get_runtime_context().get_node_id(), socket.gethostname()

    def run(self, port: str, rank: int, world_size: int, pythonpath: str) -> int:
        """The rank's process, under an mpiexec, until it exits. It watches this actor's
        process as a spawned worker watches rank 0's: Ray ends the actor when rank 0 (its
        owner) has gone, and the worker then exits."""
        mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable),
                                                          "mpiexec")
        env = {**os.environ, "PYTHONPATH": pythonpath}
        process = subprocess.Popen(
            [mpiexec, "-n", "1", sys.executable, "-m", "engine.parallel.worker", "--connect",
             port, "--rank", str(rank), "--world-size", str(world_size), "--watch-pid",
             str(os.getpid())], env=env)
        return process.wait()

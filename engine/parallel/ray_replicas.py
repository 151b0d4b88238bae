"""`--data-parallel-size N --distributed-executor ray`: the N replicas of data parallel
(engine/parallel/data_parallel.py) as Ray actors over a Ray cluster, instead of processes on this
machine; the API server and its router stay here.

Each replica gets a placement group of its own, one bundle (a CPU, or a GPU) per rank of its
engine (PACK: its tensor-parallel ranks together where a node allows), so a replica may land on
another node. The replica's actor sits in bundle 0 and runs the replica's process code
(engine/parallel/replica.py) as it is; a tensor- or pipeline-parallel replica starts its worker
ranks in the group's other bundles (engine/parallel/ray_executor.py finds the group it runs in).

The router talks to a replica over a multiprocessing Connection on TCP (authenticated with a key
sent through Ray) rather than a pipe: the same messages, and the same `wait` over all replicas.
The actor listens, the router connects, so nothing waits for a replica that died before it
connected. A replica's actor dies with the server (Ray ends an owner's actors with it).
"""
from __future__ import annotations

import logging
import os
import secrets

log = logging.getLogger("taper.parallel")

PLACE_TIMEOUT_S = 120.0


class ActorProcess:
    """The calls RoutedEngine makes on a replica's process, on its Ray actor."""

    def __init__(self, ray, actor, run, pid: int, node: str, placement):
        self.ray, self.actor, self.run = ray, actor, run
        self.pid, self.node, self.placement = pid, node, placement

    def is_alive(self) -> bool:
        return not self.ray.wait([self.run], timeout=0)[0]

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.run], timeout=timeout)

    @property
    def exitcode(self):
        return None if self.is_alive() else 0

    def ended(self) -> str:
        """How it ended, for the message that fails its requests (a killed actor's process
        closes its connection before Ray has noticed, so the connection says it first)."""
        return f"died (its Ray actor on node {self.node[:12]})"

    def terminate(self) -> None:
        self.ray.kill(self.actor)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group
        self.ray.kill(self.actor)
        remove_placement_group(self.placement)


class ReplicaActor:
    """One replica's actor (made a Ray actor class by start_replicas)."""

    def listen(self, authkey: bytes):
        """Where the router connects: this node's address and a free port."""
        import ray
        from multiprocessing.connection import Listener
        self.listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return (self.listener.address, os.getpid(), ray.get_runtime_context().get_node_id())

    def run(self, config, index: int, num_threads: int | None) -> None:
        from engine.parallel import replica
        with self.listener.accept() as conn:
            self.listener.close()
            replica.main(conn, config, index, num_threads)


def start_replicas(config, num_replicas: int) -> list[tuple[ActorProcess, object]]:
    """The replicas' actors placed and started, each with the router's connection to it."""
    from multiprocessing.connection import Client
    from engine.parallel.ray_executor import import_ray, join_cluster
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    join_cluster(ray)
    kind = "GPU" if config.backend == "cuda" else "CPU"
    ranks = config.world_size
    need, have = num_replicas * ranks, ray.cluster_resources().get(kind, 0)
    if have < need:
        raise RuntimeError(f"--distributed-executor ray: {num_replicas} data-parallel replicas "
                           f"of {ranks} rank{'s' * (ranks > 1)} need {need} {kind}s in the Ray "
                           f"cluster, which has {have:g} ({len(ray.nodes())} nodes)")
    groups = [placement_group([{kind: 1}] * ranks, strategy="PACK")
              for _ in range(num_replicas)]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups),
                        timeout=PLACE_TIMEOUT_S)
    if len(ready) < len(groups):
        for g in groups:
            remove_placement_group(g)
        raise RuntimeError(f"--distributed-executor ray: the cluster could not place "
                           f"{num_replicas} replicas of {ranks} {kind} bundles within "
                           f"{PLACE_TIMEOUT_S:g} s")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(dict.fromkeys(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env = {"PYTHONPATH": pythonpath}
    if kind == "CPU":
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")   # its bundle's CPU
    if kind == "GPU":
        import dataclasses
        config = dataclasses.replace(config, device=0)      # Ray shows the actor its GPU alone
    actor_class = ray.remote(ReplicaActor)
    actors = [actor_class.options(
        num_cpus=1 if kind == "CPU" else 0, num_gpus=1 if kind == "GPU" else 0,
        runtime_env={"env_vars": env},
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            g, 0, placement_group_capture_child_tasks=False)).remote() for g in groups]
    started = []
    try:
        authkey = secrets.token_bytes(32)
        where = ray.get([a.listen.remote(authkey) for a in actors], timeout=PLACE_TIMEOUT_S)
        for index, (actor, g, (address, pid, node)) in enumerate(zip(actors, groups, where)):
            run = actor.run.remote(config, index, None)
            process = ActorProcess(ray, actor, run, pid, node, g)
            try:
                conn = Client(address, authkey=authkey)
            except (OSError, EOFError) as e:
                raise RuntimeError(f"--distributed-executor ray: data-parallel replica {index} "
                                   f"on node {node[:12]} could not be reached at {address} "
                                   f"({e})") from None
            started.append((process, conn))
            log.info("data-parallel replica %d: a Ray actor on node %s (pid %d, %s:%d)", index,
                     node[:12], pid, *address)
    except BaseException:
        for process, conn in started:
            conn.close()
        for actor in actors:
            ray.kill(actor)
        for g in groups:
            remove_placement_group(g)
        raise
    return started

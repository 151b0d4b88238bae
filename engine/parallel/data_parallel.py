"""Data parallel: N engine replicas (engine/parallel/replica.py), each a process with the whole
model (itself tensor or pipeline parallel if configured), behind one API server.

The server's AsyncEngine runs a RoutedEngine where it would run an LLMEngine: the same calls
(add_request, abort, pause, step, stats), each request routed to one replica and its outputs
relayed back, so the streams, back-pressure and aborts of engine/async_engine.py are the same.

Routing: a request whose prompt starts with a prefix a replica was recently sent (whole KV blocks,
the longest such) goes to that replica, where the prefix cache may hold it, unless that replica
has fewer free KV blocks than the prompt needs; any other request goes to the replica with the
most free KV blocks. Free blocks are the replica's last count, less the blocks of the prompts
sent to it after that count (each Load says how many of the router's adds it had taken).

Across machines (`--distributed-executor ray`): the replicas are Ray actors placed over a Ray
cluster (engine/parallel/ray_replicas.py), each connected to the router over TCP.

Faults: a replica that dies fails its open requests with an error naming it (their streams end
with it; a stream that had started gets an error event), and the others keep serving; with
every replica gone the engine reports itself not running (the server's /health says so).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import threading
from collections import OrderedDict
from multiprocessing.connection import wait

from engine.async_engine import AsyncEngine
from engine.core.stats import EngineStats
from engine.parallel import replica as replica_process
from engine.parallel.replica_lora import ReplicaAdapters

log = logging.getLogger("taper.parallel")

WAIT_S = 0.01                 # a step's wait for replies, before the loop looks at commands
IDLE_WAIT_S = 0.02            # the same with no open request (loads and deaths still come)
PREFIX_BLOCKS = 64            # the longest prompt prefix remembered, in KV blocks
REMEMBERED_PREFIXES = 1 << 16


class ReplicaFailed(RuntimeError):
    """A request's replica died under it; delivered in the request's stream."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


class RequestRefused(ValueError):
    """A replica's engine refused the request (as a local engine's add_request raises)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


class Replica:
    """The router's end of one replica process."""

    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.alive = True
        self.info = None                 # its ReplicaInfo once built
        self.load = None                 # its last Load
        self.adds_sent = 0
        self.unseen = {}                 # add number -> blocks of adds its last Load predates
        self.requests: set[str] = set()
        # the engine thread sends requests, the server's threads LoRA loads (replica_lora.py)
        self.lock = threading.Lock()

    def send(self, command) -> None:
        with self.lock:
            self.conn.send(command)

    def send_bytes(self, payload: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(payload)

    def free_blocks(self) -> int:
        counted = self.load.free_kv_blocks if self.load else self.info.num_kv_blocks
        return counted - sum(self.unseen.values())

    def loaded(self, load) -> None:
        self.load = load
        for number in [n for n in self.unseen if n <= load.adds_taken]:
            del self.unseen[number]

    def __repr__(self):
        return f"replica {self.index} (pid {getattr(self.process, 'pid', None)})"


def prefix_hashes(prompt: list[int], block_size: int) -> list[int]:
    """A hash of each whole-block prefix of the prompt (the first PREFIX_BLOCKS), chained."""
    out, h = [], 0
    for start in range(0, min(len(prompt) // block_size, PREFIX_BLOCKS) * block_size,
                       block_size):
        h = hash((h, tuple(prompt[start:start + block_size])))
        out.append(h)
    return out


class Router:
    """Which replica takes a request (module docstring)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.prefixes: OrderedDict[int, int] = OrderedDict()   # prefix hash -> replica index

    def choose(self, replicas: list[Replica], prompt: list[int]) -> Replica:
        alive = {r.index: r for r in replicas if r.alive}
        needed = -(-(len(prompt) + 1) // self.block_size)
        hashes = prefix_hashes(prompt, self.block_size)
        chosen = None
        for h in reversed(hashes):
            r = alive.get(self.prefixes.get(h))
            if r is not None:
                if r.free_blocks() >= needed:
                    chosen = r
                break
        if chosen is None:
            chosen = max(alive.values(), key=lambda r: (r.free_blocks(), -len(r.requests),
                                                        -r.index))
        for h in hashes:
            self.prefixes[h] = chosen.index
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > REMEMBERED_PREFIXES:
            self.prefixes.popitem(last=False)
        chosen.adds_sent += 1
        chosen.unseen[chosen.adds_sent] = needed
        return chosen


class RoutedEngine:
    """The LLMEngine calls AsyncEngine's thread makes, over the replicas."""

    def __init__(self, config, num_replicas: int):
        from pyx import cpu_threads
        self.config = config
        replica_config = dataclasses.replace(config, data_parallel_size=1)
        threads = None
        if config.backend == "cpu" and not cpu_threads.user_num_threads():
            # the replicas (and their ranks) split the CPUs
            threads = max(1, cpu_threads.usable_cpus()[0] // (num_replicas * config.world_size))
        ctx = multiprocessing.get_context("spawn")
        self.replicas: list[Replica] = []
        if config.distributed_executor == "ray":       # actors over a Ray cluster
            from engine.parallel.ray_replicas import start_replicas
            self.replicas = [Replica(index, process, conn) for index, (process, conn)
                             in enumerate(start_replicas(replica_config, num_replicas))]
        for index in range(num_replicas - len(self.replicas)):
            mine, theirs = ctx.Pipe()
            if config.backend == "cuda" and not config.device_ids:
                # each replica its own devices: replica i's ranks after replica i - 1's
                replica_config = dataclasses.replace(
                    config, data_parallel_size=1, device=config.device + index * config.world_size)
            process = ctx.Process(target=replica_process.main, name=f"taper-replica-{index}",
                                  args=(theirs, replica_config, index, threads), daemon=True)
            process.start()
            theirs.close()
            self.replicas.append(Replica(index, process, mine))
        try:
            for r in self.replicas:
                reply = self._first_reply(r)
                if reply[0] != "ready":
                    raise RuntimeError(f"data-parallel {r} failed to start: {reply[1]}")
                r.info = reply[1]
        except BaseException:
            self.shutdown()
            raise
        info = self.replicas[0].info
        self.tokenizer, self.model_config = info.tokenizer, info.model_config
        self.max_model_len, self.pooling, self.model_dir = (info.max_model_len, info.pooling,
                                                            info.model_dir)
        self.lora = (ReplicaAdapters(self, info.lora_adapters)
                     if config.lora is not None else None)
        self.router = Router(info.block_size)
        self.requests: dict[str, Replica] = {}       # open requests' replicas
        self._choices_left: dict[str, int] = {}
        self._failed: list = []                      # errors to deliver with the next step
        for r in self.replicas:
            log.info("data-parallel %s: %d KV blocks", r, r.info.num_kv_blocks)

    @staticmethod
    def _first_reply(r: Replica):
        while not r.conn.poll(1.0):
            if not r.process.is_alive():
                return ("failed", f"its process exited with code {r.process.exitcode}")
        try:
            return r.conn.recv()
        except EOFError:
            r.process.join(5)
            return ("failed", f"its process exited with code {r.process.exitcode}")

    def structured_outputs(self):
        raise ValueError("structured outputs are not yet supported with data-parallel replicas "
                         "(--data-parallel-size): the grammars compile in the server's process")

    @property
    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    # ---- the LLMEngine calls

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, images=None):
        if not self.alive:
            raise RuntimeError("every data-parallel replica has died")
        r = self.router.choose(self.replicas, prompt_token_ids)
        try:
            payload = pickle.dumps(("add", request_id, prompt_token_ids, params, images),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ValueError(f"this request cannot be sent to a data-parallel replica: {e}") \
                from None
        try:
            r.send_bytes(payload)
        except OSError:
            self._died(r)
            raise RuntimeError(f"data-parallel {r} has died") from None
        self.requests[request_id] = r
        self._choices_left[request_id] = getattr(params, "n", 1) or 1
        r.requests.add(request_id)

    def abort(self, request_id: str) -> list[int]:
        """The abort's outputs come from the replica, with a later step's."""
        r = self.requests.get(request_id)
        if r is not None and r.alive:
            self._send(r, ("abort", request_id))
        return []

    def pause(self, request_id: str, paused: bool) -> None:
        r = self.requests.get(request_id)
        if r is not None and r.alive:
            self._send(r, ("pause" if paused else "resume", request_id))

    def has_work(self) -> bool:
        """Always while a replica lives: AsyncEngine's thread then keeps taking the replicas'
        loads (/metrics and routing read them) and noticing deaths between requests too."""
        return bool(self.alive) or bool(self._failed)

    def step(self) -> list:
        """The outputs the replicas have sent (waiting up to WAIT_S for some), and an error for
        each open request of a replica that has died."""
        out, self._failed = self._failed, []
        by_conn = {r.conn: r for r in self.alive}
        for conn in wait(list(by_conn), timeout=WAIT_S if self.requests else IDLE_WAIT_S):
            r = by_conn[conn]
            try:
                while r.alive and conn.poll():
                    self._take(r, conn.recv(), out)
            except (EOFError, OSError):
                self._died(r)
        for r in self.alive:
            if not r.process.is_alive():
                self._died(r)
        out.extend(self._failed)
        self._failed = []
        return out

    def _take(self, r: Replica, message, out: list) -> None:
        kind = message[0]
        if kind == "outputs":
            for o in message[1]:
                out.append(o)
                if o.finished:
                    self._choice_finished(o.request_id)
        elif kind == "load":
            r.loaded(message[1])
        elif kind == "lora_loaded":
            self.lora.answered(r.index, *message[1:])
        elif kind == "refused":
            request_id, text = message[1:]
            out.append(RequestRefused(request_id, text))
            self._forget(request_id)

    def _choice_finished(self, request_id: str) -> None:
        left = self._choices_left.get(request_id)
        if left is None:
            return
        if left > 1:
            self._choices_left[request_id] = left - 1
        else:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        self._choices_left.pop(request_id, None)
        if r is not None:
            r.requests.discard(request_id)

    def _send(self, r: Replica, command) -> None:
        try:
            r.send(command)
        except OSError:
            self._died(r)

    def send_to(self, r: Replica, command) -> None:
        """From any thread: a dead replica's pipe is left to the engine thread to notice."""
        try:
            r.send(command)
        except OSError:
            if self.lora is not None:
                self.lora.replica_died(r.index)

    def _died(self, r: Replica) -> None:
        if not r.alive:
            return
        r.alive = False
        r.process.join(1.0)
        code = r.process.exitcode
        how = "was killed" if code is not None and code < 0 else f"exited with code {code}"
        if hasattr(r.process, "ended"):                 # a Ray actor's
            how = r.process.ended()
        message = (f"data-parallel {r} {how}; its requests failed "
                   f"({len(self.alive)} of {len(self.replicas)} replicas serve on)")
        log.error("%s (%d open requests)", message, len(r.requests))
        if self.lora is not None:
            self.lora.replica_died(r.index)
        for request_id in list(r.requests):
            self._failed.append(ReplicaFailed(request_id, message))
            self._forget(request_id)

    # ---- what the server reads

    def stats_by_replica(self) -> dict[int, EngineStats]:
        """Each live replica's last stats."""
        return {r.index: r.load.stats for r in self.alive if r.load is not None}

    def stats(self) -> EngineStats:
        """The replicas' stats added up (the spec decode counters too)."""
        parts = list(self.stats_by_replica().values())
        if not parts:
            return EngineStats(0, 0, 1, 1, 0, 0, 0, 0, 0)
        total = {f.name: sum(getattr(p, f.name) for p in parts)
                 for f in dataclasses.fields(EngineStats)
                 if f.name not in ("spec_method", "spec_accepted_per_position")}
        per_position = [sum(x) for x in zip(*(p.spec_accepted_per_position for p in parts))]
        return EngineStats(**total, spec_method=parts[0].spec_method,
                           spec_accepted_per_position=tuple(per_position))

    @property
    def num_waiting(self) -> int:
        return sum(r.load.stats.num_requests_waiting for r in self.alive if r.load is not None)

    def shutdown(self) -> None:
        for r in self.replicas:
            if r.alive and r.process.is_alive():
                try:
                    r.send(("stop",))
                except OSError:
                    pass
        for r in self.replicas:
            r.process.join(30)
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(5)
            if hasattr(r.process, "release"):              # a Ray actor's placement
                r.process.release()
            r.alive = False


class DataParallelAsyncEngine(AsyncEngine):
    """AsyncEngine over a RoutedEngine."""

    def __init__(self, config, **kwargs):
        super().__init__(config, engine=RoutedEngine(config, config.data_parallel_size),
                         **kwargs)
        log.info("data parallel %d: one API server routing to %d engine replicas",
                 config.data_parallel_size, config.data_parallel_size)

    @property
    def is_running(self) -> bool:
        return super().is_running and bool(self.engine.alive)

    def num_queued_sequences(self) -> int:
        with self._commands.mutex:
            incoming = [command[3] for command in self._commands.queue if command[0] == "add"]
        return self.engine.num_waiting + sum(getattr(params, "num_sequences", 1)
                                             for params in incoming)

    def stats_by_replica(self) -> dict[int, EngineStats]:
        return self.engine.stats_by_replica()

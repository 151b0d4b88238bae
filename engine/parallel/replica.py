"""One data-parallel replica: a whole engine (itself tensor or pipeline parallel if configured) in
a process of its own, fed by the API server's router (engine/parallel/data_parallel.py) over a
multiprocessing pipe.

The router sends ("add", request_id, prompt, params, images), ("abort", request_id),
("pause"|"resume", request_id), ("lora_load", token, name, path) and ("lora_unload", name)
(engine/parallel/replica_lora.py) and ("stop",). The replica sends back ("ready", ReplicaInfo) once
built (or ("failed", message)), then ("outputs", [RequestOutput...]) after each step,
("refused", request_id, message) for a request its engine refused, ("lora_loaded", token,
problem or None) for a LoRA load, and a Load after every round of
commands and steps: what the router weighs (free KV blocks, and how many of its adds the replica
had taken when it counted them) and the engine's stats for /metrics.

A replica whose router has gone (the pipe's other end closed) exits: it never outlives the server.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("taper.parallel")


@dataclass(slots=True)
class ReplicaInfo:
    """What the API server reads from its engine, from replica 0 (every replica loads the same
    model)."""
    tokenizer: object
    model_config: object
    max_model_len: int
    pooling: object
    model_dir: str | None
    block_size: int
    num_kv_blocks: int
    lora_adapters: list         # (name, path) of the LoRA adapters loaded at start


@dataclass(slots=True)
class Load:
    adds_taken: int            # the router's adds this replica had taken when it counted
    free_kv_blocks: int
    stats: object              # its EngineStats


def main(conn, config, index: int, num_threads: int | None) -> None:
    """The replica's process (multiprocessing's spawn target)."""
    # The server's terminal's Ctrl-C reaches every process of its group: the server drains and
    # stops the replicas itself, so a replica ignores it; SIGTERM sent to it alone still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if num_threads and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(num_threads)     # its share of the CPUs
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")
    from engine.core.llm_engine import LLMEngine
    try:
        engine = LLMEngine(config)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", ReplicaInfo(engine.tokenizer, engine.model_config, engine.max_model_len,
                                    engine.pooling, engine.model_dir, config.block_size,
                                    engine.block_pool.num_blocks,
                                    [(a.name, a.path) for a in engine.lora.adapters()]
                                    if engine.lora is not None else [])))
    try:
        serve(conn, engine)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("replica %d: the server has gone; stopping", index)
    finally:
        engine.shutdown()


def serve(conn, engine) -> None:
    from engine.core.outputs import RequestOutput
    from engine.parallel.replica_lora import serve_command
    adds = 0
    while True:
        # wait for commands while idle; between steps take what has arrived
        timeout = 0 if engine.has_work() else 1.0
        while conn.poll(timeout):
            command = conn.recv()
            kind = command[0]
            if kind == "stop":
                return
            if kind == "add":
                adds += 1
                request_id, prompt, params, images = command[1:]
                try:
                    engine.add_request(request_id, prompt, params, images)
                except Exception as e:      # refused: this request fails, the replica goes on
                    conn.send(("refused", request_id, f"{type(e).__name__}: {e}"))
            elif kind == "abort":       # its choices end as AsyncEngine ends a local one's
                request_id = command[1]
                ended = [RequestOutput(request_id, finished=True, finish_reason="abort",
                                       index=index) for index in engine.abort(request_id)]
                if ended:
                    conn.send(("outputs", ended))
            elif kind in ("pause", "resume"):
                engine.pause(command[1], kind == "pause")
            elif kind in ("lora_load", "lora_unload"):
                answer = serve_command(engine, command)
                if answer is not None:
                    conn.send(answer)
            timeout = 0
        if engine.has_work():
            outputs = engine.step()
            if outputs:
                conn.send(("outputs", outputs))
        stats = engine.stats()
        conn.send(("load", Load(adds, stats.num_free_kv_blocks, stats)))

"""LoRA adapters over data-parallel replicas: every replica's engine holds every adapter, so a
request naming one may go to any replica.

The adapters given at start (--lora-modules) each replica's engine loads as it builds. One loaded
at run time (the server's /v1/load_lora_adapter) is sent to every replica, and the load returns
once each has answered: served from then on by all of them, or, when one could not read it, a
LoraError naming that replica, the others told to drop it again. An unload goes to every replica
(its requests there finish with it, as on one engine).

The router's pipes are written by the engine thread (requests) and the server's threads (loads,
unloads): `Replica.send` holds the replica's lock. The replicas' answers arrive with their
outputs, read by the engine thread (RoutedEngine.step), which hands them to `answered`.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from engine.lora.adapter import LoraError
from engine.lora.config import check_lora_name

# a load that no replica answers within this long (each reads the adapter's files) is an error
ANSWER_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """What the server reads of an adapter the replicas serve (a LoraAdapter's name and path)."""
    name: str
    path: str


class ReplicaAdapters:
    """The RoutedEngine's `lora`: the adapters its replicas serve, by name (LoraManager's calls
    the server makes: adapters, load, unload)."""

    def __init__(self, engine, started: list[tuple[str, str]]):
        """engine: the RoutedEngine; started: (name, path) of the adapters the replicas loaded at
        start, in order."""
        self.engine = engine
        self._adapters = {name: ServedAdapter(name, path) for name, path in started}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, dict, set]] = {}

    def adapters(self) -> list[ServedAdapter]:
        with self._lock:
            return list(self._adapters.values())

    def get(self, name: str) -> ServedAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return adapter

    def load(self, name: str, path: str) -> ServedAdapter:
        """Every live replica loads the adapter; a LoraError when one cannot (naming it)."""
        check_lora_name(name)
        if name in self._adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        token = next(self._tokens)
        replicas = self.engine.alive
        done, answers = threading.Event(), {}
        with self._lock:
            self._waiting[token] = (done, answers, {r.index for r in replicas})
        try:
            for r in replicas:
                self.engine.send_to(r, ("lora_load", token, name, path))
            if not done.wait(ANSWER_TIMEOUT_S):
                raise LoraError(f"LoRA adapter {name!r} ({path}): the data-parallel replicas "
                                f"did not answer within {ANSWER_TIMEOUT_S} s")
        finally:
            with self._lock:
                self._waiting.pop(token, None)
        failed = sorted((index, problem) for index, problem in answers.items()
                        if problem is not None)
        if failed:
            for r in self.engine.alive:        # those that read it drop it again
                if answers.get(r.index) is None:
                    self.engine.send_to(r, ("lora_unload", name))
            index, problem = failed[0]
            raise LoraError(f"LoRA adapter {name!r} ({path}): data-parallel replica {index} "
                            f"could not load it: {problem}")
        adapter = ServedAdapter(name, path)
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"LoRA adapter {name!r} is already loaded")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """KeyError when no adapter has that name."""
        with self._lock:
            del self._adapters[name]
        for r in self.engine.alive:
            self.engine.send_to(r, ("lora_unload", name))

    # ---- the engine thread

    def answered(self, index: int, token: int, problem: str | None) -> None:
        """Replica `index` has loaded (problem None) or failed to load the adapter of `token`."""
        with self._lock:
            waiting = self._waiting.get(token)
            if waiting is None:
                return
            done, answers, expected = waiting
            answers[index] = problem
            if expected <= answers.keys():
                done.set()

    def replica_died(self, index: int) -> None:
        """A dead replica answers every load still waiting on it."""
        with self._lock:
            tokens = [t for t, (_, answers, expected) in self._waiting.items()
                      if index in expected and index not in answers]
        for token in tokens:
            self.answered(index, token, "the replica has died")


def serve_command(engine, command) -> tuple | None:
    """A replica's handling of a LoRA command from the router; the answer to send, or None."""
    if command[0] == "lora_load":
        token, name, path = command[1:]
        try:
            engine.lora.load(name, path)
        except Exception as e:      # answered to the router, which reports it
            return ("lora_loaded", token, f"{type(e).__name__}: {e}")
        return ("lora_loaded", token, None)
    try:                            # lora_unload
        engine.lora.unload(command[1])
    except KeyError:                # (it failed to load here)
        pass
    return None

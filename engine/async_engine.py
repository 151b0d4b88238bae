"""AsyncEngine: the LLMEngine on its own thread, fed and drained from an asyncio event loop.

The engine thread owns all engine state. The event loop talks to it through a command queue
(add, abort) and receives RequestOutputs through per-request asyncio queues, handed over with
call_soon_threadsafe. Kernels release the GIL, so the event loop keeps serving while a step runs.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams, generation_config_defaults
from engine.core.stats import EngineStats

log = logging.getLogger("taper.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is not None and self.tokenizer.has_chat_template:
            self.tokenizer.prepare_chat_guard()   # at load, not on the event loop's first chat
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self.pooling = self.engine.pooling        # how /v1/embeddings pools (sampling/pooling.py)
        self.model_name = default_model_name(config.model)
        self.generation_defaults = generation_config_defaults(self.engine.model_dir)
        self.structured_outputs = self.engine.structured_outputs   # thread-safe, lazy
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._closed = False         # the engine thread has stopped taking commands
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="taper-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queues the request and returns the stream of its outputs. A request the engine
        refuses raises ValueError from the stream."""
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        self._commands.put(("add", request_id, list(prompt_token_ids), params))
        # The engine thread marks itself closed, then fails the streams it finds; we add the
        # stream, then look at the mark. So either it sees this stream or we see the mark.
        if self._closed:
            stream.put_nowait(RuntimeError("the engine is not running"))
        return self._iterate(request_id, stream, params.n)

    async def _iterate(self, request_id: str, stream: asyncio.Queue, n: int):
        """The outputs of all n choices, interleaved; ends when each has finished."""
        done = False
        unfinished = n
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                unfinished -= item.finished
                done = unfinished == 0
                yield item
                if done:
                    return
        finally:
            if done:
                self._streams.pop(request_id, None)
            else:  # the consumer left early: free the request's blocks. The id stays taken
                # until the engine thread has aborted it, so a reuse cannot get its outputs.
                self._streams[request_id] = (None, None)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request: their streams end with finish_reason "abort"."""
        self._commands.put(("abort_all",))

    @property
    def num_open_requests(self) -> int:
        """Requests whose stream is still being read."""
        return sum(1 for loop, _ in list(self._streams.values()) if loop is not None)

    def stats(self) -> EngineStats:
        """Read from another thread: each field is a plain read of engine state, so a
        snapshot taken mid-step can be off by that step, never torn."""
        return self.engine.stats()

    def num_queued_sequences(self) -> int:
        """Sequences not yet running: the scheduler's waiting queue, the choices waiting to fork
        from their request's choice 0, and every sequence of the requests still on their way to
        the engine thread (n choices, or beams, each; one for a pooling request). Read from the
        event loop while the engine thread runs: each part is read in one step (under the
        queue's lock, or copied whole), so the sum may be a step old, never torn."""
        with self._commands.mutex:
            incoming = [command[3] for command in self._commands.queue if command[0] == "add"]
        requests = list(self.engine.requests.values())
        return (self.engine.scheduler.num_waiting + sum(len(r.forks) for r in requests)
                + sum(getattr(params, "num_sequences", 1) for params in incoming))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout=30)

    # ---- engine thread

    def _deliver(self, request_id: str, item) -> None:
        loop, stream = self._streams.get(request_id, (None, None))
        if stream is not None:
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, command) -> None:
        if command[0] == "add":
            _, request_id, prompt, params = command
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as e:  # refused: this request fails, the engine goes on
                self._deliver(request_id, e)
        elif command[0] == "abort_all":
            for request_id in list(self.engine.requests):
                self._handle(("abort", request_id))
        elif command[0] == "abort":
            request_id = command[1]
            for index in self.engine.abort(request_id):
                self._deliver(request_id, RequestOutput(request_id, finished=True,
                                                        finish_reason="abort", index=index))
            if self._streams.get(request_id) == (None, None):  # its consumer has left
                del self._streams[request_id]

    def _run(self) -> None:
        reason = "the engine was shut down"
        try:
            while not self._stopping:
                # Block for work when idle; otherwise take what has arrived and step.
                block = not self.engine.has_unfinished()
                try:
                    command = self._commands.get(block=block, timeout=None)
                    while True:
                        if command[0] == "stop":
                            return
                        self._handle(command)
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # the loop died: fail every open request, report unhealthy
            log.exception("engine loop failed")
            self.error = e
            reason = f"engine loop failed: {e}"
        finally:
            self._closed = True
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(reason))


def default_model_name(model: str) -> str:
    """A local directory is served under its folder name, a hub id under the id."""
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model

"""AsyncEngine: the LLMEngine on its own thread, fed and drained from an asyncio event loop.

The engine thread owns all engine state. The event loop talks to it through a command queue
(add, abort, pause, resume) and receives RequestOutputs through per-request streams (`_Stream`, an
asyncio queue), handed over with call_soon_threadsafe. Kernels release the GIL, so the event loop
keeps serving while a step runs.

Back-pressure: a reader slower than the engine (a client that does not read its stream) must not
make the engine finish its request into memory. Once `stream_buffer` outputs per choice wait in a
request's stream, the request is paused: the scheduler skips its sequences (their KV blocks stay,
and go to preemption like any others) until the reader has taken half of them, when it resumes.
A request paused for `stall_timeout` seconds is aborted and its waiting outputs dropped; its
reader then gets StreamStalled. A reader that keeps up never sees either.
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

STREAM_BUFFER = 16              # outputs per choice waiting for the reader before a pause
STALL_TIMEOUT = 60.0            # seconds a request may stay paused before it is aborted


class StreamStalled(Exception):
    """The reader took nothing from a full stream for the stall timeout: the request was
    aborted."""


class _Stream:
    """One request's outputs on their way to its reader, on the reader's event loop: the engine
    thread hands each over with call_soon_threadsafe(put). Pauses and resumes the request as
    the outputs waiting pass the high mark and fall to half of it."""

    def __init__(self, engine: "AsyncEngine", request_id: str, n: int):
        self.engine, self.request_id = engine, request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()      # bounded by the pause, not here
        self.high = max(2, engine.stream_buffer * n)
        self.paused = False
        self.stalled = False
        self._stall_timer: asyncio.TimerHandle | None = None

    def put(self, item) -> None:
        if self.stalled:                 # aborted for its reader: nothing more is kept
            return
        self.queue.put_nowait(item)
        if not self.paused and self.queue.qsize() >= self.high:
            self.paused = True
            self.engine._commands.put(("pause", self.request_id))
            self._arm_timer()

    def taken(self) -> None:
        """The reader took an item: resume the request at half the high mark; until then the
        stall timeout counts from this read (a slow reader is not a stalled one)."""
        if not self.paused:
            return
        self.cancel_timer()
        if self.queue.qsize() <= self.high // 2:
            self.paused = False
            self.engine._commands.put(("resume", self.request_id))
        else:
            self._arm_timer()

    def _arm_timer(self) -> None:
        self._stall_timer = self.loop.call_later(self.engine.stall_timeout, self._stall)

    def cancel_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stall(self) -> None:
        self.stalled = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(StreamStalled(
            f"the client read nothing for {self.engine.stall_timeout:g} s while "
            f"{self.high} outputs waited for it; the request was aborted"))
        self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig, stream_buffer: int = STREAM_BUFFER,
                 stall_timeout: float = STALL_TIMEOUT, engine=None):
        """engine: what the engine thread runs in place of an LLMEngine of config (data
        parallel's RoutedEngine: engine/parallel/data_parallel.py)."""
        self.engine = engine if engine is not None else LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is not None and self.tokenizer.has_chat_template:
            self.tokenizer.prepare_chat_guard()   # at load, not on the event loop's first chat
        if self.tokenizer is not None:
            self.tokenizer.max_chars_per_token    # computed at load, read by every request
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self.pooling = self.engine.pooling        # how /v1/embeddings pools (sampling/pooling.py)
        self.lora = self.engine.lora              # LoRA adapters (engine/lora/manager.py), or None
        self.model_name = default_model_name(config.model)
        self.generation_defaults = generation_config_defaults(self.engine.model_dir)
        self.structured_outputs = self.engine.structured_outputs   # thread-safe, lazy
        self.stream_buffer, self.stall_timeout = stream_buffer, stall_timeout
        self._commands: queue.Queue = queue.Queue()
        # by request id; None once its reader has left, until the engine thread has aborted it
        self._streams: dict[str, _Stream | None] = {}
        self._stopping = False
        self._closed = False         # the engine thread has stopped taking commands
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="taper-engine", daemon=True)
        self._thread.start()
        peers = getattr(getattr(self.engine, "runner", None), "peers", None)
        if peers is not None:       # a tensor/pipeline-parallel worker that dies fails them all
            peers.on_death = self._fail_open_requests

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, images: list | None = None
                    ) -> AsyncIterator[RequestOutput]:
        """Queues the request and returns the stream of its outputs. A request the engine
        refuses raises ValueError from the stream. images: a vision-language model's, as
        LLMEngine.add_request takes them."""
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(self, request_id, params.n)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, list(prompt_token_ids), params, images))
        # The engine thread marks itself closed, then fails the streams it finds; we add the
        # stream, then look at the mark. So either it sees this stream or we see the mark.
        if self._closed:
            stream.put(RuntimeError("the engine is not running"))
        return self._iterate(request_id, stream, params.n)

    async def _iterate(self, request_id: str, stream: _Stream, n: int):
        """The outputs of all n choices, interleaved; ends when each has finished."""
        done = False
        unfinished = n
        try:
            while True:
                item = await stream.queue.get()
                stream.taken()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                unfinished -= item.finished
                done = unfinished == 0
                yield item
                if done:
                    return
        finally:
            stream.cancel_timer()
            if done:
                self._streams.pop(request_id, None)
            else:  # the consumer left early: free the request's blocks. The id stays taken
                # until the engine thread has aborted it, so a reuse cannot get its outputs.
                self._streams[request_id] = None
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request: their streams end with finish_reason "abort"."""
        self._commands.put(("abort_all",))

    @property
    def num_open_requests(self) -> int:
        """Requests whose stream is still being read."""
        return sum(1 for stream in list(self._streams.values()) if stream is not None)

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
        if not self._thread.is_alive():
            self.engine.shutdown()

    def _fail_open_requests(self, message: str) -> None:
        """Every open request ends with `message` (from another thread: the engine thread may
        be stuck in a collective with a dead rank); the engine takes no more."""
        self._closed = True
        self.error = RuntimeError(message)
        for request_id in list(self._streams):
            self._deliver(request_id, RuntimeError(message))

    # ---- engine thread

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.put, item)

    def _handle(self, command) -> None:
        if command[0] == "add":
            request_id, prompt, params = command[1:4]
            images = command[4] if len(command) > 4 else None
            try:
                self.engine.add_request(request_id, prompt, params, images)
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
            if request_id in self._streams and self._streams[request_id] is None:
                del self._streams[request_id]        # its consumer has left
        elif command[0] in ("pause", "resume"):
            self.engine.pause(command[1], command[0] == "pause")

    def _run(self) -> None:
        reason = "the engine was shut down"
        try:
            while not self._stopping:
                # Block for work when idle (or every request is paused); otherwise take what
                # has arrived and step.
                block = not self.engine.has_work()
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

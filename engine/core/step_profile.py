"""Where an engine step's time goes: host work against device work, per step.

An engine step is, in order: schedule (pick sequences, allocate KV blocks), prepare (the flat
batch arrays), forward (the model, on the device), sample (per-row parameters and penalty entries
on the host, then the sampling ops on the device; the B token ids come back) and outputs (append
the token, detokenize, check stops, build the RequestOutputs). `StepProfile.attach(engine)` wraps
those five calls on one engine instance, so the engine's code carries no timing of its own and a
profile costs nothing when it is not attached.

On a GPU the forward call only enqueues kernels; the profile synchronizes after it so that
`forward` is the device's time and `prepare` + `schedule` + `outputs` the host's. That removes
whatever overlap a run would otherwise get, which is the point: it shows how much host work an
overlapped engine would have to hide; for the same reason the engine runs its steps
synchronously while a profile is attached (async scheduling off, restored by detach). `other` is the step's time outside the five phases (the
scheduler's update, block caching, the loop itself).

`ForwardTimeline.attach(engine)` measures the overlapped engine instead (async scheduling on):
when each step's forward starts and its sampling ends on the forward thread, so the forward
thread's idle gap between two steps (from the end of step N's forward + sampling to the start of
N+1's forward: the host work still on the critical path), and how long a step scheduled ahead
waited before sampling for the previous step's commit.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("taper.engine")

PHASES = ("schedule", "prepare", "forward", "sample", "outputs")
HOST_PHASES = ("schedule", "prepare", "outputs", "other")


@dataclass(slots=True)
class StepRecord:
    num_seqs: int = 0          # sequences scheduled this step
    num_tokens: int = 0        # tokens computed this step
    num_decodes: int = 0       # sequences computing exactly their next token
    seconds: dict = field(default_factory=dict)   # phase -> seconds, "step" the whole step

    @property
    def is_decode_only(self) -> bool:
        return self.num_seqs > 0 and self.num_decodes == self.num_seqs


class _Patches:
    """Engine methods replaced by timed ones, and put back by detach()."""

    def __init__(self):
        self._wrapped: list[tuple] = []   # (object, name, its own attribute or None)

    def _replace(self, obj, name: str, fn) -> None:
        self._wrapped.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, fn)

    def detach(self) -> None:
        """Put the engine's own methods back."""
        for obj, name, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        self._wrapped.clear()


class StepProfile(_Patches):
    """Per-step phase times of one LLMEngine. `records` holds every profiled step;
    `summary()` the mean milliseconds per phase over a selection of them."""

    def __init__(self, engine, log_every: int = 0):
        super().__init__()
        self.engine = engine
        self.log_every = log_every    # > 0: log a summary of the last N steps every N steps
        self.records: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._async_scheduling = engine.async_scheduling

    @classmethod
    def attach(cls, engine, log_every: int = 0) -> "StepProfile":
        profile = cls(engine, log_every)
        engine.async_scheduling = False
        backend = engine.backend
        profile._wrap(engine.scheduler, "schedule", "schedule", after=profile._record_schedule)
        profile._wrap(engine.runner, "prepare", "prepare")
        # The forward phase is the runner's execute minus its prepare (timed inside it).
        profile._wrap(engine.runner, "execute", "forward", sync=backend.synchronize,
                      exclusive_of="prepare")
        profile._wrap(engine.sampler, "sample_with_logprobs", "sample")
        profile._wrap(engine, "_append", "outputs")
        step = engine.step

        def profiled_step():
            profile._current = record = StepRecord()
            start = time.perf_counter()
            try:
                return step()
            finally:
                record.seconds["step"] = time.perf_counter() - start
                profile._current = None
                if record.num_seqs:
                    profile._finish(record)
        profile._replace(engine, "step", profiled_step)
        return profile

    def detach(self) -> None:
        super().detach()
        self.engine.async_scheduling = self._async_scheduling

    def _wrap(self, obj, name: str, phase: str, sync=None, after=None, exclusive_of=None):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            record = self._current
            if record is None:
                return fn(*args, **kwargs)
            inner_before = record.seconds.get(exclusive_of, 0.0) if exclusive_of else 0.0
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if sync is not None:
                sync()
            elapsed = time.perf_counter() - start
            if exclusive_of:
                elapsed -= record.seconds.get(exclusive_of, 0.0) - inner_before
            record.seconds[phase] = record.seconds.get(phase, 0.0) + elapsed
            if after is not None:
                after(record, result)
            return result
        self._replace(obj, name, timed)

    @staticmethod
    def _record_schedule(record: StepRecord, sched) -> None:
        record.num_seqs = sched.num_seqs
        record.num_tokens = sched.total_num_tokens
        record.num_decodes = sched.num_decodes

    def _finish(self, record: StepRecord) -> None:
        s = record.seconds
        s["other"] = max(0.0, s["step"] - sum(s.get(p, 0.0) for p in PHASES))
        self.records.append(record)
        if self.log_every and len(self.records) % self.log_every == 0:
            log.info("step profile: %s", format_summary(self.summary(self.records[-self.log_every:])))

    def summary(self, records: list[StepRecord] | None = None) -> dict:
        """Mean milliseconds per step of each phase, the host share, and the step count."""
        records = self.records if records is None else records
        if not records:
            return {"steps": 0}
        out = {"steps": len(records),
               "seqs": float(np.mean([r.num_seqs for r in records])),
               "tokens": float(np.mean([r.num_tokens for r in records]))}
        for phase in (*PHASES, "other", "step"):
            out[phase] = 1e3 * float(np.mean([r.seconds.get(phase, 0.0) for r in records]))
        host = sum(out[p] for p in HOST_PHASES)
        out["host_share"] = host / out["step"] if out["step"] else 0.0
        return out

    def decode_summary(self) -> dict:
        """The summary over steps in which every scheduled sequence decoded one token."""
        return self.summary([r for r in self.records if r.is_decode_only])


def format_summary(s: dict) -> str:
    if not s.get("steps"):
        return "no steps"
    phases = " ".join(f"{p} {s[p]:.2f}" for p in (*PHASES, "other"))
    return (f"{s['steps']} steps, {s['seqs']:.1f} seqs/{s['tokens']:.0f} tokens per step; "
            f"ms per step: {phases}, total {s['step']:.2f} (host {100 * s['host_share']:.0f} %)")


@dataclass(slots=True)
class StepTimes:
    num_seqs: int
    num_decodes: int
    forward_start: float = 0.0     # perf_counter when its forward began (placeholders filled)
    end: float = 0.0               # when its _run_step returned (sampling done)
    commit_wait: float = 0.0       # seconds its sampling waited for the previous step's commit


class ForwardTimeline(_Patches):
    """The forward thread's view of an engine running with async scheduling: `steps` in the
    order they ran (one forward thread runs them in order)."""

    def __init__(self):
        super().__init__()
        self.steps: list[StepTimes] = []

    @classmethod
    def attach(cls, engine) -> "ForwardTimeline":
        timeline = cls()
        run_step, execute, await_commit = engine._run_step, engine.runner.execute, \
            engine._await_commit
        current = {}      # the step running now (only the forward thread touches it)

        def timed_run_step(sched, *args):
            current["step"] = times = StepTimes(sched.num_seqs, sched.num_decodes)
            try:
                return run_step(sched, *args)
            finally:
                times.end = time.perf_counter()
                timeline.steps.append(times)

        def timed_execute(*args, **kwargs):
            current["step"].forward_start = time.perf_counter()
            return execute(*args, **kwargs)

        def timed_await_commit(step):
            start = time.perf_counter()
            await_commit(step)
            current["step"].commit_wait = time.perf_counter() - start
        for obj, name, fn in ((engine, "_run_step", timed_run_step),
                              (engine.runner, "execute", timed_execute),
                              (engine, "_await_commit", timed_await_commit)):
            timeline._replace(obj, name, fn)
        return timeline

    def decode_summary(self) -> dict:
        """Medians in ms over consecutive pairs of decode-only steps (N, N+1): the idle gap
        between N's end and N+1's forward, N+1's commit wait, and the step period (forward start
        to forward start)."""
        pairs = [(a, b) for a, b in zip(self.steps, self.steps[1:])
                 if a.num_seqs and a.num_decodes == a.num_seqs and b.num_seqs
                 and b.num_decodes == b.num_seqs and a.forward_start and b.forward_start]
        if not pairs:
            return {"pairs": 0}
        return {"pairs": len(pairs),
                "gap": 1e3 * float(np.median([b.forward_start - a.end for a, b in pairs])),
                "commit_wait": 1e3 * float(np.median([b.commit_wait for _, b in pairs])),
                "period": 1e3 * float(np.median([b.forward_start - a.forward_start
                                                 for a, b in pairs]))}

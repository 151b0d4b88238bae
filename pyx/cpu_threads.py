"""How many OpenMP threads the CPU backend runs: the CPUs this process may use, and of those the
ones other processes leave free.

The most: the CPUs this process may use, i.e. the smaller of its affinity mask
(os.sched_getaffinity: taskset, cpusets, Kubernetes static CPUs) and its cgroup CPU quota rounded
up (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, the tightest one from the
process's cgroup up to the mount's root: `docker --cpus`, Kubernetes limits). libgomp sizes its
pool from the affinity mask alone, so a container limited to 2 CPUs on a 64-core host would run
64 threads that the quota stalls in turn. OMP_NUM_THREADS set by the user wins.

Of those, the ones free (ThreadGovernor): a decode step runs many short parallel regions
(about 5 a layer), and libgomp's team threads spin between them (about 7 ms here before they
sleep), which is what makes a step on an idle machine fast. When other processes want the same
cores, a spinning team collapses: every region waits at its barrier for whichever team thread
the kernel has just descheduled, and a 32-token answer of the demo model took 4 s instead of
0.03 s beside 2 busy processes on 2 cores (bench/cpu_contention.py). Sleeping at once instead
(OMP_WAIT_POLICY=passive) survives contention but adds a wake-up to each of the ~120 regions of
a step: on a quiet machine a 0.5B-shaped request (32 tokens in, 16 out) took 0.871 s against
0.764 s spinning (medians of 28 alternating rounds), a 3 MiB linear 59 us against 32 us. So the
team keeps libgomp's spin-wait and shrinks instead: a daemon thread (LoadSampler) measures every
half second how many of this process's CPUs other processes kept busy (/proc/stat less this
process's own CPU time), and before each forward pass the governor leaves them those CPUs; a
single thread is never stalled by a teammate. When they are gone, the team grows back.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time

log = logging.getLogger("taper.cpu_threads")


# ---- CPUs this process may use

def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (os.cpu_count() where the OS has no masks)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _mounts(root: str) -> list[tuple[str, str, str, set[str]]]:
    """cgroup mounts from /proc/self/mountinfo: (fstype, mount root, mount point, options)."""
    text = _read(os.path.join(root, "proc/self/mountinfo")) or ""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            continue
        fstype = fields[sep + 1]
        if fstype in ("cgroup", "cgroup2"):
            options = set(fields[sep + 3].split(",")) | set(fields[5].split(","))
            mounts.append((fstype, fields[3], fields[4], options))
    return mounts


def _memberships(root: str) -> list[tuple[set[str], str]]:
    """(controllers, cgroup path) per line of /proc/self/cgroup; v2's line has no controllers."""
    text = _read(os.path.join(root, "proc/self/cgroup")) or ""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((set(filter(None, parts[1].split(","))), parts[2]))
    return out


def _cgroup_dirs(root: str, mount_root: str, mount_point: str, path: str) -> list[str]:
    """The process's cgroup directory under a mount, then each parent up to the mount point. A
    path outside the mount's root (a container that sees its host's path) means the mount is the
    process's own cgroup."""
    inside = path == mount_root or path.startswith(mount_root.rstrip("/") + "/")
    rel = os.path.relpath(path, mount_root) if inside else "."
    parts = [] if rel == "." else [p for p in rel.split("/") if p]
    base = os.path.join(root, mount_point.lstrip("/"))
    return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(d: str) -> float | None:
    text = _read(os.path.join(d, "cpu.max"))
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1])
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(d: str) -> float | None:
    quota, period = (_read(os.path.join(d, f"cpu.cfs_{n}_us")) for n in ("quota", "period"))
    if quota is None or period is None:
        return None
    quota, period = int(quota), int(period)
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(root: str = "/") -> float | None:
    """The tightest CPU quota (in CPUs, e.g. 1.5) on this process's cgroups, v1 or v2; None when
    unlimited or not found. `root`: where /proc and the cgroup mounts are (tests point it at a
    fake tree)."""
    limits = []
    for controllers, path in _memberships(root):
        for fstype, mount_root, mount_point, options in _mounts(root):
            if not controllers and fstype == "cgroup2":
                read = _v2_limit
            elif controllers and "cpu" in controllers and fstype == "cgroup" and "cpu" in options:
                read = _v1_limit
            else:
                continue
            for d in _cgroup_dirs(root, mount_root, mount_point, path):
                try:
                    limit = read(d)
                except ValueError:      # a file we cannot parse says nothing about a limit
                    limit = None
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def usable_cpus(root: str = "/") -> tuple[int, str]:
    """(CPUs this process may use, how that was decided): the affinity mask, capped by the
    cgroup quota rounded up."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root)
    if limit is not None and math.ceil(limit) < cpus:
        return max(1, math.ceil(limit)), f"cgroup CPU quota {limit:g} of {cpus} CPUs in affinity"
    return cpus, f"{cpus} CPUs in this process's affinity mask" + (
        f" (cgroup quota {limit:g})" if limit is not None else "")


def describe(num_threads: int, adaptive: bool, environ=os.environ) -> str:
    """One line for the start-up log: the threads, why that many, whether they adapt."""
    _, why = default_num_threads(environ)
    n = f"{num_threads} thread{'s' if num_threads != 1 else ''} ({why})"
    if adaptive:
        return n + "; fewer while other processes use those CPUs (OMP_NUM_THREADS fixes it)"
    return n


def user_num_threads(environ=os.environ) -> str:
    """The user's OMP_NUM_THREADS, "" when unset: a count the user chose stays fixed."""
    return environ.get("OMP_NUM_THREADS", "").strip()


def default_num_threads(environ=os.environ, root: str = "/") -> tuple[int | None, str]:
    """(threads per op, why): the user's OMP_NUM_THREADS (its first level, as in "4,2"), else
    usable_cpus. None: OMP_NUM_THREADS is set but not a count, and OpenMP's reading of it wins."""
    user = user_num_threads(environ)
    if user:
        first = user.split(",")[0].strip()
        n = int(first) if first.isdigit() else 0
        return (n if n >= 1 else None), f"OMP_NUM_THREADS={user}"
    return usable_cpus(root)


# ---- the CPUs other processes leave free

def cpu_busy_seconds(cpus, root: str = "/") -> float:
    """CPU time spent busy (anything but idle and iowait, steal included) on the given CPUs since
    boot, from /proc/stat."""
    want = {f"cpu{c}" for c in cpus}
    busy = 0
    with open(os.path.join(root, "proc/stat")) as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in want:
                v = [int(x) for x in fields[1:9]]
                busy += sum(v) - v[3] - v[4]      # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU time (all its threads), on the same clock ticks as /proc/stat."""
    t = os.times()
    return t.user + t.system


def threads_left(max_threads: int, num_cpus: int, others: float, slack: float = 0.2) -> int:
    """Threads to run when other processes keep `others` CPUs busy (on average) out of
    `num_cpus`: the CPUs they leave, counting any share above `slack` of a CPU as a whole one (a
    team thread sharing a core stalls the team); at least one, at most max_threads."""
    taken = max(0, math.ceil(others - slack))
    return max(1, min(max_threads, num_cpus - taken))


class LoadSampler:
    """How many CPUs other processes kept busy, on average, among `cpus` over the last
    `interval` seconds: /proc/stat's busy time on those CPUs less this process's own CPU time.
    `sample()` takes one measurement; start() runs it every `interval` on a daemon thread, so the
    figure is fresh when a request arrives after a pause. The readers are parameters for tests."""

    def __init__(self, cpus, interval: float = 0.5, read_busy=cpu_busy_seconds,
                 own_cpu=own_cpu_seconds, clock=time.monotonic):
        self.cpus = sorted(cpus)
        self.interval = interval
        self.others = 0.0
        self._read_busy, self._own_cpu, self._clock = read_busy, own_cpu, clock
        self._last = None           # (time, busy seconds on the CPUs, our CPU seconds)
        self._thread = None

    def sample(self) -> float:
        now = self._clock()
        try:
            busy, own = self._read_busy(self.cpus), self._own_cpu()
        except (OSError, ValueError):     # no /proc/stat: nothing measured, nothing changes
            return self.others
        if self._last is not None and now > self._last[0]:
            t0, busy0, own0 = self._last
            self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
        self._last = (now, busy, own)
        return self.others

    def start(self) -> None:
        if self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="taper-cpu-load", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.sample()


_sampler: LoadSampler | None = None
_sampler_lock = threading.Lock()


def shared_sampler() -> LoadSampler:
    """The process's one LoadSampler over its affinity CPUs, started on first use."""
    global _sampler
    with _sampler_lock:
        if _sampler is None:
            _sampler = LoadSampler(_affinity())
            _sampler.start()
        return _sampler


class ThreadGovernor:
    """The backend's thread count: at most max_threads, and only the CPUs other processes leave
    free (threads_left on the sampler's latest figure). `update()` is called between forward
    passes and reads no file; the process's sampler starts on the first call."""

    def __init__(self, max_threads: int, sampler: LoadSampler | None = None):
        if max_threads < 1:
            raise ValueError(f"ThreadGovernor: max_threads must be >= 1, got {max_threads}")
        self.max_threads = self.threads = max_threads
        self._sampler = sampler

    def update(self) -> int:
        if self._sampler is None:
            self._sampler = shared_sampler()
        s = self._sampler
        threads = threads_left(self.max_threads, len(s.cpus), s.others)
        if threads != self.threads:
            log.debug("CPU threads %d -> %d: other processes use %.2f of %d CPUs",
                      self.threads, threads, s.others, len(s.cpus))
        self.threads = threads
        return threads


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))

"""How many OpenMP threads the CPU backend runs, and how they wait between parallel regions.

Thread count: the CPUs this process may use, i.e. the smaller of its affinity mask
(os.sched_getaffinity: taskset, cpusets, Kubernetes static CPUs) and its cgroup CPU quota rounded
up (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, the tightest one from the
process's cgroup up to the mount's root: `docker --cpus`, Kubernetes limits). libgomp sizes its
pool from the affinity mask alone, so a container limited to 2 CPUs on a 64-core host would run
64 threads that the quota stalls in turn. OMP_NUM_THREADS set by the user wins.

Waiting: libgomp's default lets an idle team thread spin for about 3 ms before it sleeps (its
GOMP_SPINCOUNT of 300,000). A decode step runs hundreds of short parallel regions, so the team
spins all the time, and when other processes want the same cores a spinning thread burns the
slice its teammate needed: each region then waits for the descheduled thread's next turn, and a
32-token answer of the demo model took 4 s instead of 0.03 s beside 2 busy processes on 2 cores.
Threads that sleep at once (OMP_WAIT_POLICY=passive) give the core back and are woken promptly
by the scheduler, which favours threads that slept. bench/cpu_contention.py measures the choice.
libgomp reads these variables once, when it is loaded: `apply_wait_policy` runs from
pyx/__init__.py, before any extension that links libgomp, and leaves a user's own setting alone.
"""
from __future__ import annotations

import logging
import math
import os

log = logging.getLogger("taper.cpu_threads")

# What libgomp is given when the user set neither variable (see the module docstring).
DEFAULT_WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_wait_policy(environ=os.environ) -> dict[str, str]:
    """Sets DEFAULT_WAIT_POLICY in `environ` unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT; returns what it set. Effective only before libgomp is loaded."""
    if any(environ.get(name) for name in WAIT_VARIABLES):
        return {}
    for name, value in DEFAULT_WAIT_POLICY.items():
        environ[name] = value
    if environ is os.environ:
        _applied.update(DEFAULT_WAIT_POLICY)
    return dict(DEFAULT_WAIT_POLICY)


_applied: dict[str, str] = {}     # what apply_wait_policy put in this process's environment


def wait_policy_description(environ=os.environ) -> str:
    """The wait settings in force, for the start-up log."""
    set_ = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if environ.get(name)]
    if not set_:
        return "libgomp's default spin-wait"
    chosen = "Taper's default" if _applied and environ is os.environ else "set by the user"
    return f"{', '.join(set_)} ({chosen})"


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


def describe(num_threads: int, environ=os.environ) -> str:
    """One line for the start-up log: the threads, why that many, and how they wait."""
    _, why = default_num_threads(environ)
    return f"{num_threads} threads ({why}); {wait_policy_description(environ)}"


def default_num_threads(environ=os.environ, root: str = "/") -> tuple[int | None, str]:
    """(threads per op, why): the user's OMP_NUM_THREADS (its first level, as in "4,2"), else
    usable_cpus. None: OMP_NUM_THREADS is set but not a count, and OpenMP's reading of it wins."""
    user = environ.get("OMP_NUM_THREADS", "").strip()
    if user:
        first = user.split(",")[0].strip()
        n = int(first) if first.isdigit() else 0
        return (n if n >= 1 else None), f"OMP_NUM_THREADS={user}"
    return usable_cpus(root)

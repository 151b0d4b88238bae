"""The CPU backend's thread policy (pyx/cpu_threads.py): the thread count from the CPUs this
process may use (affinity mask, cgroup v1/v2 CPU quota, read from fake /proc and cgroup trees
here), OMP_NUM_THREADS winning over it, and the governor that leaves other processes the CPUs
they occupy, consulted before every forward pass (issue 27, item 7). The speed under contention
is bench/cpu_contention.py's, not a test's."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pyx import cpu_threads


def fake_tree(tmp_path: Path, cgroup: str, mountinfo: list[str], files: dict[str, str]) -> str:
    """A root with proc/self/{cgroup,mountinfo} and the given cgroup files under it."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw"
V1_MOUNTS = [
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755",
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct",
    "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset",
]


@pytest.fixture
def cpus(monkeypatch):
    """Sets how many CPUs the affinity mask holds."""
    def set_(n):
        monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: n)
    set_(8)
    return set_


def test_v2_quota_caps_the_affinity_mask(tmp_path, cpus):
    root = fake_tree(tmp_path, "0::/user.slice/app.scope\n", [V2_MOUNT],
                     {"sys/fs/cgroup/user.slice/app.scope/cpu.max": "150000 100000\n",
                      "sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 1.5
    n, why = cpu_threads.usable_cpus(root)
    assert n == 2 and "quota 1.5" in why         # rounded up


def test_v2_a_parent_quota_limits_the_child(tmp_path, cpus):
    root = fake_tree(tmp_path, "0::/kubepods/pod1/ctr\n", [V2_MOUNT],
                     {"sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
                      "sys/fs/cgroup/kubepods/pod1/cpu.max": "300000 100000\n",
                      "sys/fs/cgroup/kubepods/cpu.max": "600000 100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 3.0
    assert cpu_threads.usable_cpus(root)[0] == 3


def test_v2_unlimited_leaves_the_affinity_mask(tmp_path, cpus):
    root = fake_tree(tmp_path, "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) is None
    assert cpu_threads.usable_cpus(root)[0] == 8


def test_affinity_smaller_than_the_quota_wins(tmp_path, cpus):
    cpus(2)
    root = fake_tree(tmp_path, "0::/a\n", [V2_MOUNT], {"sys/fs/cgroup/a/cpu.max": "400000 100000"})
    assert cpu_threads.usable_cpus(root)[0] == 2


def test_v1_cfs_quota(tmp_path, cpus):
    cg = "12:cpuset:/job\n11:cpu,cpuacct:/job\n1:name=systemd:/job\n0::/job\n"
    root = fake_tree(tmp_path, cg, V1_MOUNTS,
                     {"sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n",
                      "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 0.5
    assert cpu_threads.usable_cpus(root)[0] == 1     # never below one thread


def test_v1_no_quota(tmp_path, cpus):
    root = fake_tree(tmp_path, "11:cpu,cpuacct:/\n", V1_MOUNTS,
                     {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) is None


def test_cgroup_outside_the_mount_reads_the_mount_point(tmp_path, cpus):
    """A path outside the mount's root (the mount is the process's own cgroup, named otherwise
    in /proc/self/cgroup) is not followed out of the mount point."""
    mount = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu"
    root = fake_tree(tmp_path, "4:cpu:/system.slice/x/y\n", [mount],
                     {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000\n",
                      "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
                      "sys/fs/system.slice/x/y/cpu.cfs_quota_us": "100000\n",   # outside the mount
                      "sys/fs/system.slice/x/y/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 2.0


def test_container_that_sees_its_host_path(tmp_path, cpus):
    """Docker without a cgroup namespace: /proc/self/cgroup names the host's path, and the mount's
    root is that same cgroup, so the mount point holds the container's own files."""
    mount = ("32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu")
    root = fake_tree(tmp_path, "4:cpu:/docker/abc\n", [mount],
                     {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000\n",
                      "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 2.0


def test_unreadable_or_missing_files_mean_no_limit(tmp_path, cpus):
    root = fake_tree(tmp_path, "0::/x\n", [V2_MOUNT], {"sys/fs/cgroup/x/cpu.max": "garbage\n"})
    assert cpu_threads.cgroup_cpu_limit(root) is None
    assert cpu_threads.cgroup_cpu_limit(str(tmp_path / "nowhere")) is None
    assert cpu_threads.usable_cpus(root)[0] == 8


def test_omp_num_threads_wins(tmp_path, cpus):
    root = fake_tree(tmp_path, "0::/a\n", [V2_MOUNT], {"sys/fs/cgroup/a/cpu.max": "100000 100000"})
    assert cpu_threads.default_num_threads({}, root)[0] == 1
    assert cpu_threads.default_num_threads({"OMP_NUM_THREADS": "3"}, root)[0] == 3
    assert cpu_threads.default_num_threads({"OMP_NUM_THREADS": "4,2"}, root)[0] == 4
    # not a count: OpenMP's own reading of the variable decides
    assert cpu_threads.default_num_threads({"OMP_NUM_THREADS": "lots"}, root)[0] is None


def test_threads_left():
    assert cpu_threads.threads_left(2, 2, 0.0) == 2
    assert cpu_threads.threads_left(2, 2, 0.15) == 2      # noise, a monitoring process
    assert cpu_threads.threads_left(2, 2, 0.3) == 1       # a teammate would share a core
    assert cpu_threads.threads_left(2, 2, 1.9) == 1       # never fewer than one
    assert cpu_threads.threads_left(8, 8, 2.5) == 5
    assert cpu_threads.threads_left(2, 64, 30.0) == 2     # a quota of 2 on a busy 64-CPU host


def test_cpu_busy_seconds_counts_only_the_given_cpus(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/stat").write_text(
        "cpu  900 0 900 9000 0 0 0 0 0 0\n"
        "cpu0 100 10 50 5000 40 5 5 30 0 0\n"     # busy: all but idle 5000 and iowait 40
        "cpu1 800 0 0 4000 0 0 0 0 0 0\n"
        "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert cpu_threads.cpu_busy_seconds([0], str(tmp_path)) == pytest.approx(200 / hz)
    assert cpu_threads.cpu_busy_seconds([0, 1], str(tmp_path)) == pytest.approx(1000 / hz)


class FakeMachine:
    """A clock, the busy seconds of the CPUs and this process's own CPU seconds, advanced by
    hand."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.reads = 0

    def read_busy(self, cpus):
        self.reads += 1
        return self.busy

    def run(self, seconds: float, ours: float, others: float):
        """`seconds` pass while this process uses `ours` CPUs and other processes `others`."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def sampler(m: FakeMachine, cpus=(0, 1)) -> cpu_threads.LoadSampler:
    return cpu_threads.LoadSampler(cpus, interval=0.5, read_busy=m.read_busy,
                                   own_cpu=lambda: m.own, clock=lambda: m.now)


def test_governor_leaves_other_processes_their_cpus_and_takes_them_back():
    m = FakeMachine()
    s = sampler(m)
    g = cpu_threads.ThreadGovernor(2, sampler=s)
    s.sample()
    assert g.update() == 2                       # nothing measured yet
    m.run(0.5, ours=2.0, others=0.0)
    s.sample()
    assert s.others == 0.0 and g.update() == 2   # alone: our own busy time is not contention
    m.run(0.5, ours=1.0, others=1.0)
    s.sample()
    assert s.others == pytest.approx(1.0) and g.update() == 1   # a busy process beside us
    m.run(0.5, ours=1.0, others=1.0)
    s.sample()
    assert g.update() == 1
    m.run(0.5, ours=1.0, others=0.0)
    s.sample()
    assert g.update() == 2                       # it left


def test_sampler_without_proc_stat_measures_nothing():
    def missing(cpus):
        raise FileNotFoundError("/proc/stat")
    s = cpu_threads.LoadSampler([0, 1], read_busy=missing)
    s.sample()
    s.sample()
    assert s.others == 0.0 and cpu_threads.ThreadGovernor(2, sampler=s).update() == 2


def test_sampler_thread_keeps_the_figure_fresh():
    """A request after a pause must not be judged on a figure from before the pause: the sampler
    measures on its own thread, every interval, whether or not forward passes run."""
    m = FakeMachine()
    s = cpu_threads.LoadSampler([0, 1], interval=0.01, read_busy=m.read_busy,
                                own_cpu=lambda: m.own, clock=time.monotonic)
    s.start()
    deadline = time.monotonic() + 10
    while m.reads < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.reads >= 4 and s._thread.daemon


def test_the_first_update_starts_the_shared_sampler(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_sampler", None)
    g = cpu_threads.ThreadGovernor(2)
    assert cpu_threads._sampler is None          # a backend alone starts nothing
    g.update()
    assert cpu_threads._sampler is not None and cpu_threads._sampler._thread.is_alive()
    assert cpu_threads.shared_sampler() is cpu_threads._sampler


def test_cpu_backend_adapts_only_a_default_count(monkeypatch):
    from pyx.cpu_backend import CpuBackend
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda root="/": None)
    monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: 2)
    b = CpuBackend()
    assert b.num_threads == 2 and b.governor is not None
    b.governor.update = lambda: 1
    assert b.adapt_threads() == 1 and b.num_threads == 1
    fixed = CpuBackend(num_threads=2)
    assert fixed.governor is None and fixed.adapt_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert CpuBackend().governor is None


def test_the_engine_consults_the_governor_before_each_forward(tmp_path, monkeypatch):
    from engine import LLM, SamplingParams
    from server.demo_model import write_demo_checkpoint
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    counts = []
    real = cpu_threads.ThreadGovernor.update
    monkeypatch.setattr(cpu_threads.ThreadGovernor, "update",
                        lambda self: counts.append(1) or real(self))
    llm = LLM(write_demo_checkpoint(str(tmp_path / "demo")), kv_cache_memory_mb=16)
    calls = llm.engine.runner.num_forward_calls
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(counts) >= llm.engine.runner.num_forward_calls - calls >= 4

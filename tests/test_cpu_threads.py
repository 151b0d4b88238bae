"""The CPU backend's thread policy (pyx/cpu_threads.py): the thread count from the CPUs this
process may use (affinity mask, cgroup v1/v2 CPU quota, read from fake /proc and cgroup trees
here), OMP_NUM_THREADS winning over it, and the wait policy that libgomp must see when it loads
(issue 27, item 7). The speed under contention is bench/cpu_contention.py's, not a test's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyx import cpu_threads

ROOT = Path(__file__).resolve().parent.parent


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


def test_wait_policy_leaves_a_user_choice_alone():
    env = {}
    assert cpu_threads.apply_wait_policy(env) == cpu_threads.DEFAULT_WAIT_POLICY
    assert env == cpu_threads.DEFAULT_WAIT_POLICY
    for user in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(user)
        assert cpu_threads.apply_wait_policy(env) == {}
        assert env == user


def test_cpu_backend_takes_its_default_from_the_policy(monkeypatch):
    from pyx.cpu_backend import CpuBackend
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda root="/": 1.0)
    assert CpuBackend().num_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert CpuBackend().num_threads == 3
    assert CpuBackend(num_threads=2).num_threads == 2


def libgomp_spin_count(extra: dict, code: str = "import pyx.cpu_backend") -> str:
    """The spin count libgomp says it read (OMP_DISPLAY_ENV=VERBOSE) when a fresh process runs
    `code`; the wait policy is reflected there (passive: 0, active: 30 billion)."""
    env = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAIT_VARIABLES}
    env.update(extra, OMP_DISPLAY_ENV="VERBOSE")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    [line] = [ln.strip() for ln in res.stderr.splitlines() if "GOMP_SPINCOUNT" in ln]
    return line


def test_libgomp_loads_with_the_default_wait_policy():
    """The policy is in the environment before the extension loads libgomp, which reads it only
    then; a user's own setting is what libgomp gets."""
    bare = libgomp_spin_count({}, "import ctypes; ctypes.CDLL('libgomp.so.1')")
    ours = libgomp_spin_count(cpu_threads.DEFAULT_WAIT_POLICY)
    assert ours != bare
    assert libgomp_spin_count({}) == ours
    assert libgomp_spin_count({"GOMP_SPINCOUNT": "12345"}) == "GOMP_SPINCOUNT = '12345'"

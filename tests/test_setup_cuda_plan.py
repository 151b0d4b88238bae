"""setup.py's choice of whether to compile the CUDA kernels, and for which architectures (issue
27: nvcc compiled four architectures for 13 minutes on a machine without a GPU). The GPU detection
is replaced by fakes; setup.py is imported as a module, which builds nothing (its setup() runs
only as a script)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("taper_setup", os.path.join(ROOT, "setup.py"))
setup_py = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setup_py)

NVCC = "/usr/local/cuda/bin/nvcc"
DEFAULT = ["80", "86", "89", "90a"]


def gpus(*caps):
    return lambda: list(caps) or None


def no_detection():
    raise AssertionError("the GPUs were probed although the settings decide")


@pytest.mark.parametrize("env, nvcc, detect, archs", [
    # by default: only where a GPU is visible, for its architecture
    ({}, NVCC, gpus(), []),
    ({}, NVCC, gpus("9.0"), ["90a"]),
    ({}, NVCC, gpus("8.0", "8.6", "8.6"), ["80", "86"]),
    ({}, NVCC, gpus("12.0"), ["120"]),
    ({}, NVCC, gpus("7.5"), []),                       # older than the kernels need
    ({}, NVCC, gpus("?"), DEFAULT),                    # listed by the driver, no compute_cap
    ({}, None, gpus("9.0"), []),                       # no nvcc
    # TAPER_CUDA=0 wins
    ({"TAPER_CUDA": "0"}, NVCC, no_detection, []),
    ({"TAPER_CUDA": "0", "TAPER_CUDA_ARCHS": "90a"}, NVCC, no_detection, []),
    # TAPER_CUDA_ARCHS: exactly those, GPU or not
    ({"TAPER_CUDA_ARCHS": "80;90a"}, NVCC, no_detection, ["80", "90a"]),
    ({"TAPER_CUDA_ARCHS": " 86 ; "}, NVCC, no_detection, ["86"]),
    ({"TAPER_CUDA_ARCHS": ""}, NVCC, gpus(), []),      # empty is unset
    # TAPER_CUDA=1: the GPUs' architectures, else the default four
    ({"TAPER_CUDA": "1"}, NVCC, gpus(), DEFAULT),
    ({"TAPER_CUDA": "1"}, NVCC, gpus("8.9"), ["89"]),
    ({"TAPER_CUDA": "1", "TAPER_CUDA_ARCHS": "80"}, NVCC, no_detection, ["80"]),
])
def test_cuda_plan(env, nvcc, detect, archs):
    got, why = setup_py.cuda_plan(env, nvcc, detect)
    assert got == archs, why
    assert why
    if not archs:
        assert "CPU backend only" in why


def test_no_gpu_says_how_to_build_the_kernels_anyway():
    archs, why = setup_py.cuda_plan({}, NVCC, gpus())
    assert archs == [] and "no GPU visible" in why and "TAPER_CUDA=1" in why


@pytest.mark.parametrize("env, words", [
    ({"TAPER_CUDA": "1"}, ["TAPER_CUDA=1", "nvcc"]),
    ({"TAPER_CUDA_ARCHS": "80;90a"}, ["TAPER_CUDA_ARCHS=80;90a", "nvcc"]),
    ({"TAPER_CUDA": "yes"}, ["TAPER_CUDA='yes'"]),
    ({"TAPER_CUDA_ARCHS": "sm_90a"}, ["'sm_90a'", "not a GPU architecture"]),
    ({"TAPER_CUDA_ARCHS": "9.0"}, ["'9.0'"]),
])
def test_bad_settings_stop_with_a_message(env, words):
    # an explicit request for the kernels without nvcc, or a value that means nothing
    with pytest.raises(ValueError) as e:
        setup_py.cuda_plan(env, None, no_detection)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("cap, arch", [("8.0", "80"), ("8.6", "86"), ("9.0", "90a"),
                                       ("10.0", "100"), ("12.0", "120"), ("7.5", None),
                                       (" 8.9 ", "89"), ("N/A", None), ("", None)])
def test_nvcc_arch(cap, arch):
    assert setup_py.nvcc_arch(cap) == arch


class FakeRun:
    def __init__(self, returncode=0, stdout="", raises=None):
        self.returncode, self.stdout, self.raises, self.calls = returncode, stdout, raises, []

    def __call__(self, cmd, **kwargs):
        self.calls.append((cmd, kwargs))
        if self.raises:
            raise self.raises
        return subprocess.CompletedProcess(cmd, self.returncode, self.stdout, "")


def test_detect_gpus_reads_nvidia_smi(tmp_path):
    run = FakeRun(stdout="9.0\n9.0\n")
    assert setup_py.detect_gpus(run, str(tmp_path / "none")) == ["9.0", "9.0"]
    cmd, kwargs = run.calls[0]
    assert cmd[0] == "nvidia-smi" and "--query-gpu=compute_cap" in cmd
    assert kwargs.get("timeout")           # a hung driver cannot hang the install


@pytest.mark.parametrize("run", [
    FakeRun(raises=FileNotFoundError("nvidia-smi")),               # no driver tools
    FakeRun(returncode=9, stdout="NVIDIA-SMI has failed"),          # no driver
    FakeRun(returncode=6, stdout="No devices were found"),
    FakeRun(raises=subprocess.TimeoutExpired("nvidia-smi", 60)),
    FakeRun(stdout="\n"),
])
def test_detect_gpus_without_a_gpu(run, tmp_path):
    assert setup_py.detect_gpus(run, str(tmp_path / "none")) is None
    empty = tmp_path / "gpus"
    empty.mkdir()
    assert setup_py.detect_gpus(run, str(empty)) is None


def test_detect_gpus_listed_by_the_driver_only(tmp_path):
    # nvidia-smi missing, or too old for compute_cap: the driver's list still shows the GPUs
    listed = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (listed / bus).mkdir(parents=True)
    run = FakeRun(returncode=2, stdout='Field "compute_cap" is not a valid field')
    assert setup_py.detect_gpus(run, str(listed)) == ["?", "?"]
    assert setup_py.cuda_plan({}, NVCC, lambda: ["?", "?"])[0] == DEFAULT


def test_setup_py_stops_on_a_bad_setting():
    # the build itself, not only cuda_plan: one line naming the variable, no traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPER_")}
    env["TAPER_CUDA_ARCHS"] = "hopper"
    done = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "TAPER_CUDA_ARCHS='hopper'" in done.stderr and "Traceback" not in done.stderr

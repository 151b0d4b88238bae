"""The GPU window's scripts (issue 26), checked without a GPU: the prebuilt extensions' stamp
(bench/gpu_prebuilt.py), the verdicts and winners (bench/gpu_summary.py), and both suites of
bench/gpu_check.sh end to end in their dry mode, where every GPU step says "no device"."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from bench import gpu_prebuilt, gpu_summary
from bench.kernels import kernel_switch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the stamp

def fake_tree(root):
    """A source tree with two of the build's sources and one built extension beside it."""
    os.makedirs(os.path.join(root, "pyx"))
    os.makedirs(os.path.join(root, "cuda"))
    for rel, text in (("setup.py", "# build\n"), ("pyx/a.pyx", "x = 1\n"),
                      ("cuda/k.cu", "__global__ void k() {}\n")):
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)


def test_install_checks_every_source_against_the_stamp(tmp_path, capsys):
    src, build, dest = tmp_path / "src", tmp_path / "build", tmp_path / "dest"
    fake_tree(src)
    fake_tree(dest)
    os.makedirs(build / "pyx")
    ext = "a" + sysconfig.get_config_var("EXT_SUFFIX")
    (build / "pyx" / ext).write_bytes(b"\x7fELF built")
    info = gpu_prebuilt.stamp(str(build), root=str(src))
    assert sorted(info["sources"]) == ["cuda/k.cu", "pyx/a.pyx", "setup.py"]
    assert info["extensions"] == [ext]

    assert gpu_prebuilt.install(str(build), root=str(dest)) == 0
    assert (dest / "pyx" / ext).read_bytes() == b"\x7fELF built"

    # one byte of one source differs: nothing is installed, and the file is named
    (dest / "pyx" / ext).unlink()
    (dest / "cuda" / "k.cu").write_text("__global__ void k() { }\n")
    assert gpu_prebuilt.install(str(build), root=str(dest)) == 1
    assert "cuda/k.cu" in capsys.readouterr().err
    assert not (dest / "pyx" / ext).exists()
    # a source the build did not have counts as a difference too
    (dest / "cuda" / "k.cu").write_text("__global__ void k() {}\n")
    (dest / "cuda" / "new.cu").write_text("\n")
    assert gpu_prebuilt.install(str(build), root=str(dest)) == 1
    assert "cuda/new.cu" in capsys.readouterr().err


def test_install_refuses_another_python(tmp_path, capsys):
    fake_tree(tmp_path / "src")
    os.makedirs(tmp_path / "build" / "pyx")
    gpu_prebuilt.stamp(str(tmp_path / "build"), root=str(tmp_path / "src"))
    stamp_file = tmp_path / "build" / "BUILD.json"
    info = json.loads(stamp_file.read_text())
    info["python"] = "2.7.18"
    stamp_file.write_text(json.dumps(info))
    assert gpu_prebuilt.install(str(tmp_path / "build"), root=str(tmp_path / "src")) == 1
    assert "built for Python 2.7.18" in capsys.readouterr().err


# ---- verdicts and winners

def junit(path, cases):
    """A JUnit file as pytest writes it: (module, name, outcome) per test case."""
    body = []
    for module, name, outcome in cases:
        inner = {"passed": "", "failed": "<failure message='x'/>", "error": "<error message='x'/>",
                 "skipped": "<skipped message='x'/>"}[outcome]
        body.append(f'<testcase classname="tests.gpu.{module}" name="{name}">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")


def test_verdicts_per_switch_and_the_without_list(tmp_path):
    junit(tmp_path / "junit-test_cuda_marlin.xml", [
        ("test_cuda_marlin", "test_marlin_linear_matches_cpu[bf16-awq-g128-5-simple]", "passed"),
        ("test_cuda_marlin", "test_marlin_linear_matches_cpu[bf16-awq-g128-5-pipelined]",
         "failed")])
    junit(tmp_path / "junit-test_cuda_moe.xml", [
        ("test_cuda_moe", "test_align_matches_cpu[1-2-8]", "passed")])
    junit(tmp_path / "junit-test_cuda_fp8.xml", [
        ("test_cuda_fp8", "test_fp8_linear_matches_cpu[True-16]", "error"),
        ("test_cuda_fp8", "test_fp8_linear_matches_cpu[False-16]", "passed")])
    summary = gpu_summary.tests(str(tmp_path))
    assert summary["marlin=pipeline"] == dict(passed=0, failed=1, verdict="FAILED")
    assert summary["moe=fused"]["verdict"] == "passed"
    assert summary["fp8=cutlass"]["verdict"] == "FAILED"
    assert summary["sampling=fused"]["verdict"] == "not run"
    without = gpu_summary.not_passed(str(tmp_path))
    assert "marlin=pipeline" in without and "fp8=cutlass" in without
    assert "sampling=fused" in without          # never ran: never trusted
    assert "moe=fused" not in without
    assert not any(gpu_summary.is_default(s) for s in without)


def test_winner_needs_its_tests_and_every_shape(tmp_path):
    (tmp_path / "switches.json").write_text(json.dumps({
        "moe=fused": {"verdict": "passed"}, "fp8=cutlass": {"verdict": "FAILED"}}))

    def row(op, shape, variant, us):
        return dict(op=op, shape=shape, variant=variant, switch=kernel_switch(op, variant),
                    time_us=us)
    rows = [row("moe", "a", "per-expert bf16", 100.0), row("moe", "a", "grouped bf16", 50.0),
            row("moe", "b", "per-expert bf16", 100.0), row("moe", "b", "grouped bf16", 60.0),
            row("qgemm", "c", "bf16", 10.0), row("qgemm", "c", "fp8-cutlass", 5.0)]
    (tmp_path / "kernels.json").write_text(json.dumps({"rows": rows}))
    result = gpu_summary.winners(str(tmp_path))
    assert result["moe=fused"]["winner"]
    assert not result["fp8=cutlass"]["winner"]        # faster, but its tests failed
    # slower at one shape: not a winner, however fast elsewhere
    rows[3]["time_us"] = 101.0
    (tmp_path / "kernels.json").write_text(json.dumps({"rows": rows}))
    assert not gpu_summary.winners(str(tmp_path))["moe=fused"]["winner"]


def test_kernel_switch_names_only_choices_off_the_default():
    from pyx.kernel_config import KernelConfig
    default = KernelConfig()
    assert kernel_switch("prefill_attention", default.prefill) is None
    assert kernel_switch("prefill_attention", "simple") == "prefill=simple"
    decode_default = "one-pass" if default.decode == "simple" else "split-K x8"
    assert kernel_switch("decode_attention", decode_default) is None
    assert kernel_switch("qgemm", "bf16") is None
    assert kernel_switch("qgemm", "fp8-gemv") == "fp8_gemv=on"


# ---- the suites, dry

@pytest.mark.parametrize("suite", ["first", "figures"])
def test_suites_run_end_to_end_without_a_device(tmp_path, suite):
    """No GPU here (or a CUDA build without a device, as in CI): setup says "no device", every GPU
    step says it did not run and why, and the summary says it was a dry run."""
    env = {**os.environ, "GPU_SUITE": suite, "OUT": str(tmp_path / "out"),
           "GPU_LOGS": str(tmp_path / "logs"), "PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = (tmp_path / "out" / f"{suite}-summary.txt").read_text()
    steps = summary[summary.index("-- steps"):]
    assert "setup                no device" in steps
    gpu_steps = (["serve", "tests_default", "tests_quant", "tests_switches"] if suite == "first"
                 else ["kernels", "throughput", "throughput_switches", "spec", "serve",
                       "step_profile", "allreduce"])
    for step in gpu_steps:
        assert f"{step:<20} not run: no device" in steps, steps
    assert "dry run: no device" in steps
    assert (tmp_path / "out" / f"{suite}-logs.tgz").stat().st_size > 0


def test_figures_spec_step_runs_its_cpu_form_without_a_device(tmp_path):
    """GPU_DRY_SPEC=1: the spec step runs bench.gpu_spec with the GPU's arguments plus its CPU
    form's (tiny shapes), and the summary ends with gpu_summary's table: the step, its files and
    the table wired together, as the window will run them."""
    env = {**os.environ, "GPU_SUITE": "figures", "GPU_STEPS": "spec", "GPU_DRY_SPEC": "1",
           "OUT": str(tmp_path / "out"), "GPU_LOGS": str(tmp_path / "logs"),
           "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = (tmp_path / "out" / "figures-summary.txt").read_text()
    steps = summary[summary.index("-- steps"):]
    assert f"{'spec':<20} ok" in steps, steps
    assert f"{'kernels':<20} not run: not in GPU_STEPS" in steps
    table = summary[summary.index("-- spec:"):summary.index("-- steps")]
    for row in ("| 1 | none |", "| 1 | ngram k=4 | off |", "| 8 | draft_model k=4 | off |"):
        assert row in table, table
    # no verdicts from first here: graphs_verify=on is not trusted, and the table says so
    assert "graphs_verify=on not run: its tests did not pass in first" in table
    assert "FAILED" not in table


def test_unknown_suite_is_refused(tmp_path):
    env = {**os.environ, "GPU_SUITE": "core", "OUT": str(tmp_path), "GPU_LOGS": str(tmp_path)}
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "the suites are first and figures" in run.stderr


def test_the_readme_procedure_names_the_scripts():
    """bench/README.md's GPU window says how to build, carry and call; the scripts it names exist."""
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        text = f.read()
    section = text[text.index("## The GPU window"):]
    for script in ("bench/gpu_build.sh", "bench/gpu_wheels.sh", "bench.gpu_prebuilt travel",
                   "GPU_SUITE=first", "GPU_SUITE=figures"):
        assert script in section, script

"""tests/ci_skips.py: under TAPER_CI a CPU test skipped for a missing module fails the run."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, files: dict[str, str], ci: bool) -> subprocess.CompletedProcess:
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "TAPER_CI"}
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    if ci:
        env["TAPER_CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ci_skips",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


PASS = "def test_ok():\n    pass\n"
IN_TEST = "import pytest\ndef test_x():\n    pytest.importorskip('taper_no_such_module')\n"
AT_COLLECTION = "import pytest\npytest.importorskip('taper_no_such_module')\ndef test_x():\n    pass\n"
BY_MARK = ("import pytest\n@pytest.mark.skip(reason='could not import pyx.nothing (not built)')\n"
           "def test_x():\n    pass\n")
OTHER = "import pytest\ndef test_x():\n    pytest.skip('this CPU lacks avx512')\n"


@pytest.mark.parametrize("ci", [False, True])
@pytest.mark.parametrize("body", [IN_TEST, AT_COLLECTION, BY_MARK],
                         ids=["in_test", "at_collection", "by_mark"])
def test_a_skip_for_a_missing_module_fails_only_in_ci(tmp_path, body, ci):
    done = run_pytest(tmp_path, {"test_pass.py": PASS, "test_it.py": body}, ci)
    assert done.returncode == (1 if ci else 0), done.stdout
    assert ("skipped for a missing module" in done.stdout) == ci
    if ci:
        assert "test_it.py" in done.stdout.split("skipped for a missing module")[1]


def test_other_skips_pass_in_ci(tmp_path):
    done = run_pytest(tmp_path, {"test_it.py": OTHER}, ci=True)
    assert done.returncode == 0, done.stdout


def test_gpu_tests_may_skip_for_a_missing_module_in_ci(tmp_path):
    done = run_pytest(tmp_path, {"test_pass.py": PASS, "tests/gpu/test_it.py": IN_TEST}, ci=True)
    assert done.returncode == 0, done.stdout
    assert "skipped for a missing module" not in done.stdout

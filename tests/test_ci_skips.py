"""tests/ci_skips.py: under TAPER_CI a CPU test skipped for a missing module fails the run."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, body: str, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_it.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "TAPER_CI"}
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    if ci:
        env["TAPER_CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ci_skips",
                           "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


MISSING = "import pytest\ndef test_x():\n    pytest.importorskip('taper_no_such_module')\n"
OTHER = "import pytest\ndef test_x():\n    pytest.skip('this CPU lacks avx512')\n"


@pytest.mark.parametrize("ci", [False, True])
def test_a_skip_for_a_missing_module_fails_only_in_ci(tmp_path, ci):
    done = run_pytest(tmp_path, MISSING, ci)
    assert done.returncode == (1 if ci else 0), done.stdout
    assert ("skipped for a missing module" in done.stdout) == ci


def test_other_skips_pass_in_ci(tmp_path):
    done = run_pytest(tmp_path, OTHER, ci=True)
    assert done.returncode == 0, done.stdout

"""A pytest plugin (loaded by tests/conftest.py): where TAPER_CI is set, as `.ci/run` sets it, a
test outside tests/gpu that skips because a module is missing fails the run. Such a skip means
an install step is missing, which CI must see; GPU tests still skip where there is no GPU, with
their reason. Skips at collection (a module-level `pytest.importorskip`) count as well as skips in
a test, a fixture or a skip mark."""
from __future__ import annotations

import os
import re

import pytest

# pytest.importorskip's reason starts "could not import"; an ImportError's says "No module named"
MISSING_MODULE = re.compile(r"could not import|No module named", re.IGNORECASE)
_skips: list[str] = []


def _is_gpu_test(nodeid: str) -> bool:
    return "/tests/gpu/" in "/" + nodeid.split("::")[0].replace(os.sep, "/")


def _note(report) -> None:
    if not (report.skipped and isinstance(report.longrepr, tuple)):
        return
    reason = report.longrepr[2]
    if MISSING_MODULE.search(reason) and not _is_gpu_test(report.nodeid):
        _skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note(report)


def pytest_collectreport(report):
    _note(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if not (_skips and os.environ.get("TAPER_CI")):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["TAPER_CI: CPU tests skipped for a missing module (pin it in "
             "requirements-test.txt):", *(f"  {s}" for s in _skips)]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

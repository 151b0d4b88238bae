"""A pytest plugin (loaded by tests/conftest.py): where TAPER_CI is set, as `.ci/run` sets it, a
test outside tests/gpu that skips because a module is missing fails the run. Such a skip means
an install step is missing, which CI must see; GPU tests still skip where there is no GPU, with
their reason."""
from __future__ import annotations

import os
import re

import pytest

MISSING_MODULE = re.compile(r"could not import|No module named", re.IGNORECASE)
_skips: list[str] = []


def pytest_runtest_logreport(report):
    if not (report.skipped and isinstance(report.longrepr, tuple)):
        return
    path, lineno, reason = report.longrepr
    if "tests/gpu/" not in str(path).replace(os.sep, "/") and MISSING_MODULE.search(reason):
        _skips.append(f"{report.nodeid}: {reason}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _skips and os.environ.get("TAPER_CI"):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["TAPER_CI: CPU tests skipped for a missing module (pin it in "
                 "requirements-test.txt):", *(f"  {s}" for s in _skips)]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

"""Every third-party module Taper imports (engine/, pyx/, server/) comes from a distribution that
pyproject.toml declares: in `dependencies`, or in an extra for the optional CUDA backend."""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import tomllib

from test_import_graph import ROOT, cython_imported_names, imported_names, module_files

OWN = {"engine", "pyx", "server"}
# Imported only by optional features, declared in extras: the CUDA backend (cuda12/cuda13),
# tensor parallel across processes (mpi) and the Ray executor (ray).
EXTRAS_ONLY = {"cupy", "cupy_backends", "mpi4py", "ray"}
# Cython's compile-time cimports, not modules loaded at run time.
CYTHON_CIMPORTS = {"cython", "libc", "libcpp", "cpython", "posix"}


def declared() -> tuple[set[str], set[str]]:
    """(dependencies, extras' dependencies), as normalized distribution names."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(reqs):
        return {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower().replace("_", "-")
                for r in reqs}

    extras = set().union(*map(names, project.get("optional-dependencies", {}).values()))
    return names(project["dependencies"]), extras


def third_party_imports() -> set[str]:
    tops = set()
    for module, path in module_files().items():
        source = open(path, encoding="utf-8").read()
        names = (cython_imported_names(source) if path.endswith(".pyx")
                 else imported_names(source, module, path.endswith("__init__.py")))
        tops |= {n.split(".")[0] for n in names if n}
    return {t for t in tops - OWN - CYTHON_CIMPORTS
            if t not in sys.stdlib_module_names and t != "__future__" and not t.startswith("_")}


def test_every_imported_module_is_declared():
    deps, extras = declared()
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for top in sorted(third_party_imports()):
        dists = {d.lower().replace("_", "-") for d in providers.get(top, [])}
        wanted = extras if top in EXTRAS_ONLY else deps
        if top in EXTRAS_ONLY and not dists:
            continue   # not installed here (CuPy on a machine without a GPU)
        if not dists & wanted:
            missing[top] = sorted(dists) or ["(not installed)"]
    assert missing == {}


def test_no_declared_runtime_dependency_is_unused():
    deps, _ = declared()
    providers = importlib.metadata.packages_distributions()
    imported = {d.lower().replace("_", "-") for top in third_party_imports()
                for d in providers.get(top, [])}
    assert deps - imported == set()

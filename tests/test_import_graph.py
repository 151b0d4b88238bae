"""The package layout holds: every module imports in a fresh interpreter, and Taper's own imports
form no cycle, counting imports inside functions (an import moved into a function to dodge a
cycle is still a cycle) and leaving out `if TYPE_CHECKING:` ones (never run)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "pyx", "server")
# pyx.cuda_backend exists only in builds with nvcc (setup.py).
OPTIONAL = {"pyx.cuda_backend"}


def module_files() -> dict[str, str]:
    """Module name -> source file (.py, or .pyx for the Cython extensions)."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                stem, ext = os.path.splitext(name)
                if ext not in (".py", ".pyx") or "__pycache__" in folder:
                    continue
                parts = os.path.relpath(os.path.join(folder, stem), ROOT).split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement in `source` asks for, at any depth."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w.]+))",
                            re.M)


def cython_imported_names(source: str) -> set[str]:
    names = set()
    for base, what, plain in _CYTHON_IMPORT.findall(source):
        if plain:
            names.add(plain)
        else:
            names.add(base)
            names.update(f"{base}.{w.strip().split()[0]}" for w in what.strip("()").split(","))
    return names


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {}
    for module, path in files.items():
        source = open(path, encoding="utf-8").read()
        is_package = path.endswith("__init__.py")
        names = (cython_imported_names(source) if path.endswith(".pyx")
                 else imported_names(source, module, is_package))
        graph[module] = {n for n in names if n in files and n != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_cycle_finder_sees_a_cycle_through_a_function_level_import():
    source_a = "import os\n\ndef f():\n    from pkg import b\n"
    source_b = "from pkg.a import f\n"
    graph = {"pkg.a": {n for n in imported_names(source_a, "pkg.a", False) if n.startswith("pkg.")}
             - {"pkg"},
             "pkg.b": {n for n in imported_names(source_b, "pkg.b", False)
                       if n.startswith("pkg.")} - {"pkg.a.f"}}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
    assert "pkg.b" not in imported_names(guarded, "pkg.a", False)


def test_every_module_imports_in_a_fresh_interpreter():
    # A __main__ module runs its program when imported.
    modules = sorted(m for m in set(module_files()) - OPTIONAL if not m.endswith(".__main__"))
    script = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except Exception as e:\n        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
              "print('\\n'.join(failed))\n")
    done = subprocess.run([sys.executable, "-c", script, *modules], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""

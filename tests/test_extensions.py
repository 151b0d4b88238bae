"""The compiled extensions as the process sees them: what each exports, and the import order of
`python -m server`, in which the 2026-11-24 H100 run crashed (issue 11).

There, `python -m server` imported pyx.cuda_backend (to count GPUs) before ml_dtypes, and ml_dtypes'
first `str()` of a float segfaulted inside libstdc++. The extension exported C++ vague-linkage
symbols (std::ctype<char>::do_widen, libcu++ and CUTLASS template instances), and an extension is
searched before its own dependencies, so libstdc++.so.6, loaded as the extension's dependency,
bound its own symbols to the extension's copies for the rest of the process (`LD_DEBUG=bindings`
shows `binding file .../libstdc++.so.6 to .../cuda_backend...so: normal symbol
_ZNKSt5ctypeIcE8do_widenEc`). pyx/exports.map now makes every extension export PyInit_* alone.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

EXTENSIONS = ["pyx.backend", "pyx.cpu_backend", "pyx.layers", "pyx.int4", "pyx.fp8",
              "pyx.mxfp4", "pyx.cuda_backend"]


def built(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None and spec.origin else None


def exported_symbols(path: str) -> set[str]:
    """Symbols the shared object defines in its dynamic symbol table (what other objects can bind
    to), read with binutils' nm."""
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("name", EXTENSIONS)
def test_every_extension_exports_only_its_init(name):
    path = built(name)
    if path is None:
        assert name == "pyx.cuda_backend", f"{name} was not built"
        pytest.skip("pyx.cuda_backend was not built (no nvcc on this machine, or TAPER_CUDA=0)")
    assert shutil.which("nm"), "binutils' nm is needed to read the extensions' symbol tables"
    assert exported_symbols(path) == {"PyInit_" + name.split(".")[-1]}


# The start-up of server/__main__.py up to the engine's construction: flags, backend choice (which
# loads pyx.cuda_backend where it was built), server settings (which import the engine and its
# loaders, ml_dtypes among them); then what crashed: ml_dtypes' finfo and str() of its floats.
SERVER_START = """
import sys
from server.__main__ import build_parser, engine_config, server_settings
args = build_parser().parse_args(["--w", sys.argv[1]])
config = engine_config(args)
server_settings(args, config)
import ml_dtypes, numpy as np
order = [m for m in sys.modules if m in ("pyx.cuda_backend", "ml_dtypes")]
for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
    t = getattr(ml_dtypes, name, None)
    if t is not None:
        str(ml_dtypes.finfo(t).max), str(np.array([1.5], t)[0])
print(" ".join(order))
"""


def test_server_start_up_imports_in_a_fresh_interpreter(tmp_path):
    from checkpoints import tiny_checkpoint
    model = tiny_checkpoint(str(tmp_path / "llama"), "llama")
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SERVER_START, model],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # The CUDA extension's library is loaded first, as on the GPU machine: its module init then
    # imports ml_dtypes (through pyx.weights), so sys.modules may list either first.
    want = {"pyx.cuda_backend", "ml_dtypes"} if built("pyx.cuda_backend") else {"ml_dtypes"}
    assert set(done.stdout.split()) == want

"""Build Taper's compiled parts.

Always: the Cython extensions in pyx/ (CPU kernels with OpenMP, no -march=native: ISA-specific
paths are chosen at run time). Only where nvcc is present and cuda/ holds kernels: one CUDA
extension from cuda/*.cu and cutlass_ext/*.cu, compiled ahead of time in parallel with the time of
each file printed (arch list from TAPER_CUDA_ARCHS, default "80;86;89;90a"; TAPER_CUDA=0 switches
the CUDA build off). cudart is linked statically, so the extension imports on a machine without a
driver and every CUDA call then returns an error status.
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

OPENMP = ["-fopenmp"]
DEFAULT_CUDA_ARCHS = "80;86;89;90a"
CUTLASS_VERSION = "4.2.0.0"     # pinned in pyproject.toml's build requirements too
C_FLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-Wno-unused-function"] + OPENMP
# Every extension exports PyInit_* alone (pyx/exports.map says why); --exclude-libs hides the
# symbols of static archives (cudart_static) too.
EXPORTS_ONLY_PYINIT = [
    "-Wl,--version-script=" + os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyx",
                                           "exports.map"),
    "-Wl,--exclude-libs,ALL"]


def cpu_extensions():
    common = dict(include_dirs=["pyx", numpy.get_include()],
                  extra_compile_args=C_FLAGS, extra_link_args=OPENMP + EXPORTS_ONLY_PYINIT,
                  define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
    return [
        Extension("pyx.backend", ["pyx/backend.pyx"], **common),
        Extension("pyx.cpu_backend", ["pyx/cpu_backend.pyx", "pyx/cpu_kernels.c",
                                      "pyx/quant_kernels.c", "pyx/quant_legacy.c",
                                      "pyx/quant_k.c"], **common),
        Extension("pyx.layers", ["pyx/layers.pyx"], **common),
        Extension("pyx.int4", ["pyx/int4.pyx", "pyx/int4_kernels.c"], **common),
        Extension("pyx.fp8", ["pyx/fp8.pyx", "pyx/fp8_kernels.c"], **common),
    ]


def nvcc_path():
    """nvcc on PATH, else under $CUDA_HOME (or /usr/local/cuda); None where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


def cudart_static_dir(nvcc):
    """The toolkit folder holding libcudart_static.a. nvcc may be a wrapper script, so ask it for
    its own install prefix first, then try the usual places."""
    roots = []
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True,
                             text=True)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:
                roots.append(line.split("TOP=", 1)[1].strip())
    except OSError:
        pass
    roots += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
              os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if os.path.exists(os.path.join(root, sub, "libcudart_static.a")):
                return os.path.join(root, sub)
    raise RuntimeError(f"libcudart_static.a not found next to {nvcc} (set CUDA_HOME)")


def cuda_sources():
    return sorted(glob.glob("cuda/*.cu") + glob.glob("cutlass_ext/*.cu"))


def cuda_extensions():
    """The CUDA extension, only where nvcc is present, the build is not switched off
    (TAPER_CUDA=0) and there are kernels to build."""
    nvcc = nvcc_path()
    if os.environ.get("TAPER_CUDA", "1") == "0":
        print("taper: TAPER_CUDA=0, building the CPU backend only")
        return []
    if not nvcc:
        print("taper: nvcc not found (PATH, $CUDA_HOME), building the CPU backend only")
        return []
    if not cuda_sources() or not os.path.exists("pyx/cuda_backend.pyx"):
        return []
    return [Extension("pyx.cuda_backend", ["pyx/cuda_backend.pyx"],
                      include_dirs=["pyx", "cuda", "cutlass_ext", numpy.get_include()],
                      library_dirs=[cudart_static_dir(nvcc)],
                      libraries=["cudart_static", "dl", "rt", "pthread", "stdc++"],
                      extra_compile_args=["-O2"], extra_link_args=EXPORTS_ONLY_PYINIT)]


def cutlass_includes():
    """CUTLASS's headers for cutlass_ext/: $CUTLASS_PATH (a CUTLASS checkout), else the
    nvidia-cutlass wheel (a build requirement), found without importing it."""
    if not glob.glob("cutlass_ext/*.cu"):
        return []
    root = os.environ.get("CUTLASS_PATH")
    if not root:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the CUDA build needs CUTLASS's headers: pip install "
                               f"nvidia-cutlass=={CUTLASS_VERSION}, or set CUTLASS_PATH, or "
                               "TAPER_CUDA=0 for a CPU-only build")
        root = os.path.join(spec.submodule_search_locations[0], "source")
    return [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]


def cuda_archs():
    """TAPER_CUDA_ARCHS, e.g. "80;86;89;90a": SASS for each (no PTX, so nothing is compiled by
    the driver at start-up); 90a unlocks Hopper's wgmma for the CUTLASS kernels."""
    archs = [a.strip() for a in os.environ.get("TAPER_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).split(";")]
    return [a for a in archs if a]


class BuildExt(build_ext):
    """Compiles .cu files with nvcc, in parallel, into objects linked into pyx.cuda_backend."""

    def build_extension(self, ext):
        if ext.name == "pyx.cuda_backend":
            ext.extra_objects = self.compile_cuda()
        super().build_extension(ext)

    def compile_cuda(self):
        nvcc = nvcc_path()
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cuda_archs()]
        includes = [f"-I{d}" for d in cutlass_includes()]
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        jobs = int(os.environ.get("TAPER_NVCC_JOBS") or os.cpu_count() or 1)
        print(f"taper: nvcc for {';'.join(cuda_archs())}, {len(cuda_sources())} files, "
              f"{jobs} at a time")

        def compile_one(src):
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Icuda", "-Icutlass_ext",
                   *includes, "--expt-relaxed-constexpr", *gencode, "-c", src, "-o", obj]
            start = time.monotonic()
            done = subprocess.run(cmd, capture_output=True, text=True)
            return src, obj, time.monotonic() - start, done

        start = time.monotonic()
        objects, failed, times = [], [], []
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for src, obj, seconds, done in pool.map(compile_one, cuda_sources()):
                times.append(f"taper: nvcc {src}: {seconds:.1f} s")
                print(times[-1])
                if done.returncode:
                    failed.append(f"{src}:\n{done.stdout}{done.stderr}")
                objects.append(obj)
        times.append(f"taper: nvcc total {time.monotonic() - start:.1f} s wall")
        print(times[-1])
        # pip hides build output; CI prints this file after the install.
        os.makedirs("build", exist_ok=True)
        with open(os.path.join("build", "nvcc-times.txt"), "w") as f:
            f.write("\n".join(times) + "\n")
        if failed:
            raise RuntimeError("nvcc failed:\n" + "\n".join(failed))
        return objects


setup(
    # Every package under engine/, server/ and pyx/ (server.chat, server.tool_parsers, ...): a
    # hand-kept list forgot new subpackages, which a non-editable install then lacked.
    packages=find_packages(include=["engine", "engine.*", "server", "server.*", "pyx", "pyx.*"]),
    package_data={"server": ["static/*"], "pyx": ["*.pxd", "*.pxi", "*.h"]},
    ext_modules=cythonize(cpu_extensions() + cuda_extensions(),
                          compiler_directives={"language_level": "3", "boundscheck": False,
                                               "wraparound": False, "cdivision": True}),
    cmdclass={"build_ext": BuildExt},
)

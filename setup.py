"""Build Taper's compiled parts.

Always: the Cython extensions in pyx/ (CPU kernels with OpenMP, no -march=native: ISA-specific
paths are chosen at run time). The CUDA extension (cuda/*.cu and cutlass_ext/*.cu, compiled ahead
of time by nvcc, in parallel) only where it can run or where it is asked for (cuda_plan says
which): a GPU this machine shows (`nvidia-smi`), for the architectures of the GPUs found; or
TAPER_CUDA_ARCHS="80;90a" (those architectures) or TAPER_CUDA=1 (the GPUs' architectures, else
DEFAULT_CUDA_ARCHS) on a machine without one, such as a CI or wheel-building machine. TAPER_CUDA=0
switches it off. cudart is linked statically, so the extension imports on a machine without a
driver and every CUDA call then returns an error status.

Progress (each extension, each nvcc file as it finishes, with times) goes to stdout, which pip
shows only with `pip install -v`, and to build/taper-build.log as it happens.

Run as a script only (`__name__ == "__main__"`, as pip's backend and `python setup.py` run it), so
that tests can import the functions below without building anything.
"""
import glob
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_LOG = os.path.join(ROOT, "build", "taper-build.log")
# Persistent, unlike an editable install's build_temp (a temporary directory each time): a second
# `pip install -e .` recompiles only the .cu files that changed.
CUDA_OBJECTS = os.path.join(ROOT, "build", "cuda-objects")

OPENMP = ["-fopenmp"]
DEFAULT_CUDA_ARCHS = ["80", "86", "89", "90a"]
OLDEST_CUDA_ARCH = 80            # the kernels use sm_80's mma.sync, cp.async and bf16
CUTLASS_VERSION = "4.2.0.0"      # pinned in pyproject.toml's build requirements too
C_FLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-Wno-unused-function"] + OPENMP
# Every extension exports PyInit_* alone (pyx/exports.map says why); --exclude-libs hides the
# symbols of static archives (cudart_static) too.
EXPORTS_ONLY_PYINIT = ["-Wl,--version-script=" + os.path.join(ROOT, "pyx", "exports.map"),
                       "-Wl,--exclude-libs,ALL"]
CYTHON_DIRECTIVES = {"language_level": "3", "boundscheck": False, "wraparound": False,
                     "cdivision": True}


def files(*patterns):
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(ROOT, pattern)))


def cpu_depends():
    """What every extension's compile reads besides its sources: a change to any of them rebuilds
    it (headers are not traced per source: any header change rebuilds them all)."""
    return files("pyx/*.h", "pyx/*.pxd", "pyx/*.pxi", "pyx/exports.map", "setup.py")


def cuda_headers():
    return files("cuda/*.cuh", "cuda/*.h", "cutlass_ext/*.cuh", "cutlass_ext/*.h")


def cpu_extensions():
    import numpy
    common = dict(include_dirs=["pyx", numpy.get_include()], depends=cpu_depends(),
                  extra_compile_args=C_FLAGS, extra_link_args=OPENMP + EXPORTS_ONLY_PYINIT,
                  define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
    return [
        Extension("pyx.backend", ["pyx/backend.pyx"], **common),
        Extension("pyx.cpu_backend", ["pyx/cpu_backend.pyx", "pyx/cpu_kernels.c",
                                      "pyx/quant_kernels.c", "pyx/quant_legacy.c",
                                      "pyx/quant_k.c", "pyx/quant_gemm.c",
                                      "pyx/quant_gemm_legacy.c", "pyx/lora_kernels.c",
                                      "pyx/moe_kernels.c", "pyx/mla_kernels.c",
                                      "pyx/gated_delta_kernels.c"], **common),
        Extension("pyx.layers", ["pyx/layers.pyx"], **common),
        Extension("pyx.int4", ["pyx/int4.pyx", "pyx/int4_kernels.c"], **common),
        Extension("pyx.fp8", ["pyx/fp8.pyx", "pyx/fp8_kernels.c"], **common),
        Extension("pyx.mxfp4", ["pyx/mxfp4.pyx", "pyx/mxfp4_kernels.c"], **common),
    ]


def nvcc_path():
    """nvcc on PATH, else under $CUDA_HOME (or /usr/local/cuda); None where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


def nvcc_arch(capability: str) -> str | None:
    """nvcc's name for a compute capability as nvidia-smi prints it ("8.6" -> "86"); Hopper's
    9.0 is "90a", the arch-specific target that has wgmma (the fa3 prefill, the CUTLASS FP8
    GEMM). None for a GPU older than the kernels need."""
    m = re.fullmatch(r"(\d+)\.(\d+)", capability.strip())
    if not m:
        return None
    arch = int(m[1]) * 10 + int(m[2])
    if arch < OLDEST_CUDA_ARCH:
        return None
    return "90a" if arch == 90 else str(arch)


def detect_gpus(run=subprocess.run, gpus_dir="/proc/driver/nvidia/gpus"):
    """The compute capability of each GPU this machine shows (e.g. ["9.0"]), found cheaply and
    without a CUDA context: `nvidia-smi --query-gpu=compute_cap`. None where no GPU is visible;
    "?" for each GPU that the driver lists under gpus_dir when nvidia-smi cannot say (missing, or a
    driver older than the compute_cap field)."""
    try:
        done = run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0:
        caps = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        if caps:
            return caps
    try:
        listed = os.listdir(gpus_dir)
    except OSError:
        listed = []
    return ["?"] * len(listed) or None


def parse_archs(text: str) -> list[str]:
    archs = [a.strip() for a in text.split(";") if a.strip()]
    for a in archs:
        if not re.fullmatch(r"\d{2,3}[af]?", a):
            raise ValueError(f"TAPER_CUDA_ARCHS={text!r}: {a!r} is not a GPU architecture "
                             "(write them as nvcc's numbers, e.g. TAPER_CUDA_ARCHS=\"80;86;90a\")")
    return archs


def cuda_plan(env, nvcc, detect=detect_gpus):
    """Whether to build the CUDA kernels and for which architectures: (archs, why), archs empty
    for a CPU-only build; why is the line the build prints. The kernels are compiled by default
    only where they can run (nvcc for four architectures took 13 of a 15-minute install on a
    GPU-less machine): explicit settings first (TAPER_CUDA=0 off; TAPER_CUDA_ARCHS those
    architectures; TAPER_CUDA=1 on), then the GPUs detect() finds."""
    switch = env.get("TAPER_CUDA", "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"TAPER_CUDA={switch!r}: use 1 (build the CUDA kernels) or 0 (do not)")
    if switch == "0":
        return [], "TAPER_CUDA=0: building the CPU backend only"
    asked = parse_archs(env.get("TAPER_CUDA_ARCHS", ""))
    opted_in = switch == "1" or bool(asked)
    if not nvcc:
        if opted_in:
            which = "TAPER_CUDA=1" if switch == "1" else f"TAPER_CUDA_ARCHS={';'.join(asked)}"
            raise ValueError(f"{which} asks for the CUDA kernels, but nvcc is not on PATH nor "
                             "under $CUDA_HOME (or /usr/local/cuda); install the CUDA toolkit, "
                             "or unset it for a CPU-only build")
        return [], "nvcc not found (PATH, $CUDA_HOME): building the CPU backend only"
    if asked:
        return asked, f"TAPER_CUDA_ARCHS: building the CUDA kernels for {', '.join(asked)}"
    gpus = detect() or []
    found = sorted({a for a in (nvcc_arch(c) for c in gpus if c != "?") if a})
    listing = ", ".join(gpus)
    if found:
        return found, (f"GPU compute capability {listing}: building the CUDA kernels for "
                       f"{', '.join(found)}")
    if switch == "1":
        return DEFAULT_CUDA_ARCHS, (f"TAPER_CUDA=1: building the CUDA kernels for "
                                    f"{', '.join(DEFAULT_CUDA_ARCHS)}")
    if "?" in gpus:
        return DEFAULT_CUDA_ARCHS, ("a GPU is visible but nvidia-smi does not give its compute "
                                    "capability: building the CUDA kernels for "
                                    f"{', '.join(DEFAULT_CUDA_ARCHS)}")
    if gpus:
        return [], (f"GPU compute capability {listing}: older than the kernels need "
                    f"({OLDEST_CUDA_ARCH // 10}.{OLDEST_CUDA_ARCH % 10}), building the CPU backend "
                    "only")
    return [], ("nvcc found but no GPU visible (nvidia-smi): building the CPU backend only "
                "(TAPER_CUDA=1, or TAPER_CUDA_ARCHS=\"80;90a\", builds the CUDA kernels anyway)")


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
    return files("cuda/*.cu", "cutlass_ext/*.cu")


def cuda_extensions(archs, nvcc):
    """The CUDA extension, where cuda_plan gave architectures and there are kernels to build."""
    import numpy
    if not archs or not cuda_sources() or not os.path.exists(
            os.path.join(ROOT, "pyx", "cuda_backend.pyx")):
        return []
    return [Extension("pyx.cuda_backend", ["pyx/cuda_backend.pyx"],
                      include_dirs=["pyx", "cuda", "cutlass_ext", numpy.get_include()],
                      depends=cpu_depends() + cuda_sources() + cuda_headers(),
                      library_dirs=[cudart_static_dir(nvcc)],
                      libraries=["cudart_static", "dl", "rt", "pthread", "stdc++"],
                      extra_compile_args=["-O2"], extra_link_args=EXPORTS_ONLY_PYINIT)]


def cutlass_includes():
    """CUTLASS's headers for cutlass_ext/: $CUTLASS_PATH (a CUTLASS checkout), else the
    nvidia-cutlass wheel (a build requirement), found without importing it."""
    if not glob.glob(os.path.join(ROOT, "cutlass_ext", "*.cu")):
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


def cutlass_identity():
    """Which CUTLASS headers the build reads: $CUTLASS_PATH, else the nvidia-cutlass wheel's
    version."""
    if os.environ.get("CUTLASS_PATH"):
        return f"CUTLASS_PATH={os.environ['CUTLASS_PATH']}"
    try:
        return f"nvidia-cutlass {importlib.metadata.version('nvidia-cutlass')}"
    except importlib.metadata.PackageNotFoundError:
        return "no nvidia-cutlass"


def cython_current(ext):
    """ext with each .pyx source swapped for its generated .c where that is newer than the .pyx and
    every .pxd/.pxi in pyx/ (cythonize would compare against numpy's .pxd as well, which each
    isolated build environment installs afresh, and so regenerate the .c every time)."""
    inputs = newest_mtime(files("pyx/*.pxd", "pyx/*.pxi", "setup.py"))
    sources = []
    for src in ext.sources:
        c_file = os.path.join(ROOT, os.path.splitext(src)[0] + ".c")
        if src.endswith(".pyx") and os.path.exists(c_file) and os.path.getmtime(c_file) > max(
                inputs, os.path.getmtime(os.path.join(ROOT, src))):
            src = os.path.splitext(src)[0] + ".c"
        sources.append(src)
    ext.sources = sources
    return ext


def progress(line):
    """A progress line: on stdout at once (pip shows it with -v) and in build/taper-build.log."""
    print(line, flush=True)
    with open(BUILD_LOG, "a") as f:
        f.write(line + "\n")


def newest_mtime(paths):
    return max((os.path.getmtime(p) for p in paths), default=0.0)


def write_if_changed(path, text):
    """Rewrite path only when its text changes, so its mtime marks the last change (a stamp that
    dependants compare against, as make does)."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)


class BuildExt(build_ext):
    """Prints each extension's progress, and compiles .cu files with nvcc, in parallel, into
    objects linked into pyx.cuda_backend. In an editable install (`pip install -e .`, whose
    build directory is new every time) an extension whose in-place file is newer than everything
    it is built from is reused, so the test command's `pip install -e .` after the serve
    command's rebuilds nothing."""

    cuda_archs: list = []
    cuda_why = ""

    def finalize_options(self):
        super().finalize_options()
        # One extension per core at a time (`-j` still overrides): the CPU build on 2 cores
        # takes about the time of pyx.cpu_backend alone instead of the sum of all five.
        if self.parallel is None:
            self.parallel = len(os.sched_getaffinity(0))

    def run(self):
        os.makedirs(os.path.dirname(BUILD_LOG), exist_ok=True)
        open(BUILD_LOG, "w").close()
        self.started = time.monotonic()
        progress(f"taper: {self.cuda_why}")
        super().run()
        progress(f"taper: extensions done in {time.monotonic() - self.started:.0f} s")

    def build_extension(self, ext):
        index = self.extensions.index(ext) + 1
        tag = f"taper: [{index}/{len(self.extensions)}] {ext.name}"
        start = time.monotonic()
        cuda = ext.name == "pyx.cuda_backend"
        if cuda:
            stamp = self.cuda_flags_stamp()
            ext.depends = ext.depends + [stamp]
        if self.reuse_in_place(ext):
            progress(f"{tag}: up to date (in place), not rebuilt")
            return
        progress(f"{tag}: compiling")
        if cuda:
            ext.extra_objects = self.compile_cuda(stamp)
        super().build_extension(ext)
        progress(f"{tag}: done in {time.monotonic() - start:.1f} s")

    def reuse_in_place(self, ext):
        """In an editable install: the in-place file, copied to where the build expects it, when
        it is newer than the extension's sources and dependencies."""
        if not getattr(self, "editable_mode", False) or self.force:
            return False
        in_place = os.path.join(ROOT, self.get_ext_filename(ext.name))
        if not os.path.exists(in_place):
            return False
        inputs = [os.path.join(ROOT, s) for s in ext.sources] + list(ext.depends)
        if os.path.getmtime(in_place) <= newest_mtime(inputs):
            return False
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(in_place, target)
        return True

    def nvcc_command(self):
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in self.cuda_archs]
        includes = [f"-I{d}" for d in cutlass_includes()]
        return [nvcc_path(), "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Icuda", "-Icutlass_ext",
                *includes, "--expt-relaxed-constexpr", *gencode]

    def cuda_flags_stamp(self):
        """A file whose text is what the objects are compiled with: the nvcc command line, where
        CUTLASS's headers are named by their version rather than their path (a new temporary
        directory in each isolated build). Objects and the extension older than it were built
        otherwise and are rebuilt."""
        os.makedirs(CUDA_OBJECTS, exist_ok=True)
        stamp = os.path.join(CUDA_OBJECTS, "nvcc-command.txt")
        command = [a for a in self.nvcc_command()
                   if not any(a == f"-I{d}" for d in cutlass_includes())]
        write_if_changed(stamp, f"{' '.join(command)}\n{cutlass_identity()}\n")
        return stamp

    def compile_cuda(self, stamp):
        base = self.nvcc_command()
        jobs = int(os.environ.get("TAPER_NVCC_JOBS") or os.cpu_count() or 1)
        newest_input = newest_mtime(cuda_headers() + [stamp, os.path.join(ROOT, "setup.py")])

        def obj_of(src):
            return os.path.join(CUDA_OBJECTS, os.path.relpath(src, ROOT).replace(os.sep, "__")
                                + ".o")

        def current(src):
            obj = obj_of(src)
            return os.path.exists(obj) and os.path.getmtime(obj) > max(newest_input,
                                                                    os.path.getmtime(src))

        def compile_one(src):
            start = time.monotonic()
            done = subprocess.run([*base, "-c", src, "-o", obj_of(src)], capture_output=True,
                                  text=True, cwd=ROOT)
            return src, time.monotonic() - start, done

        sources = cuda_sources()
        todo = [s for s in sources if not current(s)]
        progress(f"taper: nvcc for {', '.join(self.cuda_archs)}: {len(todo)} of {len(sources)} "
                 f"files to compile ({len(sources) - len(todo)} up to date), {jobs} at a time")
        start = time.monotonic()
        failed = []
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(compile_one, s) for s in todo]
            for done_count, future in enumerate(as_completed(futures), 1):
                src, seconds, done = future.result()
                status = "FAILED" if done.returncode else f"{seconds:.1f} s"
                progress(f"taper: nvcc [{done_count}/{len(todo)}] {os.path.relpath(src, ROOT)}: "
                         f"{status}, {len(todo) - done_count} left, "
                         f"{time.monotonic() - start:.0f} s so far")
                if done.returncode:
                    failed.append(f"{src}:\n{done.stdout}{done.stderr}")
        if failed:
            raise RuntimeError("nvcc failed:\n" + "\n".join(failed))
        progress(f"taper: nvcc total {time.monotonic() - start:.1f} s wall")
        return [obj_of(s) for s in sources]


def main():
    from Cython.Build import cythonize
    try:
        archs, why = cuda_plan(os.environ, nvcc_path())
    except ValueError as e:
        sys.exit(f"taper: {e}")
    BuildExt.cuda_archs, BuildExt.cuda_why = archs, why
    setup(
        # Every package under engine/, server/ and pyx/ (server.chat, server.tool_parsers, ...): a
        # hand-kept list forgot new subpackages, which a non-editable install then lacked.
        packages=find_packages(include=["engine", "engine.*", "server", "server.*", "pyx",
                                        "pyx.*"]),
        package_data={"server": ["static/*"], "pyx": ["*.pxd", "*.pxi", "*.h"]},
        ext_modules=cythonize([cython_current(e) for e in cpu_extensions()
                               + cuda_extensions(archs, nvcc_path())],
                              compiler_directives=CYTHON_DIRECTIVES),
        cmdclass={"build_ext": BuildExt},
    )


if __name__ == "__main__":
    main()

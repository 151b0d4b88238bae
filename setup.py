"""Build Taper's compiled parts.

Always: the Cython extensions in pyx/ (CPU kernels with OpenMP, no -march=native: ISA-specific
paths are chosen at run time). Only where nvcc is present and cuda/ holds kernels: one CUDA
extension from cuda/*.cu and cutlass_ext/*.cu (arch list from TAPER_CUDA_ARCHS, default "80;90a").
"""
import glob
import os
import shutil
import subprocess

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = ["-fopenmp"]
C_FLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-Wno-unused-function"] + OPENMP


def cpu_extensions():
    common = dict(include_dirs=["pyx", numpy.get_include()],
                  extra_compile_args=C_FLAGS, extra_link_args=OPENMP,
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


def cuda_sources():
    return sorted(glob.glob("cuda/*.cu") + glob.glob("cutlass_ext/*.cu"))


def cuda_extensions():
    """The CUDA extension, only where nvcc is present and there are kernels to build."""
    if not shutil.which("nvcc") or not cuda_sources() or not os.path.exists("pyx/cuda_backend.pyx"):
        return []
    return [Extension("pyx.cuda_backend", ["pyx/cuda_backend.pyx"],
                      include_dirs=["pyx", "cuda", "cutlass_ext", numpy.get_include()],
                      libraries=["cudart_static", "dl", "rt", "pthread", "stdc++"],
                      extra_compile_args=["-O2"])]


class BuildExt(build_ext):
    """Compiles .cu files with nvcc into objects that are linked into pyx.cuda_backend."""

    def build_extension(self, ext):
        if ext.name == "pyx.cuda_backend":
            ext.extra_objects = self.compile_cuda()
        super().build_extension(ext)

    def compile_cuda(self):
        archs = os.environ.get("TAPER_CUDA_ARCHS", "80;90a").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        objects = []
        for src in cuda_sources():
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            cmd = ["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Icuda", "-Icutlass_ext",
                   *gencode, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


setup(
    packages=["engine", "engine.loader", "engine.models", "server", "pyx"],
    package_data={"server": ["static/*"], "pyx": ["*.pxd", "*.h"]},
    ext_modules=cythonize(cpu_extensions() + cuda_extensions(),
                          compiler_directives={"language_level": "3", "boundscheck": False,
                                               "wraparound": False, "cdivision": True}),
    cmdclass={"build_ext": BuildExt},
)

"""Which backend an engine runs on, and making it. "auto" is CUDA where this build has the CUDA
extension and a device is visible, else the CPU."""
from __future__ import annotations

import importlib.util

from threadpoolctl import threadpool_limits

CUDA_ACT_DTYPES = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16",
                   "float16": "f16", "f32": "f32", "float32": "f32"}


def detect_backend() -> str:
    """cuda or cpu: what "auto" means on this machine."""
    if importlib.util.find_spec("pyx.cuda_backend") is None:   # built without nvcc
        return "cpu"
    from pyx.cuda_backend import device_count   # the optional extension, once known to exist
    return "cuda" if device_count() > 0 else "cpu"


def make_backend(config):
    """The backend of an EngineConfig (its backend already resolved from "auto")."""
    # Our OpenMP kernels use every core; NumPy's BLAS must not start a second pool beside them.
    threadpool_limits(limits=1, user_api="blas")
    if config.backend == "cpu":
        from pyx.cpu_backend import CpuBackend
        return CpuBackend(batch_invariant=config.batch_invariant)
    if config.backend == "cuda":
        try:   # the optional extension: only builds with nvcc have it
            from pyx.cuda_backend import CudaBackend
        except ImportError as e:
            raise ValueError("this build of Taper has no CUDA backend (it was installed without "
                             "nvcc, or with TAPER_CUDA=0); reinstall where nvcc is on PATH") from e
        return CudaBackend(dtype=CUDA_ACT_DTYPES[config.dtype], device=config.device)
    raise ValueError(f"unknown backend {config.backend!r}: cpu or cuda")

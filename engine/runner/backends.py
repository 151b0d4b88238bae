"""Which backend an engine runs on, and making it. "auto" is CUDA where this build has the CUDA
extension and a device is visible, else the CPU."""
from __future__ import annotations

import importlib.util
import logging

from threadpoolctl import threadpool_limits

from pyx import cpu_threads
from pyx.kernel_config import KernelConfig, retired_variables

log = logging.getLogger("taper.engine")

CUDA_ACT_DTYPES = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16",
                   "float16": "f16", "f32": "f32", "float32": "f32"}


def detect_backend() -> str:
    """cuda or cpu: what "auto" means on this machine."""
    if importlib.util.find_spec("pyx.cuda_backend") is None:   # built without nvcc
        return "cpu"
    from pyx.cuda_backend import device_count   # the optional extension, once known to exist
    return "cuda" if device_count() > 0 else "cpu"


def make_backend(config, rank: int = 0):
    """The backend of an EngineConfig (its backend already resolved from "auto"); `rank`: a
    tensor-parallel rank's, on its device, or its share of the CPUs."""
    # Our OpenMP kernels use every core; NumPy's BLAS must not start a second pool beside them.
    threadpool_limits(limits=1, user_api="blas")
    log_kernels(config.kernels, config.backend)
    if config.backend == "cpu":
        from pyx.cpu_backend import CpuBackend
        num_threads = None
        if config.world_size > 1 and not cpu_threads.user_num_threads():
            # the ranks split the CPUs (a fixed count: one rank is no other's contention)
            num_threads = max(1, cpu_threads.usable_cpus()[0] // config.world_size)
        backend = CpuBackend(batch_invariant=config.batch_invariant, kernels=config.kernels,
                             num_threads=num_threads)
        log.info("CPU backend: %s", cpu_threads.describe(backend.num_threads,
                                                           backend.governor is not None))
        return backend
    if config.backend == "cuda":
        try:   # the optional extension: only builds with nvcc have it
            from pyx.cuda_backend import CudaBackend
        except ImportError as e:
            raise ValueError("this build of Taper has no CUDA backend (it was installed without "
                             "nvcc, or with TAPER_CUDA=0); reinstall where nvcc is on PATH") from e
        device = (config.device_ids[rank] if config.device_ids else config.device + rank)
        return CudaBackend(dtype=CUDA_ACT_DTYPES[config.dtype], device=device,
                           kernels=config.kernels)
    raise ValueError(f"unknown backend {config.backend!r}: cpu or cuda")


def log_kernels(kernels: KernelConfig, backend: str) -> None:
    """The start-up lines: every kernel choice the backend reads with its source, the ones set
    that it does not read, and the retired environment variables still set."""
    line, unused = kernels.describe(backend)
    log.info("kernels (%s backend): %s", backend, line)
    for item in unused:
        log.warning("kernels %s: the %s backend has no such choice; ignored", item, backend)
    for warning in retired_variables():
        log.warning(warning)
